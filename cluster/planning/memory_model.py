"""The memory model behind the resource plan (``cluster/planning/plan.py``): per-token and per-rank byte counts from a
model's architecture (``model.shape``), torch-free so that ``--dry-run`` imports nothing heavy.

All results are bytes unless a name ends in ``_gib``. ``b`` is the bytes of one element of the dtype named.
The terms and their sources (docs/cluster.md, "Memory model", explains them with the numbers of the GPU configs):

- KV cache (vLLM, ``vllm/v1/kv_cache_interface.py`` ``AttentionSpec.page_size_bytes``): per token and layer one
  key and one value of ``num_key_value_heads x head_dim`` elements; a tensor-parallel engine splits the KV
  heads over its GPUs (each GPU keeps at least one head: vLLM replicates heads when TP exceeds them). vLLM
  hands out whole blocks of ``KV_BLOCK_TOKENS`` tokens.
- Activations kept for the backward, per token and decoder layer (Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models", Sec. 4.1, without the ``5as/h`` attention-score term:
  transformers' SDPA attention keeps no score matrix), counted for a Qwen3 layer in elements:
  attention ``3h + 3A + 4K`` (the two norms' inputs and the residual, Q/K/V projections, Q/K norms and rotary
  outputs, attention output; ``A = heads x head_dim``, ``K = kv_heads x head_dim``), a SwiGLU MLP
  ``2h + 4I`` (norm, gate, up, activation, product), an MoE block ``2h + E + 2kh + 4kI_e`` (norm, router logits,
  the token copied to its ``k`` experts and their outputs, each expert's SwiGLU). With gradient checkpointing
  (transformers, non-reentrant) only each layer's input ``h`` is kept, plus one layer's full set while it is
  recomputed.
- Logits: ``V`` per token in the model dtype and, in the backward, their gradient in the same dtype; the
  float32 softmax work runs in chunks of about ``2**25`` logits (``learner/logprobs.py``, ``token_log_probs``),
  a few such float32 chunks alive at once: ``2 V b`` bytes per token + ``min(LOGPROB_CHUNK_BYTES, 12 T V)``.
- ZeRO-3 gathered working set (DeepSpeed 0.19.8 ``deepspeed/runtime/zero/config.py`` defaults, checked against
  the installed DeepSpeed by tests/unit/cluster/test_plan.py): at most ``stage3_max_live_parameters +
  stage3_prefetch_bucket_size`` parameters gathered at once, never fewer than the largest layer's.
"""

from __future__ import annotations

import math
from typing import Any

#: bytes of one element of each dtype name used in the config.
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: vLLM's default KV block size (tokens) on CUDA and on the CPU (``vllm/config/cache.py``).
KV_BLOCK_TOKENS = 16
#: DeepSpeed 0.19.8 defaults: ``stage3_max_live_parameters`` and ``stage3_prefetch_bucket_size``.
ZERO3_MAX_LIVE_PARAMETERS = 1_000_000_000
ZERO3_PREFETCH_BUCKET_SIZE = 50_000_000
GIB = float(2**30)
#: GiB of one learner rank beyond its model state: the CUDA context, NCCL and DeepSpeed's communication buckets
#: (at ZeRO 2-3 with contiguous gradients, one reduce buffer of ``reduce_bucket_size`` = 5e8 elements in the
#: communication dtype, float32 in every run since bf16 reduces in fp32 (learner/ds_config.py): 1.86 GiB).
LEARNER_OVERHEAD_GIB = 4.0
#: float32 chunks of ``learner.logprobs.token_log_probs`` alive at once (logits, exp, gradient), 2**25 each.
LOGPROB_CHUNK_BYTES = 3 * 4 * 2**25


#: vLLM's ``max_num_seqs`` on the CPU for the offline ``LLM`` class (``vllm/engine/arg_utils.py``, 256 per rank).
ENGINE_MAX_NUM_SEQS_CPU = 256
#: float32 vocabulary-wide buffers per sequence that a CPU engine's sampler keeps from its warm-up over
#: ``max_num_seqs`` sequences (logits, their log-softmax, probabilities, sorted copies): fitted to the 0.25 GiB a
#: 49k-vocabulary engine held beyond weights, KV cache and base before any sync (docs/real_model.md, "Memory").
ENGINE_SAMPLER_COPIES = 5


def engine_sampler_bytes(shape: Any | None) -> int:
    """Host bytes a CPU engine's sampler keeps: ``ENGINE_SAMPLER_COPIES x ENGINE_MAX_NUM_SEQS_CPU x V x 4``
    (0 without a shape)."""
    return 0 if shape is None else ENGINE_SAMPLER_COPIES * ENGINE_MAX_NUM_SEQS_CPU * shape.vocab_size * 4


def _get(shape: Any, key: str, default: int = 0) -> int:
    return int(getattr(shape, key, default) or 0)


def param_count(shape: Any) -> int:
    """Parameters of a Qwen3 (dense or MoE) causal LM of ``shape`` (a ``cluster.config_sections.ModelShape``).

    ``V h`` embedding (+ ``V h`` output head unless tied) + ``h`` final norm + per layer: Q/K/V/O projections
    ``2hA + 2hK``, Q/K norms ``2 head_dim``, two norms ``2h``, and the MLP: dense ``3 h I`` or MoE router
    ``h E`` + experts ``3 E h I_e``. (Qwen3 has no attention or MLP biases.)
    """
    h, v, hd = shape.hidden_size, shape.vocab_size, shape.head_dim
    a, k = shape.num_attention_heads * hd, shape.num_key_value_heads * hd
    layer = 2 * h * a + 2 * h * k + 2 * hd + 2 * h
    if _get(shape, "num_experts"):
        layer += h * shape.num_experts + 3 * shape.num_experts * h * shape.moe_intermediate_size
    else:
        layer += 3 * h * shape.intermediate_size
    return v * h * (1 if shape.tie_word_embeddings else 2) + h + shape.num_layers * layer


def lora_trainable_params(shape: Any | None, rank: int | None, targets: str | list[str]) -> int | None:
    """Parameters of a LoRA adapter (Hu et al., arXiv 2106.09685, Eq. 3: ``A [r, in]`` and ``B [out, r]`` per
    adapted linear layer, so ``r (in + out)``) over the decoder layers of ``shape``.

    Args:
        shape: a ``cluster.config_sections.ModelShape``, or None.
        rank: ``learner.lora.rank`` r (0 or None: LoRA off).
        targets: ``learner.lora.target_modules``: names among ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` and, on
            a dense model, ``gate_proj``, ``up_proj``, ``down_proj``; or ``'all-linear'`` (all seven, dense only).

    Returns:
        The count, or None where the shape does not give it: no shape, LoRA off, another name, or an MLP
        target (``'all-linear'`` included) on an MoE, which the learner refuses anyway (learner/lora.py).
    """
    if shape is None or not rank:
        return None
    h, hd = shape.hidden_size, shape.head_dim
    a, k = shape.num_attention_heads * hd, shape.num_key_value_heads * hd
    sizes = {"q_proj": h + a, "k_proj": h + k, "v_proj": h + k, "o_proj": a + h}
    if not _get(shape, "num_experts"):
        i = shape.intermediate_size
        sizes.update(gate_proj=h + i, up_proj=h + i, down_proj=i + h)
    names = list(sizes) if targets == "all-linear" and len(sizes) == 7 else targets
    if isinstance(names, str) or any(t not in sizes for t in names):
        return None
    return shape.num_layers * rank * sum(sizes[t] for t in set(names))


def largest_layer_params(shape: Any) -> int:
    """Parameters of the largest single module ZeRO-3 gathers at once: a decoder layer or the embedding."""
    per_layer = (param_count(shape) - shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)
                 - shape.hidden_size) // shape.num_layers
    return max(per_layer, shape.vocab_size * shape.hidden_size)


def kv_bytes_per_token(shape: Any, *, dtype: str, tensor_parallel_size: int) -> int:
    """KV cache bytes of one token on ONE GPU of an engine: ``2 L ceil(kv_heads / tp) head_dim b``."""
    heads = math.ceil(shape.num_key_value_heads / tensor_parallel_size)
    return 2 * shape.num_layers * heads * shape.head_dim * BYTES[dtype]


def kv_tokens(kv_bytes_per_gpu: float, shape: Any, *, dtype: str, tensor_parallel_size: int) -> int:
    """Tokens an engine's KV cache holds when each of its GPUs (or its CPU) gives it ``kv_bytes_per_gpu``
    bytes: whole blocks of ``KV_BLOCK_TOKENS``."""
    per = kv_bytes_per_token(shape, dtype=dtype, tensor_parallel_size=tensor_parallel_size)
    blocks = int(max(0.0, kv_bytes_per_gpu) // (per * KV_BLOCK_TOKENS))
    return blocks * KV_BLOCK_TOKENS


def kv_tokens_needed(sequences: int, sequence_tokens: int) -> int:
    """KV tokens ``sequences`` sequences of ``sequence_tokens`` tokens take at once (whole blocks each)."""
    return sequences * math.ceil(sequence_tokens / KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS


def layer_activation_elems(shape: Any) -> int:
    """Elements one token keeps for the backward in one decoder layer without checkpointing (module docstring)."""
    h, hd = shape.hidden_size, shape.head_dim
    a, k = shape.num_attention_heads * hd, shape.num_key_value_heads * hd
    attn = 3 * h + 3 * a + 4 * k
    if _get(shape, "num_experts"):
        top = shape.num_experts_per_tok
        mlp = 2 * h + shape.num_experts + 2 * top * h + 4 * top * shape.moe_intermediate_size
    else:
        mlp = 2 * h + 4 * shape.intermediate_size
    return attn + mlp


def activation_bytes(shape: Any, tokens: int, *, dtype: str, checkpointing: bool) -> int:
    """Activation bytes a training forward of ``tokens`` tokens keeps until its backward.

    Without checkpointing ``tokens x L x layer_activation_elems x b``; with it ``tokens x (L h +
    layer_activation_elems) x b`` (each layer's input, plus one layer recomputed at a time).
    """
    per_layer = layer_activation_elems(shape)
    elems = shape.num_layers * shape.hidden_size + per_layer if checkpointing else shape.num_layers * per_layer
    return tokens * elems * BYTES[dtype]


def logits_bytes(shape: Any, tokens: int, *, dtype: str) -> int:
    """Logit bytes of a training pass of ``tokens`` tokens: ``2 tokens V b + LOGPROB_CHUNK_BYTES`` (module
    docstring)."""
    return 2 * tokens * shape.vocab_size * BYTES[dtype] + min(LOGPROB_CHUNK_BYTES, 12 * tokens * shape.vocab_size)


def zero3_gathered_bytes(shape: Any | None, num_params: float, *, dtype: str) -> float:
    """Bytes of parameters a ZeRO-3 rank holds gathered at once: ``b min(P, max(largest layer, max_live +
    prefetch bucket))`` (DeepSpeed defaults above)."""
    live = ZERO3_MAX_LIVE_PARAMETERS + ZERO3_PREFETCH_BUCKET_SIZE
    if shape is not None:
        live = max(live, largest_layer_params(shape))
    return BYTES[dtype] * min(float(num_params), float(live))


def micro_batch_tokens(learner_cfg: Any, max_model_len: int) -> int:
    """Largest number of tokens (padding included) in one micro-batch: the token budget
    ``learner.max_tokens_per_micro_batch`` (a longer row goes alone, so at least ``max_model_len``), else
    ``learner.micro_batch_size`` rows padded to ``rollout.max_model_len``."""
    budget = learner_cfg.max_tokens_per_micro_batch
    if budget:
        return max(int(budget), int(max_model_len))
    return int(learner_cfg.micro_batch_size) * int(max_model_len)


# ------------------------------------------------- static memory of a learner rank and an engine's weights


def _check_learner_args(num_params: float, zero_stage: int, dtype: str, world_size: int) -> None:
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"learner dtype {dtype!r}: expected 'bfloat16' or 'float32'")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r} must be 0, 1, 2 or 3")
    if world_size < 1 or num_params <= 0:
        raise ValueError(f"world_size={world_size!r} must be >= 1 and num_params={num_params!r} > 0")


def learner_memory_gib(num_params: float, *, zero_stage: int, dtype: str, world_size: int,
                       reference_model: bool = False, offload_optimizer: bool = False,
                       trainable_params: float | None = None) -> dict[str, float]:
    """Static memory of one learner rank (see the module docstring for the formula and its source).

    Args:
        num_params: parameter count P (not billions).
        zero_stage: DeepSpeed ZeRO stage 0-3.
        dtype: training dtype, ``"bfloat16"`` or ``"float32"``.
        world_size: data-parallel ranks N (>= 1).
        reference_model: a frozen reference copy is held (``kl_coef > 0``).
        offload_optimizer: ZeRO-Offload of the optimizer to the host (``learner.offload_optimizer='cpu'``): the
            optimizer term, and at stage 3 the gradient term, are 0 here (``learner_host_offload_gib`` has them).
        trainable_params: LoRA's adapter parameters T (``lora_trainable_params``), or None (all P train): with T
            the weights are ``b (P + T)`` and the gradients and optimizer count T instead of P.

    Returns:
        GiB per rank on its device: ``weights``, ``gradients``, ``optimizer``, ``reference``, ``overhead`` and
        ``total``.

    Raises:
        ValueError: unknown dtype, a stage outside 0-3 (or 0 with ``offload_optimizer``), ``world_size < 1`` or
            ``num_params <= 0``.
    """
    _check_learner_args(num_params, zero_stage, dtype, world_size)
    if offload_optimizer and zero_stage == 0:
        raise ValueError("offload_optimizer needs zero_stage >= 1")
    b = BYTES[dtype]
    k = 12 if dtype == "bfloat16" else 8
    n = world_size
    t = num_params if trainable_params is None else trainable_params
    parts = {
        "weights": b * (num_params + (trainable_params or 0)) / (n if zero_stage >= 3 else 1),
        "gradients": 4 * t / (n if zero_stage >= 2 else 1),  # accumulated in fp32 (ds_config.py)
        "optimizer": k * t / (n if zero_stage >= 1 else 1),
        "reference": b * num_params if reference_model else 0.0,
    }
    if offload_optimizer:
        parts["optimizer"] = 0.0
        if zero_stage == 3:
            parts["gradients"] = 0.0
    out = {key: v / GIB for key, v in parts.items()}
    out["overhead"] = LEARNER_OVERHEAD_GIB
    out["total"] = sum(out.values())
    return out


def add_critic_gib(lm: dict[str, float], num_params: float, *, zero_stage: int, dtype: str, world_size: int,
                   offload_optimizer: bool = False) -> dict[str, float]:
    """``lm`` (``learner_memory_gib``'s result) with PPO's critic added (``learner.algorithm='ppo'``,
    ``learner/critic.py``): a second DeepSpeed engine in the same rank process, its weights, gradients and
    AdamW state partitioned by the same ZeRO rules as the policy's, no second overhead. ``num_params`` is the
    critic's P; the policy's P is a bound from above (the critic drops the LM head for a scalar head).

    Returns:
        ``lm`` with ``critic`` (GiB per rank) added to it and to ``total``.
    """
    c = learner_memory_gib(num_params, zero_stage=zero_stage, dtype=dtype, world_size=world_size,
                           offload_optimizer=offload_optimizer)
    critic = c["weights"] + c["gradients"] + c["optimizer"]
    return {**{k: v for k, v in lm.items() if k != "total"}, "critic": critic, "total": lm["total"] + critic}


def learner_host_offload_gib(num_params: float, *, zero_stage: int, dtype: str, world_size: int) -> dict[str, float]:
    """Host RAM one learner rank adds with ``learner.offload_optimizer='cpu'`` (module docstring).

    Args:
        num_params, zero_stage, dtype, world_size: as for ``learner_memory_gib`` (P, stage 1-3, N).

    Returns:
        GiB per rank: ``optimizer`` (``12 P / N``: the fp32 master partition, a host copy in either dtype,
        and Adam's two moments), ``gradients`` (``4 P / N`` fp32, twice at stage 3 or in float32) and
        ``total``.

    Raises:
        ValueError: as ``learner_memory_gib``, and ``zero_stage == 0`` (nothing to offload).
    """
    _check_learner_args(num_params, zero_stage, dtype, world_size)
    if zero_stage == 0:
        raise ValueError("offload_optimizer needs zero_stage >= 1")
    grad_copies = 2 if zero_stage == 3 or dtype == "float32" else 1
    out = {"optimizer": 12 * num_params / world_size / GIB,
           "gradients": grad_copies * 4 * num_params / world_size / GIB}
    out["total"] = out["optimizer"] + out["gradients"]
    return out


def fused_expert_params(shape: Any | None, num_params: float) -> float:
    """Parameters in an MoE's expert weights (``3 E h I_e`` per layer), which transformers 5 fuses into one
    ``[E, ...]`` tensor per layer at load; 0 for a dense shape; ``num_params`` when the shape is unknown (the
    safe side: all of them)."""
    if shape is None:
        return float(num_params)
    if not _get(shape, "num_experts"):
        return 0.0
    return float(shape.num_layers * 3 * shape.num_experts * shape.hidden_size * shape.moe_intermediate_size)


def zero3_load_host_gib(shape: Any | None, num_params: float, *, dtype: str) -> float:
    """Host RAM, GiB, one ZeRO-3 rank holds while transformers loads the checkpoint under ``deepspeed.zero.Init``
    (``HfDeepSpeedConfig``), before the optimizer exists.

    transformers 5.19 (``modeling_utils.PreTrainedModel._load_pretrained_model``, ZeRO-3 branch) reads EVERY
    checkpoint file into one merged state dict on EVERY rank (``load_state_dict(..., map_location="cpu")``), then
    ``integrations.deepspeed._apply_weight_conversions_to_state_dict`` stacks the per-expert tensors of an MoE
    into the fused ``[E, ...]`` tensors (new memory, while the per-expert tensors stay referenced until all
    layers are converted); only then does rank 0 copy each layer into its gathered parameters. OpenRLHF loads
    the same way (``HfDeepSpeedConfig`` then ``from_pretrained`` on every rank). Per rank:

        b (P + P_fused)        (b: bytes of ``dtype``; P_fused: ``fused_expert_params``)

    Read-only memory maps of the files may be shared between the ranks of a node by the page cache; counted
    here as private, the safe side. Measured for a ~1 B MoE by ``cluster.tools.gpu_learner_check`` (docs/cluster.md).
    """
    return BYTES[dtype] * (num_params + fused_expert_params(shape, num_params)) / GIB


def rollout_weights_gib(num_params: float, *, dtype: str, tensor_parallel_size: int) -> float:
    """GiB of model weights on each GPU of one vLLM engine: ``b_r P / tensor_parallel_size``."""
    return BYTES[dtype] * num_params / tensor_parallel_size / GIB
