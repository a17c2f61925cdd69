"""The embedded tiny Qwen3-MoE and its character-level tokenizer, built locally and deterministically.

``build_tiny_moe`` writes a Hugging Face model folder (``config.json``, ``generation_config.json``,
``model.safetensors``, tokenizer files) that both transformers (``AutoModelForCausalLM`` /
``AutoTokenizer``) and vLLM load. No hub access: the tokenizer is made with the ``tokenizers`` library and the
weights are a seeded random init of ``transformers.Qwen3MoeForCausalLM``.

Tokenizer: one token per character. Vocabulary = the special tokens ``<pad>`` (0), ``<bos>`` (1), ``<eos>`` (2),
``<unk>`` (3), then every printable ASCII character (``" "`` to ``"~"``) and ``"\\n"``. Decoding concatenates
the characters exactly (spaces and newlines included). Nothing is added automatically when encoding (no BOS).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

BUILTIN_TINY_MOE = "builtin:tiny_moe"
BUILD_INFO_FILE = "tiny_moe_build.json"
BUILD_FORMAT_VERSION = 1

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = SPECIAL_TOKENS
CHARACTERS = [chr(c) for c in range(32, 127)] + ["\n"]
VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARACTERS)


def char_vocab() -> dict[str, int]:
    """Token string -> id of the character tokenizer: specials first (``<pad>`` = 0, ``<bos>`` = 1,
    ``<eos>`` = 2, ``<unk>`` = 3), then printable ASCII and ``"\\n"``."""
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}


def build_char_tokenizer():
    """The character-level tokenizer as a ``transformers.PreTrainedTokenizerFast``.

    Made with ``tokenizers``: a BPE model without merges (so every character is its own token, unknown
    characters map to ``<unk>``), no normalizer and no pre-tokenizer (spaces are ordinary tokens), and a
    ``Fuse`` decoder that concatenates the token strings exactly.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab=char_vocab(), merges=[], unk_token=UNK_TOKEN))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )
    fast.add_bos_token = False
    return fast


def _build_args(**kwargs: Any) -> dict[str, Any]:
    return {"format_version": BUILD_FORMAT_VERSION, "vocab_size": VOCAB_SIZE, **kwargs}


def _check_args(args: dict[str, Any]) -> None:
    """Raise ValueError for shapes the CPU kernels of vLLM cannot run exactly (cpu-stack.md)."""
    for key in ("hidden_size", "moe_intermediate_size"):
        if args[key] <= 0 or args[key] % 32:
            raise ValueError(f"{key}={args[key]} must be a positive multiple of 32 (vLLM CPU MoE kernel)")
    if args["head_dim"] not in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256):
        raise ValueError(f"head_dim={args['head_dim']} is not one the vLLM CPU attention supports (32, 64, 80, ...)")
    if args["num_attention_heads"] < 1 or args["num_key_value_heads"] < 1:
        raise ValueError(
            f"num_attention_heads={args['num_attention_heads']} and num_key_value_heads="
            f"{args['num_key_value_heads']} must be >= 1"
        )
    if args["num_attention_heads"] % args["num_key_value_heads"]:
        raise ValueError(
            f"num_attention_heads={args['num_attention_heads']} must be a multiple of "
            f"num_key_value_heads={args['num_key_value_heads']}"
        )
    if not 1 <= args["num_experts_per_tok"] <= args["num_experts"]:
        raise ValueError(
            f"num_experts_per_tok={args['num_experts_per_tok']} must be in [1, num_experts={args['num_experts']}]"
        )
    if args["num_layers"] < 1:
        raise ValueError(f"num_layers={args['num_layers']} must be >= 1")
    if args["max_position_embeddings"] < 8:
        raise ValueError(f"max_position_embeddings={args['max_position_embeddings']} must be >= 8")


def _read_build_info(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / BUILD_INFO_FILE).read_text())
    except (OSError, ValueError):
        return None


def _write_model(folder: Path, args: dict[str, Any]) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    vocab = char_vocab()
    config = Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=args["hidden_size"],
        intermediate_size=args["moe_intermediate_size"],
        num_hidden_layers=args["num_layers"],
        num_attention_heads=args["num_attention_heads"],
        num_key_value_heads=args["num_key_value_heads"],
        head_dim=args["head_dim"],
        max_position_embeddings=args["max_position_embeddings"],
        num_experts=args["num_experts"],
        num_experts_per_tok=args["num_experts_per_tok"],
        moe_intermediate_size=args["moe_intermediate_size"],
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        tie_word_embeddings=False,
        pad_token_id=vocab[PAD_TOKEN],
        bos_token_id=vocab[BOS_TOKEN],
        eos_token_id=vocab[EOS_TOKEN],
        dtype="float32",
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args["seed"])
        model = Qwen3MoeForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=vocab[BOS_TOKEN], eos_token_id=vocab[EOS_TOKEN], pad_token_id=vocab[PAD_TOKEN]
    )
    model.save_pretrained(folder, safe_serialization=True)
    build_char_tokenizer().save_pretrained(folder)
    (folder / BUILD_INFO_FILE).write_text(json.dumps(args, indent=1, sort_keys=True) + "\n")


def build_tiny_moe(
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 32,
    max_position_embeddings: int = 512,
) -> Path:
    """Build (or reuse) the tiny Qwen3-MoE in ``out_dir`` and return ``out_dir`` as a Path.

    The weights are ``Qwen3MoeForCausalLM``'s random init under ``torch.manual_seed(seed)`` (the caller's RNG
    state is left untouched), float32, so the same arguments give bit-identical weights. The folder is built in
    a temporary sibling folder and renamed into place; a folder that already holds a build with the same
    arguments (``tiny_moe_build.json``) is reused as is, one built with other arguments is replaced.

    Raises:
        ValueError: shapes the vLLM CPU kernels cannot run exactly (hidden_size or moe_intermediate_size not a
            multiple of 32, unsupported head_dim, heads not divisible by KV heads, top-k above the expert count).
        FileExistsError: ``out_dir`` exists and is not a tiny-model build (never overwritten).
    """
    args = _build_args(
        seed=int(seed),
        hidden_size=int(hidden_size),
        num_layers=int(num_layers),
        num_experts=int(num_experts),
        num_experts_per_tok=int(num_experts_per_tok),
        moe_intermediate_size=int(moe_intermediate_size),
        num_attention_heads=int(num_attention_heads),
        num_key_value_heads=int(num_key_value_heads),
        head_dim=int(head_dim),
        max_position_embeddings=int(max_position_embeddings),
    )
    _check_args(args)
    return install_build(out_dir, args, _write_model)


def install_build(out_dir: str | os.PathLike, args: dict[str, Any], write: Callable[[Path, dict[str, Any]], None]) -> Path:
    """Build a model folder with ``write(folder, args)`` into ``out_dir``, or reuse the build already there.

    ``write`` fills a temporary sibling folder, which is then renamed into place; it must also write
    ``args`` as the folder's build record (``tiny_moe_build.json``). A folder whose record equals ``args`` is
    reused as is, one built with other arguments is replaced; a concurrent builder of the same arguments is
    tolerated (the first rename wins).

    Raises:
        FileExistsError: ``out_dir`` exists and holds no build record (never overwritten).
    """
    out = Path(out_dir)
    if out.exists():
        info = _read_build_info(out)
        if info == args:
            return out
        if info is None:
            raise FileExistsError(f"out_dir={str(out)!r} exists and is not a tiny-model build; refusing to overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write(tmp, args)
        if out.exists():  # a build with other arguments: move it aside, then drop it
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / "model")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, out)
        except OSError:
            # Another process renamed its build into place first; reuse it when it has the same arguments.
            if _read_build_info(out) != args:
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_model(path_or_builtin: str, out_root: str | os.PathLike, **build_kwargs: Any) -> Path:
    """The model folder for ``model.path``: builds ``builtin:tiny_moe`` into ``out_root/tiny_moe`` (with
    ``build_kwargs`` passed to ``build_tiny_moe``), ``builtin:tiny_<arch>`` (``cluster.tiny_archs.ARCHS``)
    into ``out_root/tiny_<arch>`` (only ``build_kwargs["seed"]`` applies: their shapes are fixed), fetches a
    hub id (``owner/name`` naming no local path; ``cluster.hub_model``), or checks that a Hugging Face folder
    exists.

    Raises:
        FileNotFoundError: a folder path that does not exist or has no ``config.json``; a hub id the hub did not
            give.
        ValueError: an unknown ``builtin:`` name, or build arguments ``build_tiny_moe`` refuses.
    """
    if path_or_builtin.startswith("builtin:"):
        from cluster.tiny_archs import ARCHS, build_tiny_arch, builtin_arch

        arch = builtin_arch(path_or_builtin)
        if arch is not None:
            return build_tiny_arch(Path(out_root) / f"tiny_{arch}", arch, seed=build_kwargs.get("seed", 0))
        if path_or_builtin != BUILTIN_TINY_MOE:
            names = [BUILTIN_TINY_MOE] + [f"builtin:tiny_{a}" for a in ARCHS]
            raise ValueError(f"model.path={path_or_builtin!r}: the builtin models are {names}")
        return build_tiny_moe(Path(out_root) / "tiny_moe", **build_kwargs)
    from cluster import hub_model

    if hub_model.is_hub_id(path_or_builtin):
        return hub_model.download(path_or_builtin)  # a hub id: the snapshot folder (cluster/hub_model.py)
    path = Path(path_or_builtin).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model.path={path_or_builtin!r} is not a folder (give a Hugging Face model folder or {BUILTIN_TINY_MOE!r})"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.path={path_or_builtin!r} has no config.json (not a Hugging Face model folder)")
    return path
