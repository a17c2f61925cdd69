"""``gspo-import-gguf FILE OUT [--dtype bfloat16|float32]``: a GGUF model file as a Hugging Face model folder.

GGUF (llama.cpp's format) is how many small chat models are shipped. transformers reads it
(``from_pretrained(folder, gguf_file=...)``, dequantizing every tensor) but then holds a GGUF-"quantized" model
that ``save_pretrained`` refuses; vLLM and the learner want a plain folder. This module does the hand-over:

1. the file's architecture is checked against transformers' GGUF loader (``load_gguf_checkpoint``, metadata
   only); an unsupported one, or one that is not a causal LM, is refused by name;
2. tokenizer (with its chat template) and model are read through transformers' GGUF loader, in ``--dtype``;
3. the weights move into a plain model built from the same config without its ``quantization_config``;
4. the folder gets ``model.safetensors``, ``config.json``, the tokenizer files, ``chat_template.jinja`` (when the
   file carries a template) and a ``generation_config.json`` that lists every EOS id (the config's and the
   tokenizer's end token), so the rollout engine stops on them.

Dequantized weights are what the quantized file encodes (a Q4 file stays a Q4-quality model in float32).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16")
# transformers' GGUF loader also reads these, but none is a decoder-only causal LM
NOT_CAUSAL = {"t5", "umt5", "t5encoder"}


def gguf_model_type(gguf_file: str | Path) -> str:
    """The transformers ``model_type`` of a GGUF file (metadata only, no tensors read).

    Raises:
        FileNotFoundError: ``gguf_file`` is not a file.
        ValueError: an architecture transformers' GGUF loader does not read, or one that is not a causal LM
            (the message names it and lists the supported ones).
    """
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, load_gguf_checkpoint

    path = Path(gguf_file)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    supported = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"} - NOT_CAUSAL)
    try:
        meta = load_gguf_checkpoint(str(path), return_tensors=False)
    except ValueError as e:
        raise ValueError(f"{path.name}: {e} (transformers reads these causal-LM GGUF architectures: "
                         f"{', '.join(supported)})") from None
    model_type = str(meta["config"].get("model_type"))
    if model_type in NOT_CAUSAL:
        raise ValueError(f"{path.name}: GGUF architecture {model_type!r} is not a causal language model "
                         f"(supported: {', '.join(supported)})")
    return model_type


def eos_ids(config: Any, tokenizer: Any) -> list[int]:
    """Every end-of-sequence id the model config and the tokenizer declare, sorted, without repeats."""
    out: set[int] = set()
    for value in (getattr(config, "eos_token_id", None), tokenizer.eos_token_id):
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v >= 0:
                out.add(v)
    return sorted(out)


def import_gguf(gguf_file: str | Path, out_dir: str | Path, dtype: str = "float32") -> dict[str, Any]:
    """Convert one GGUF model file into a Hugging Face folder ``out_dir`` (created; files in it are overwritten).

    Args:
        gguf_file: path of the ``.gguf`` file.
        out_dir: the folder to write.
        dtype: ``"float32"`` or ``"bfloat16"``: the saved weights' dtype (GGUF tensors are dequantized into it).

    Returns:
        a summary: ``model_type``, ``architecture`` (the transformers class), ``parameters``, ``vocab_size``,
        ``eos_token_ids``, ``chat_template`` (bool), ``tie_word_embeddings``, ``dtype``, ``out_dir``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: ``dtype`` not one of ``DTYPES``; an architecture refused by ``gguf_model_type``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    path = Path(gguf_file).resolve()
    model_type = gguf_model_type(path)
    torch_dtype = getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    source = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch_dtype)
    config = copy.deepcopy(source.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")  # save_pretrained refuses a model that carries it
    config.name_or_path = ""
    plain = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    plain.load_state_dict(source.state_dict(), strict=True)
    del source
    eos = eos_ids(config, tokenizer)
    generation = GenerationConfig.from_model_config(config)
    generation.eos_token_id = eos if len(eos) > 1 else eos[0]
    if generation.pad_token_id is None and tokenizer.pad_token_id is not None:
        generation.pad_token_id = tokenizer.pad_token_id
    plain.generation_config = generation
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return {"model_type": model_type, "architecture": type(plain).__name__,
            "parameters": sum(p.numel() for p in plain.parameters()), "vocab_size": int(config.vocab_size),
            "eos_token_ids": eos, "chat_template": bool(getattr(tokenizer, "chat_template", None)),
            "tie_word_embeddings": bool(config.tie_word_embeddings), "dtype": dtype, "out_dir": str(out)}


def main(argv: list[str] | None = None) -> int:
    """Command line: ``gspo-import-gguf FILE OUT [--dtype float32|bfloat16]``; prints the summary. Returns 0, or 2
    with the error on stderr for a refused file or option."""
    parser = argparse.ArgumentParser(prog="gspo-import-gguf", description=__doc__.split("\n\n")[0])
    parser.add_argument("file", help="the .gguf model file")
    parser.add_argument("out", help="the Hugging Face folder to write")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="saved weight dtype (default float32)")
    args = parser.parse_args(argv)
    try:
        summary = import_gguf(args.file, args.out, args.dtype)
    except (FileNotFoundError, ValueError) as e:
        print(f"gspo-import-gguf: {e}", file=sys.stderr)
        return 2
    for key, value in summary.items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
