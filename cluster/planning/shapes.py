"""A model folder's architecture for the resource plan (``cluster/planning/plan.py``), read from its
``config.json`` without torch or transformers, so that ``--dry-run`` plans a local model's KV cache, activations
and logits without ``model.shape``."""

from __future__ import annotations

import json
import math
from pathlib import Path

from cluster.config_sections import ModelShape


def folder_shape(folder: str | Path) -> ModelShape | None:
    """A ``ModelShape`` from a Hugging Face folder's ``config.json`` (transformers' key names: Llama, Qwen2/3,
    Qwen3-MoE ``num_experts``, Mixtral ``num_local_experts`` whose experts have ``intermediate_size``); None when
    the folder or its config is absent. A model whose config nests the text model (``text_config``) is read there.
    """
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    c = json.loads(path.read_text())
    c = {**c, **c.get("text_config", {})}
    heads = int(c["num_attention_heads"])
    experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)
    moe_size = int(c.get("moe_intermediate_size") or (c.get("intermediate_size") if experts else 0) or 0)
    return ModelShape(
        num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"], num_attention_heads=heads,
        num_key_value_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads, vocab_size=c["vocab_size"],
        intermediate_size=0 if experts and not c.get("moe_intermediate_size") else c.get("intermediate_size", 0),
        moe_intermediate_size=moe_size if experts else 0, num_experts=experts,
        num_experts_per_tok=c.get("num_experts_per_tok", 0) if experts else 0,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)))


def safetensors_params(folder: str | Path) -> int | None:
    """Parameters stored in a folder's ``*.safetensors`` files (every shard of a split checkpoint), counted from
    each file's header through the safetensors library (``safe_open``: the shape of every tensor, whatever the
    stored dtype; no tensor data is read). None when the folder holds no such file.

    Raises:
        ValueError: a file that is not a readable safetensors file (names the file).
    """
    from safetensors import SafetensorError, safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        try:
            with safe_open(str(f), framework="numpy") as st:
                total += sum(math.prod(st.get_slice(name).get_shape()) for name in st.keys())
        except (OSError, SafetensorError) as err:
            raise ValueError(f"{f}: not a readable safetensors header ({type(err).__name__}: {err})") from None
    return total
