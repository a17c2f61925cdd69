"""A bf16 learner's attention in float32 on the CPU (learner/attention.py): the same numbers as float32 SDPA on
the upcast inputs, the switch only for bf16 models using SDPA, and the model's forward through it."""

from __future__ import annotations

import torch

from learner.attention import SDPA_FP32, sdpa_fp32, use_fp32_attention


class _Module(torch.nn.Module):
    is_causal = True


def _tiny_llama(dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to(dtype)


def test_sdpa_fp32_computes_in_float32_and_returns_the_inputs_dtype():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g).to(torch.bfloat16) for _ in range(3))
    out, _ = sdpa_fp32(_Module(), q, k, v, None, is_causal=True)
    want, _ = sdpa_attention_forward(_Module(), q.float(), k.float(), v.float(), None, is_causal=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.to(torch.bfloat16))
    plain, _ = sdpa_attention_forward(_Module(), q, k, v, None, is_causal=True)
    assert not torch.equal(out, plain)  # bf16 SDPA differs: the upcast is what ran
    q32 = q.float()
    out32, _ = sdpa_fp32(_Module(), q32, k.float(), v.float(), None, is_causal=True)
    assert out32.dtype == torch.float32 and torch.equal(out32, want)  # float32 inputs: SDPA unchanged


def test_only_bf16_sdpa_models_on_the_cpu_switch_and_their_forward_matches():
    assert not use_fp32_attention(_tiny_llama(torch.float32))
    model = _tiny_llama(torch.bfloat16)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(2))
    before = model(input_ids=ids).logits
    assert use_fp32_attention(model) and model.config._attn_implementation == SDPA_FP32
    after = model(input_ids=ids).logits
    assert after.dtype == torch.bfloat16 and not torch.equal(before, after)
    reference = _tiny_llama(torch.float32)(input_ids=ids).logits  # same seed: the float32 weights
    assert (after.float() - reference).abs().max() <= (before.float() - reference).abs().max() + 0.05
    eager = _tiny_llama(torch.bfloat16)
    eager.config._attn_implementation = "eager"
    assert not use_fp32_attention(eager)
