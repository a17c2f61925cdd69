"""The memory budget of the resource plan (``cluster/planning/plan.py``): what every GPU and every host of the
placed actors (``actor_placement.py``) holds, checked against its memory, from the byte counts of
``memory_model``. Torch-free.

Memory per GPU (GiB = 2**30 bytes), with P = ``model.num_params_b`` x 1e9 parameters, N = ``learner.world_size``:

- learner rank (ZeRO paper, Rajbhandari et al. 2020, Sec. 5 and Fig. 1: (2 + 2 + K) P bytes for mixed
  precision Adam, each term divided by N once its ZeRO stage partitions it):

      weights   = b P / (N if stage >= 3 else 1)
      gradients = 4 P / (N if stage >= 2 else 1)   (fp32: data_types.grad_accum_dtype, learner/ds_config.py)
      optimizer = K P / (N if stage >= 1 else 1)
      reference = b P                      (only when learner.kl_coef > 0: an unsharded frozen copy)
      critic    = weights + gradients + optimizer of the critic (learner.algorithm: ppo, learner/critic.py: a
                  second engine in the rank; its P bounded by the policy's; doubled offloaded host partitions)
      total     = weights + gradients + optimizer + reference + critic + LEARNER_OVERHEAD_GIB

  With LoRA (``learner.lora.rank`` r > 0, learner/lora.py) the gradients and optimizer count the adapter's
  T = r x sum(in + out) of the adapted projections instead of P, and the weights are b (P + T)
  (``memory_model.lora_trainable_params``; where the shape does not give T, P is counted: a bound).

  b = 2 bytes (bfloat16) or 4 (float32); K = 12 for bfloat16 (fp32 master weights + Adam's two moments) and
  8 for float32 (the weights are the master copy; the two moments). ``LEARNER_OVERHEAD_GIB`` covers the CUDA
  context, NCCL and DeepSpeed's communication buckets. When ``model.shape`` is known (or the model is
  ``builtin:tiny_moe``) the rank's claim adds the working memory of one micro-batch of
  ``cluster.planning.memory_model.micro_batch_tokens`` tokens: activations (with or without
  ``learner.gradient_checkpointing``; both are reported), logits, and under ZeRO-3 the gathered parameters
  (``cluster/planning/memory_model.py`` has the formulas and their sources).

  With ``learner.offload_optimizer: cpu`` (ZeRO-Offload; DeepSpeed 0.19.8 ``deepspeed/runtime/zero/stage3.py``
  and ``stage_1_and_2.py``; tests/integration/test_optimizer_offload.py counts the host buffers of a real engine) the
  optimizer term leaves the GPU (``optimizer = 0``), and at ZeRO-3 so do the gradient partitions
  (``gradients = 0``: stage 3 allocates them on its optimizer device, the host; stages 1-2 still reduce them,
  and in bf16 accumulate them, on the GPU). Each rank holds instead, in host RAM (``learner_host_offload_gib``):

      optimizer = 12 P / N                  (the fp32 master partition, a host copy in either dtype, and
                                             Adam's two moments)
      gradients = 4 P / N x (2 at stage 3 or in float32, else 1)
                                            (the fp32 gradient CPU Adam steps with, and the fp32 accumulation
                                             buffer where the host holds it)
- rollout engine GPU: vLLM claims ``rollout.gpu_memory_utilization`` x the GPU's memory; inside it the weights
  take b_r P / ``tensor_parallel_size`` (b_r from ``rollout.dtype``; every expert of an MoE stays resident) plus
  ``ROLLOUT_OVERHEAD_GIB`` (activations, CUDA graphs); the rest is KV cache (on the CPU: ``rollout.kv_cache_gb``).
  With ``model.shape``, each engine's KV tokens are reported and a plan where one step's sequences
  (``trainer.prompts_per_step x trainer.group_size / rollout.num_engines`` at ``data.max_prompt_tokens +
  rollout.max_response_tokens``) do not fit at once is refused.
- host RAM per node (``host_ram_gib``): every process's base (``HOST_PROCESS_GIB``), the learner's host-side
  copies (a full ``b P`` per rank while loading at ZeRO 0-2; under ZeRO-3 on GPUs every rank still merges the
  whole checkpoint and the fused experts at load, ``memory_model.zero3_load_host_gib``, before any optimizer
  state exists, so the node's total takes the larger of that load and the training-time parts below; ``b P``
  more on rank 0 for the Hugging Face export of a checkpoint), each rank's offloaded optimizer state and
  gradients (above, with ``learner.offload_optimizer: cpu``), the object store's weight-sync buckets in flight
  on every node that sends or receives them, the driver (``HOST_PROCESS_GIB["driver"]``, on node 0), and on
  the CPU everything the GPU would hold: a rank's static and working memory, an engine's weights, KV cache,
  sampler buffers (``memory_model.engine_sampler_bytes``) and the growth of its first weight sync
  (``engine_sync_gib``). The served models' engines (the LLM judge's, the distillation teacher's; CPU engines
  that never sync, on node 0) hold each ``HOST_PROCESS_GIB["engine_cpu"]`` + their ``kv_cache_gb`` + ``b_s P_s``
  (b_s from their ``dtype``; P_s the policy's P when they serve the policy, else counted from a local folder's
  safetensors headers or config.json, else not counted and said so: ``served_params``). ``per_process`` gives
  one learner rank, engine, reward worker, served engine and the driver (``bench/memory_plan.py`` compares them
  with a run's peak RSS). Checked against ``cluster.host_memory_gib`` when set. The architecture comes from
  ``model.shape``, the tiny model's keys or the ``config.json`` of a local ``model.path`` (``folder_shape``).
- a GPU shared by fractional requests (``num_gpus_per_rank`` or ``num_gpus_per_engine`` below 1) must hold the
  sum of its occupants' claims.

Over budget raises ``PlanError`` naming the numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cluster.config import Config
from cluster.config_sections import ModelConfig, ModelShape
from cluster.models.tiny_model import BUILTIN_TINY_MOE, VOCAB_SIZE
from cluster.planning import memory_model as mm
from cluster.planning.actor_placement import PlanError, ServedModel, _Node, served_models
from cluster.planning.memory_model import (
    learner_host_offload_gib,
    learner_memory_gib,
    rollout_weights_gib,
    zero3_load_host_gib,
)
from cluster.planning.shapes import folder_shape, safetensors_params

ROLLOUT_OVERHEAD_GIB = 2.0
#: below this share of the GPU left free after everything modelled, the plan warns (it does not refuse).
MIN_FREE_SHARE = 0.05
#: host RAM of one process before any model state, GiB: Python, torch, DeepSpeed / vLLM and (on a GPU) the
#: CUDA runtime's host side. The "_cpu" values are the CPU runs' base RSS (docs/cluster.md, "Memory model").
HOST_PROCESS_GIB = {"learner": 6.0, "engine": 6.0, "learner_cpu": 0.7, "engine_cpu": 1.05, "reward": 0.15,
                    "driver": 0.7}
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_GIB = float(2**30)


def model_shape(cfg: Config) -> Any:
    """The architecture the plan models: ``model.shape``, or for ``builtin:tiny_moe`` its build keys (vocabulary
    from ``cluster.models.tiny_model``), or the ``config.json`` of a local ``model.path`` folder
    (``folder_shape``); None when unknown (a hub id not yet fetched, a ``builtin:tiny_<arch>``)."""
    m = cfg.model
    if m.shape is not None:
        return m.shape
    if m.path != BUILTIN_TINY_MOE:
        return folder_shape(m.path)
    return _tiny_moe_shape(m)


def _tiny_moe_shape(m: ModelConfig) -> ModelShape:
    """The shape ``builtin:tiny_moe`` is built with from the build keys of ``m``."""
    return ModelShape(num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
                      num_key_value_heads=m.num_key_value_heads, head_dim=m.head_dim, vocab_size=VOCAB_SIZE,
                      moe_intermediate_size=m.moe_intermediate_size, num_experts=m.num_experts,
                      num_experts_per_tok=m.num_experts_per_tok)


def num_params(cfg: Config) -> float | None:
    """P: ``model.num_params_b`` x 1e9, else counted from the model's shape (``memory_model.param_count``)."""
    if cfg.model.num_params_b:
        return cfg.model.num_params_b * 1e9
    shape = model_shape(cfg)
    return float(mm.param_count(shape)) if shape is not None else None


def learner_working_gib(cfg: Config, shape: Any, p: float) -> dict[str, float]:
    """One learner rank's working memory for one micro-batch, GiB: ``activations`` (as configured),
    ``activations_without_checkpointing``, ``activations_with_checkpointing``, ``logits``, ``gathered``
    (ZeRO-3 only) and ``total`` (activations as configured + logits + gathered); ``{}`` without a shape."""
    if shape is None:
        return {}
    lc = cfg.learner
    tokens = mm.micro_batch_tokens(lc, cfg.rollout.max_model_len)
    act = {ck: mm.activation_bytes(shape, tokens, dtype=lc.dtype, checkpointing=ck) / _GIB for ck in (False, True)}
    out = {"micro_batch_tokens": tokens, "activations": act[lc.gradient_checkpointing],
           "activations_without_checkpointing": act[False], "activations_with_checkpointing": act[True],
           "logits": mm.logits_bytes(shape, tokens, dtype=lc.dtype) / _GIB,
           "gathered": mm.zero3_gathered_bytes(shape, p, dtype=lc.dtype) / _GIB if lc.zero_stage == 3 else 0.0}
    out["total"] = out["activations"] + out["logits"] + out["gathered"]
    return out


def engine_kv(cfg: Config, shape: Any, kv_gib_per_gpu: float) -> dict[str, Any]:
    """Each engine's KV cache in tokens, and what one step asks of it.

    Raises:
        PlanError: one step's sequences per engine do not fit the cache at once (names the keys).
    """
    rc, tc, d = cfg.rollout, cfg.trainer, cfg.data
    tokens = mm.kv_tokens(kv_gib_per_gpu * _GIB, shape, dtype=rc.dtype, tensor_parallel_size=rc.tensor_parallel_size)
    seqs = -(-tc.prompts_per_step * tc.group_size // rc.num_engines)
    length = d.max_prompt_tokens + rc.max_response_tokens
    need = mm.kv_tokens_needed(seqs, length)
    out = {"kv_tokens_per_engine": tokens, "sequences_per_engine_per_step": seqs, "sequence_tokens": length,
           "kv_tokens_needed": need,
           "kv_bytes_per_token_per_gpu": mm.kv_bytes_per_token(shape, dtype=rc.dtype,
                                                               tensor_parallel_size=rc.tensor_parallel_size)}
    if need > tokens:
        size = ("rollout.gpu_memory_utilization=" + str(rc.gpu_memory_utilization) if rc.num_gpus_per_engine
                else f"rollout.kv_cache_gb={rc.kv_cache_gb}")
        raise PlanError(
            f"rollout KV cache too small: each engine holds {tokens} KV tokens ({size}, rollout.tensor_parallel_size="
            f"{rc.tensor_parallel_size}, {out['kv_bytes_per_token_per_gpu']} bytes per token per GPU) but one step "
            f"puts {seqs} sequences on it (trainer.prompts_per_step={tc.prompts_per_step} x trainer.group_size="
            f"{tc.group_size} / rollout.num_engines={rc.num_engines}) of up to {length} tokens "
            f"(data.max_prompt_tokens={d.max_prompt_tokens} + rollout.max_response_tokens={rc.max_response_tokens}): "
            f"{need} tokens. Raise the KV share or rollout.num_engines, or lower the step's sequences or lengths."
        )
    return out


def _memory(cfg: Config, nodes: list[_Node], gpu_memory_gib: float | None) -> dict[str, Any]:
    """The plan's ``memory`` section: the learner's breakdown per rank (static + one micro-batch's working
    memory), each engine's KV tokens, host RAM per node and, when GPUs are requested (``gpu_memory_gib``
    given), every GPU's claims against its memory.

    Raises:
        PlanError: a rollout engine's weights exceed vLLM's share, some GPU's claims exceed its memory, one
            step's sequences do not fit an engine's KV cache, or a node's host RAM is over
            ``cluster.host_memory_gib``.
    """
    lc, rc = cfg.learner, cfg.rollout
    shape, p = model_shape(cfg), num_params(cfg)
    offload = lc.offload_optimizer == "cpu"
    lora_t = mm.lora_trainable_params(shape, lc.lora.rank, lc.lora.target_modules)  # None: all P train (bound)
    lm = learner_memory_gib(p, zero_stage=lc.zero_stage, dtype=lc.dtype, world_size=lc.world_size,
                            reference_model=lc.kl_coef > 0, offload_optimizer=offload, trainable_params=lora_t)
    host_off = (learner_host_offload_gib(lora_t or p, zero_stage=lc.zero_stage, dtype=lc.dtype,
                                         world_size=lc.world_size) if offload else {"total": 0.0})
    ppo = lc.algorithm == "ppo"  # PPO's critic: a second engine and optimizer on every rank (learner/critic.py)
    if ppo:
        lm = mm.add_critic_gib(lm, p, zero_stage=lc.zero_stage, dtype=lc.dtype, world_size=lc.world_size,
                               offload_optimizer=offload)
        if offload:
            host_off = {k: 2 * v for k, v in host_off.items()}  # the critic's offloaded partitions, the same bound
    work = learner_working_gib(cfg, shape, p)
    if work:
        lm = {**{k: v for k, v in lm.items() if k != "total"}, **{k: v for k, v in work.items() if k != "total"},
              "total": lm["total"] + work["total"]}
    mem: dict[str, Any] = {
        "num_params_b": round(p / 1e9, 6),
        "learner_per_rank_gib": {k: round(v, 2) if k != "micro_batch_tokens" else v for k, v in lm.items()},
        "learner_formula": f"ZeRO-{lc.zero_stage}, {lc.dtype}, AdamW, N={lc.world_size}"
        + (", + reference model" if lc.kl_coef > 0 else "")
        + (", + PPO critic (its P bounded by the policy's)" if ppo else "")
        + (f", gradient checkpointing {'on' if lc.gradient_checkpointing else 'off'}" if work else "")
        + (", optimizer offloaded to host RAM (CPU Adam)" if offload else "")
        + (f", LoRA r={lc.lora.rank}: {lora_t} trainable parameters" if lora_t else
           ", LoRA: trainable count unknown here, the full model's gradients and optimizer counted (a bound)"
           if lc.lora.rank else ""),
    }
    if offload:
        mem["learner_host_offload_per_rank_gib"] = {k: round(v, 2) for k, v in host_off.items()}
    if gpu_memory_gib is None:
        mem["checked"] = False
        mem["why"] = "no GPUs requested: the learner and the engines live in host RAM (host_ram_gib)"
        if shape is not None:
            mem["rollout_kv"] = engine_kv(cfg, shape, rc.kv_cache_gb)
        mem["host_ram_gib"] = host_ram_gib(cfg, nodes, lm, p, on_gpu=False, offloaded=host_off["total"])
        return mem

    g = gpu_memory_gib
    mem["gpu_memory_gib"] = g
    claims: dict[str, float] = {}
    if lc.num_gpus_per_rank:
        claims["learner"] = lm["total"]  # a rank computes on one device; extra devices get the same claim
    if rc.num_gpus_per_engine:
        claims["rollout"], mem["rollout_per_gpu_gib"] = _rollout_gpu_budget(cfg, g)
    used, name, users = _fullest_gpu(nodes, claims)
    mem["fullest_gpu"] = {"gpu": name, "holds": list(users), "claimed_gib": round(used, 2)}
    if used > g:
        raise PlanError(_over_budget_message(cfg, lm, claims, used, name, users, g))
    if rc.num_gpus_per_engine and shape is not None:
        mem["rollout_kv"] = engine_kv(cfg, shape, mem["rollout_per_gpu_gib"]["kv_cache"])
    mem["host_ram_gib"] = host_ram_gib(cfg, nodes, lm, p, on_gpu=True, offloaded=host_off["total"])
    warnings = []
    if "learner" in claims:
        free = g * min(1.0, lc.num_gpus_per_rank) - claims["learner"]
        mem["learner_free_gib"] = round(free, 2)
        if free < MIN_FREE_SHARE * g:
            warnings.append(
                f"learner ranks leave {free:.1f} GiB free (< {MIN_FREE_SHARE:.0%} of {g:.0f} GiB"
                + ("" if work else "; activations are not modelled without model.shape")
                + "): lower learner.max_tokens_per_micro_batch, turn on learner.gradient_checkpointing, or raise "
                "learner.zero_stage / world_size")
    if "rollout" in claims and mem["rollout_per_gpu_gib"]["kv_cache"] < MIN_FREE_SHARE * g:
        warnings.append(
            f"rollout engines keep {mem['rollout_per_gpu_gib']['kv_cache']:.1f} GiB of KV cache per GPU: few "
            "sequences fit at once; raise rollout.tensor_parallel_size"
        )
    mem["checked"] = True
    mem["warnings"] = warnings
    return mem


def engine_sync_gib(cfg: Config, p: float) -> float:
    """GiB a CPU engine's peak grows by in its first weight sync: ``b_r P + sync.max_buckets_in_flight x
    sync.bucket_mb / 1024``. Measured on SmolLM2-135M (docs/real_model.md, "Memory"): 0.62 GiB for 0.50 GiB of
    weights and 0.12 GiB of buckets, of which 0.32 GiB were object-store pages mapped into the process; the rest
    is vLLM's layer-wise reload materialising checkpoint-layout tensors beside the packed kernels' copies (the
    split between the two is not measured, their sum is)."""
    sc = cfg.sync
    return _BYTES[cfg.rollout.dtype] * p / _GIB + sc.max_buckets_in_flight * sc.bucket_mb / 1024


def served_params(cfg: Config, sm: ServedModel, p: float) -> tuple[float | None, str]:
    """Parameters of a served model's weights, for its engines' host RAM: ``(P or None, how they were counted)``.

    - the policy itself (the same ``model_path`` and ``build_seed`` as ``model``; for ``builtin:tiny_moe`` also
      the default build keys, since a served builtin is built from its seed alone): the policy's ``p``;
    - ``builtin:tiny_moe`` otherwise: the parameters of its default build keys (``memory_model.param_count``);
    - a local folder: the tensors its ``*.safetensors`` headers list (``shapes.safetensors_params``: the stored
      dtype does not matter, the served dtype is applied by the caller), else the shape of its ``config.json``
      (``folder_shape``, ``param_count``);
    - anything else (another arch's builtin, a hub id not yet fetched, a folder not there yet, an unreadable header or
      config): None, with the reason in the text, which starts with ``"weights not counted: "``.

    Args:
        cfg: a validated config.
        sm: the served model (``actor_placement.served_models``).
        p: the policy's parameter count (``num_params``).
    """
    m, path, seed = cfg.model, sm.settings.model_path, sm.settings.build_seed
    default_keys = m.build_kwargs() == ModelConfig().build_kwargs()
    if path == m.path and seed == m.build_seed and (path != BUILTIN_TINY_MOE or default_keys):
        return p, f"the policy model's ({path}, build_seed {seed}): {p / 1e9:.6g} B parameters"
    if path == BUILTIN_TINY_MOE:
        count = mm.param_count(_tiny_moe_shape(ModelConfig()))
        return float(count), f"{path} at its default build keys: {count} parameters"
    if path.startswith("builtin:"):  # another arch's tiny builtin (config load refuses unknown names)
        return None, (f"weights not counted: {path} is built at the run's start and its size is not modelled here "
                      "(the tiny builtins hold a few MiB)")
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return None, (f"weights not counted: {path} is not a local folder (a hub id fetched at the run's start, or "
                      "a folder not written yet)")
    try:
        count = safetensors_params(folder)
        if count is not None:
            return float(count), f"the *.safetensors headers of {path}: {count} parameters"
        shape = folder_shape(folder)
        if shape is not None:
            count = mm.param_count(shape)
            return float(count), f"the config.json of {path}: {count} parameters (as a Qwen3 layout)"
    except (ValueError, KeyError, TypeError) as err:
        return None, f"weights not counted: {path}: {type(err).__name__}: {err}"
    return None, f"weights not counted: {path} holds neither *.safetensors files nor a config.json"


def served_engine_gib(cfg: Config, sm: ServedModel, p: float) -> tuple[dict[str, float], str]:
    """Host RAM of one engine of a served model (a CPU vLLM engine that never syncs), GiB:
    ``({"base", "kv_cache", "weights", "total"}, how the weights were counted)``: the CPU engine's base
    (``HOST_PROCESS_GIB["engine_cpu"]``) + its ``kv_cache_gb`` + ``b P`` (b from its ``dtype``, P from
    ``served_params``; 0 where that counted none, and the text says so).

    Args:
        cfg: a validated config.
        sm: the served model (``actor_placement.served_models``).
        p: the policy's parameter count (``num_params``).
    """
    count, how = served_params(cfg, sm, p)
    parts = {"base": HOST_PROCESS_GIB["engine_cpu"], "kv_cache": float(sm.settings.kv_cache_gb),
             "weights": _BYTES[sm.settings.dtype] * count / _GIB if count else 0.0}
    parts["total"] = sum(parts.values())
    return parts, how


def host_ram_gib(cfg: Config, nodes: list[_Node], lm: dict[str, float], p: float, *, on_gpu: bool,
                 offloaded: float = 0.0) -> dict[str, Any]:
    """Host RAM per node, GiB (module docstring): ``{"node i": {...parts, "total"}}``, plus ``checked``.
    ``offloaded``: GiB each learner rank keeps on the host for ZeRO-Offload (``learner_host_offload_gib``'s
    total; part ``learner_optimizer_offload``). Each served model adds a part ``<name>_engines`` (its engines on
    the node x ``served_engine_gib``), an entry ``<name>_engine`` to ``per_process`` and, under
    ``served_models``, its per-engine breakdown and how its weights were counted (``"weights not counted: ..."``
    where they were not).

    Raises:
        PlanError: a node's total exceeds ``cluster.host_memory_gib``.
    """
    lc, rc, sc = cfg.learner, cfg.rollout, cfg.sync
    b, br = _BYTES[lc.dtype], _BYTES[rc.dtype]
    full = b * p / _GIB
    load = 0.0  # per rank, at start only (ZeRO-3 on GPUs): the merged checkpoint and the fused experts
    if on_gpu:
        zero3 = lc.zero_stage == 3
        load = zero3_load_host_gib(model_shape(cfg), p, dtype=lc.dtype) if zero3 else 0.0
        rank = HOST_PROCESS_GIB["learner"] + (0.0 if zero3 else full)
        engine = HOST_PROCESS_GIB["engine"]
    else:  # the CPU holds everything the GPU would
        rank = HOST_PROCESS_GIB["learner_cpu"] + lm["total"] - lm["overhead"]
        engine = (HOST_PROCESS_GIB["engine_cpu"] + br * p / _GIB + rc.kv_cache_gb
                  + mm.engine_sampler_bytes(model_shape(cfg)) / _GIB + engine_sync_gib(cfg, p))
    buckets = sc.max_buckets_in_flight * sc.bucket_mb / 1024
    served = {sm.name: (sm, *served_engine_gib(cfg, sm, p)) for sm in served_models(cfg)}
    out: dict[str, Any] = {}
    limit = cfg.cluster.host_memory_gib
    for n in nodes:
        ranks = sum(a.startswith("learner") for a in n.actors)
        engines = sum(a.startswith("rollout") for a in n.actors)
        workers = sum(a.startswith("reward") for a in n.actors)
        parts = {"learner_ranks": ranks * rank, "learner_optimizer_offload": ranks * offloaded,
                 "checkpoint_export_rank0": full if ranks else 0.0,
                 "engines": engines * engine, "reward_workers": workers * HOST_PROCESS_GIB["reward"],
                 "driver": HOST_PROCESS_GIB["driver"] if n.index == 0 else 0.0,
                 "object_store_sync": buckets if ranks or engines else 0.0}
        for name, (_, per, _) in served.items():  # the served models' engines: a part per model
            parts[f"{name}_engines"] = sum(a.startswith(f"{name} engine ") for a in n.actors) * per["total"]
        parts = {k: round(v, 2) for k, v in parts.items()}
        # the load is over before the optimizer's host buffers exist and before any checkpoint export
        later = parts["learner_optimizer_offload"] + parts["checkpoint_export_rank0"]
        parts["learner_load_zero3"] = round(ranks * load, 2)
        parts["total"] = round(sum(parts.values()) - min(parts["learner_load_zero3"], later), 2)
        out[f"node {n.index}"] = parts
        if limit is not None and parts["total"] > limit:
            raise PlanError(
                f"host RAM over budget on node {n.index}: {parts['total']:.1f} GiB needed > cluster.host_memory_gib="
                f"{limit} ({parts}); every ZeRO-3 rank merges the whole checkpoint at load (learner_load_zero3: fewer "
                "ranks per node lower it)"
                + (f", learner.offload_optimizer='cpu' keeps {offloaded:.1f} GiB per rank on the host (raise "
                   "learner.world_size, or offload 'none' where the GPUs hold the optimizer)" if offloaded else "")
                + "".join(f", the served {name} engines hold {parts[f'{name}_engines']:.1f} GiB ({name}_engines: "
                          f"{sm.section}.num_engines={sm.settings.num_engines} x {per['total']:.2f} GiB of base, "
                          f"{sm.section}.kv_cache_gb={sm.settings.kv_cache_gb} and {sm.settings.dtype} weights; "
                          f"fewer engines or a smaller KV cache fit)"
                          for name, (sm, per, _) in served.items() if parts[f"{name}_engines"])
                + ", or spread the services over more nodes")
    out["per_process"] = {"learner_rank": round(rank, 2), "engine": round(engine, 2),
                          "reward_worker": HOST_PROCESS_GIB["reward"], "driver": HOST_PROCESS_GIB["driver"],
                          **{f"{name}_engine": round(per["total"], 2) for name, (_, per, _) in served.items()}}
    if served:
        out["served_models"] = {
            name: {"section": sm.section, "model_path": sm.settings.model_path, "engines": sm.settings.num_engines,
                   "per_engine_gib": {k: round(v, 2) for k, v in per.items()}, "weights": how}
            for name, (sm, per, how) in served.items()}
    out["checked"] = limit is not None
    return out


def _rollout_gpu_budget(cfg: Config, g: float) -> tuple[float, dict[str, float]]:
    """One engine GPU of ``g`` GiB: ``(vLLM's claim, breakdown)``. The claim is ``gpu_memory_utilization`` x
    ``g``; the breakdown (GiB, rounded to 0.01) holds the claim, the weights, the overhead and the KV cache left.

    Raises:
        PlanError: the weights and the overhead exceed vLLM's claim.
    """
    rc = cfg.rollout
    wts = rollout_weights_gib(num_params(cfg), dtype=rc.dtype, tensor_parallel_size=rc.tensor_parallel_size)
    vllm = rc.gpu_memory_utilization * g
    kv = vllm - wts - ROLLOUT_OVERHEAD_GIB
    if kv <= 0:
        raise PlanError(
            f"rollout engine over budget: weights {wts:.1f} GiB per GPU (model.num_params_b="
            f"{cfg.model.num_params_b} x {_BYTES[rc.dtype]} bytes / rollout.tensor_parallel_size="
            f"{rc.tensor_parallel_size}) + {ROLLOUT_OVERHEAD_GIB:.1f} GiB overhead exceed vLLM's share "
            f"rollout.gpu_memory_utilization={rc.gpu_memory_utilization} x {g:.0f} GiB = {vllm:.1f} GiB: "
            "raise tensor_parallel_size or gpu_memory_utilization, or use GPUs with more memory"
        )
    return vllm, {"claimed_by_vllm": round(vllm, 2), "weights": round(wts, 2), "overhead": ROLLOUT_OVERHEAD_GIB,
                  "kv_cache": round(kv, 2)}


def _fullest_gpu(nodes: list[_Node], claims: dict[str, float]) -> tuple[float, str, list[str]]:
    """The GPU whose occupants claim the most (fractional requests may share a device): ``(GiB, "node i GPU j",
    occupants)``; ``(0.0, "", [])`` when no GPU holds anything."""
    worst = (0.0, "", [])
    for n in nodes:
        for i, users in enumerate(n.gpu_users):
            total = sum(claims["learner" if u.startswith("learner") else "rollout"] for u in users)
            if total > worst[0]:
                worst = (total, f"node {n.index} GPU {i}", users)
    return worst


def _over_budget_message(cfg: Config, lm: dict[str, float], claims: dict[str, float], used: float, name: str,
                         users: list[str], g: float) -> str:
    """The ``PlanError`` text for a GPU over budget: its occupants' claims, the learner's breakdown with the
    fields behind it, and the changes that would make it fit."""
    lc = cfg.learner
    detail = ", ".join(
        f"{u}: {claims['learner' if u.startswith('learner') else 'rollout']:.1f} GiB" for u in users)
    hint = (f"learner per rank = weights {lm['weights']:.1f} + gradients {lm['gradients']:.1f} + optimizer "
            f"{lm['optimizer']:.1f} + reference {lm['reference']:.1f} + overhead {lm['overhead']:.1f}"
            + (f" + activations {lm['activations']:.1f} + logits {lm['logits']:.1f} + gathered {lm['gathered']:.1f}"
               f" for {lm['micro_batch_tokens']} tokens per micro-batch (learner.gradient_checkpointing="
               f"{str(lc.gradient_checkpointing).lower()}; without: activations "
               f"{lm['activations_without_checkpointing']:.1f}, with: {lm['activations_with_checkpointing']:.1f})"
               if "activations" in lm else "") + " GiB "
            f"(model.num_params_b={cfg.model.num_params_b}, learner.zero_stage={lc.zero_stage}, "
            f"learner.dtype={lc.dtype}, learner.world_size={lc.world_size})")
    fixes = []
    if "activations" in lm and not lc.gradient_checkpointing:
        fixes.append("turn on learner.gradient_checkpointing")
    if "activations" in lm:
        fixes.append("lower learner.max_tokens_per_micro_batch (or micro_batch_size)")
    if lc.zero_stage < 3:
        fixes.append(f"raise learner.zero_stage (now {lc.zero_stage})")
    if lc.offload_optimizer == "none" and lc.zero_stage >= 1:
        fixes.append("offload the optimizer to host RAM (learner.offload_optimizer=cpu)")
    fixes.append("raise learner.world_size")
    if lc.dtype == "float32":
        fixes.append("train in bf16 (precision=bf16, or learner.dtype=bfloat16)")
    if len(users) > 1:
        fixes.append("give each service whole GPUs (num_gpus_per_rank / num_gpus_per_engine = 1)")
    fixes.append("use GPUs with more memory")
    hint_fix = "To fit: " + ", ".join(fixes) + "."
    return (f"GPU memory over budget on {name}: {used:.1f} GiB needed > {g:.0f} GiB per GPU ({detail}); {hint}. "
            + hint_fix)
