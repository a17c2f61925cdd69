"""Attention in float32 for a bf16 learner on the CPU.

On the CPU, torch's SDPA (the math / flash kernels of ``scaled_dot_product_attention``) runs its forward and
backward slower in bfloat16 than in float32: measured 1.7x slower at the learner's shape (16 rows, 8 heads, 134
tokens, head_dim 64; forward + backward, one thread, AMD EPYC Zen 4 with avx512_bf16, 2026-12-05,
``bench/attention_dtype.py``), while upcasting the bf16 query, key and value to float32 around it costs 1.1x
float32's time. The profile of a bf16 learner update put attention's backward at 15% of it. So a bf16
model on the CPU runs attention through ``sdpa_fp32``: the inputs upcast, transformers' SDPA attention in float32,
the output cast back to the model's dtype. Every other layer stays bf16; attention's softmax and its sums gain
precision. On GPUs (fast bf16 SDPA kernels) and in float32 models nothing changes.

``use_fp32_attention(model)`` switches a transformers model whose attention is ``sdpa`` to ``SDPA_FP32`` (a
registered ``AttentionInterface`` name); ``learner.packing.bins_attention`` calls ``sdpa_fp32`` too.
"""

from __future__ import annotations

import torch

SDPA_FP32 = "gspo_sdpa_fp32"  # the registered transformers attention function name
LOW_PRECISION = (torch.bfloat16, torch.float16)


def sdpa_fp32(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kwargs):
    """transformers' ``sdpa_attention_forward`` with a CPU bf16/fp16 ``query [b, h, q, d]``, ``key`` and
    ``value [b, h_kv, k, d]`` computed in float32 (a floating ``attention_mask`` upcast too); the output
    ``[b, q, h, d]`` in the inputs' dtype. Other dtypes and devices: the SDPA call unchanged.

    Returns:
        ``(output, None)``, as transformers' attention functions."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = query.dtype
    if query.device.type != "cpu" or dtype not in LOW_PRECISION:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                          **kwargs)
    return out.to(dtype), weights


def use_fp32_attention(model) -> bool:
    """Run ``model``'s SDPA attention through ``sdpa_fp32`` when its weights are bf16/fp16 on the CPU; returns
    whether it was switched (a model with another attention implementation, float32 weights or on a GPU is left
    as it is)."""
    from transformers import AttentionInterface

    config = getattr(model, "module", model).config
    param = next(model.parameters(), None)
    if (param is None or param.device.type != "cpu" or param.dtype not in LOW_PRECISION
            or getattr(config, "_attn_implementation", None) != "sdpa"):
        return False
    if SDPA_FP32 not in AttentionInterface._global_mapping:
        AttentionInterface.register(SDPA_FP32, sdpa_fp32)
    config._attn_implementation = SDPA_FP32
    return True
