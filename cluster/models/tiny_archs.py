"""Tiny random models of several causal-LM architectures that transformers and vLLM both load, built locally.

``build_tiny_arch(out_dir, arch)`` writes a Hugging Face folder (``config.json``, ``generation_config.json``,
``model.safetensors``, the character tokenizer of ``cluster.models.tiny_model``) holding a seeded random init of
one of the architectures in ``ARCHS``. No hub access. Used by the architecture test matrix
(``tests/integration/test_architectures.py``, ``make test-matrix``) and by ``model.path: builtin:tiny_<arch>``.

Every model is float32, 2 decoder layers, hidden size 64, 2 query heads of size 32 over 1 KV head (shapes
the vLLM CPU kernels run exactly: hidden and expert sizes multiples of 32, head_dim 32; see
``../shared/docs/cpu-stack.md``); the MoE ones have 4 routed experts, top-2, expert size 64. What each one
covers (docs/architectures.md has the details and the quirks met):

==================  ===========================  =====================================================
arch                transformers class           what it exercises
==================  ===========================  =====================================================
``llama``           ``LlamaForCausalLM``         dense, untied, fused qkv / gate_up in vLLM
``qwen3_tied``      ``Qwen3ForCausalLM``         dense, tied embeddings, q/k norms
``qwen3_moe``       ``Qwen3MoeForCausalLM``      MoE, untied, normalised top-k
``qwen3_moe_tied``  ``Qwen3MoeForCausalLM``      MoE, tied embeddings
``mixtral``         ``MixtralForCausalLM``       MoE, ``block_sparse_moe`` with w1/w2/w3 experts
``mixtral_tied``    ``MixtralForCausalLM``       the same, tied embeddings (the upcycled SmolLM2's layout)
``qwen2_moe``       ``Qwen2MoeForCausalLM``      MoE with a gated shared expert, qkv bias, raw top-k
``olmoe``           ``OlmoeForCausalLM``         MoE, q/k norms over the whole projection, raw top-k
==================  ===========================  =====================================================
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from cluster.models.tiny_model import (
    BOS_TOKEN,
    BUILD_FORMAT_VERSION,
    BUILD_INFO_FILE,
    EOS_TOKEN,
    PAD_TOKEN,
    VOCAB_SIZE,
    build_char_tokenizer,
    char_vocab,
    install_build,
)

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 2, 2, 1, 32
EXPERTS, TOP_K, EXPERT_SIZE, DENSE_SIZE = 4, 2, 64, 128

# arch -> (transformers config class, model class, tie_word_embeddings, extra config arguments)
ARCHS: dict[str, tuple[str, str, bool, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", False, {"intermediate_size": DENSE_SIZE}),
    "qwen3_tied": ("Qwen3Config", "Qwen3ForCausalLM", True, {"intermediate_size": DENSE_SIZE}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", False, {
        "intermediate_size": DENSE_SIZE, "moe_intermediate_size": EXPERT_SIZE, "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}),
    "qwen3_moe_tied": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", True, {
        "intermediate_size": DENSE_SIZE, "moe_intermediate_size": EXPERT_SIZE, "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", False, {
        "intermediate_size": EXPERT_SIZE, "num_local_experts": EXPERTS, "num_experts_per_tok": TOP_K}),
    "mixtral_tied": ("MixtralConfig", "MixtralForCausalLM", True, {
        "intermediate_size": EXPERT_SIZE, "num_local_experts": EXPERTS, "num_experts_per_tok": TOP_K}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", False, {
        "intermediate_size": DENSE_SIZE, "moe_intermediate_size": EXPERT_SIZE, "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K, "shared_expert_intermediate_size": EXPERT_SIZE, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": False, "qkv_bias": True}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", False, {
        "intermediate_size": EXPERT_SIZE, "num_experts": EXPERTS, "num_experts_per_tok": TOP_K,
        "norm_topk_prob": False}),
}
BUILTIN_PREFIX = "builtin:tiny_"


def _write_arch(folder: Path, args: dict[str, Any]) -> None:
    import torch
    import transformers
    from transformers import GenerationConfig

    config_cls, model_cls, tied, extra = ARCHS[args["arch"]]
    vocab = char_vocab()
    config = getattr(transformers, config_cls)(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=args["max_position_embeddings"],
        tie_word_embeddings=tied, pad_token_id=vocab[PAD_TOKEN], bos_token_id=vocab[BOS_TOKEN],
        eos_token_id=vocab[EOS_TOKEN], dtype="float32", **extra,
    )
    config.architectures = [model_cls]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args["seed"])
        model = getattr(transformers, model_cls)(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=vocab[BOS_TOKEN], eos_token_id=vocab[EOS_TOKEN], pad_token_id=vocab[PAD_TOKEN]
    )
    model.save_pretrained(folder, safe_serialization=True)
    build_char_tokenizer().save_pretrained(folder)
    (folder / BUILD_INFO_FILE).write_text(json.dumps(args, indent=1, sort_keys=True) + "\n")


def build_tiny_arch(out_dir: str | os.PathLike, arch: str, *, seed: int = 0, max_position_embeddings: int = 512) -> Path:
    """Build (or reuse) the tiny random ``arch`` model (a key of ``ARCHS``) in ``out_dir``; returns it as a Path.

    The weights are the transformers class's own random init under ``torch.manual_seed(seed)`` (the caller's
    RNG state is left untouched), float32: the same arguments give bit-identical weights. Building, reuse
    and replacement of ``out_dir`` as in ``cluster.models.tiny_model.install_build``.

    Raises:
        ValueError: an unknown ``arch`` or ``max_position_embeddings`` < 8.
        FileExistsError: ``out_dir`` exists and is not a tiny-model build (never overwritten).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is not one of the tiny architectures {sorted(ARCHS)}")
    if max_position_embeddings < 8:
        raise ValueError(f"max_position_embeddings={max_position_embeddings} must be >= 8")
    args = {"format_version": BUILD_FORMAT_VERSION, "vocab_size": VOCAB_SIZE, "arch": arch, "seed": int(seed),
            "max_position_embeddings": int(max_position_embeddings)}
    return install_build(out_dir, args, _write_arch)


def builtin_arch(path: str) -> str | None:
    """The arch named by ``model.path`` ``builtin:tiny_<arch>`` (``<arch>`` a key of ``ARCHS``), else None."""
    name = path.removeprefix(BUILTIN_PREFIX) if path.startswith(BUILTIN_PREFIX) else None
    return name if name in ARCHS else None
