"""The DeepSpeed config dict of a learner rank, built from ``LearnerConfig``.

Gradient accumulation is driven by the learner service itself (explicit accumulation boundaries, one
optimizer step per minibatch, any number of micro-batches), so DeepSpeed's own ``gradient_accumulation_steps``
is 1: DeepSpeed then never divides a loss or a gradient by it, and the only scaling left is its average of the
gradients over the data-parallel ranks, which the service compensates exactly (see ``learner/service.py``).
"""

from __future__ import annotations

from typing import Any

from learner.config import LearnerConfig


def policy_clips_itself(cfg: LearnerConfig) -> bool:
    """Whether the policy's gradient clip runs in the learner (``learner.replica.Replica._clip_stage0``), not in
    DeepSpeed: at ZeRO-0 in float32, where DeepSpeed keeps no norm and multiplies every gradient even when the
    clip does not bite."""
    return cfg.zero_stage == 0 and cfg.dtype == "float32"


def build_ds_config(cfg: LearnerConfig, world_size: int, on_gpu: bool = False, policy: bool = False) -> dict[str, Any]:
    """DeepSpeed config for one rank of a ``world_size``-rank data-parallel learner.

    Args:
        cfg: the learner section (ZeRO stage, dtype, micro-batch size, gradient clip).
        world_size: number of data-parallel ranks (>= 1).
        on_gpu: the ranks train on GPUs (NCCL): ZeRO's reductions and gathers overlap the backward on side
            streams (``overlap_comm``, DeepSpeed's default for ZeRO-3 on GPU); on the CPU they run in line.
        policy: the config is the policy's (not PPO's critic): where ``policy_clips_itself``, DeepSpeed's
            ``gradient_clipping`` is 0 (off) and the learner clips.

    Returns:
        A dict for ``deepspeed.initialize(config=...)``: ``train_batch_size = micro_batch_size x 1 x world_size``
        (DeepSpeed refuses any other product; DeepSpeed only books these numbers, the learner cuts its own
        micro-batches, by ``micro_batch_size`` rows or by ``max_tokens_per_micro_batch``), ZeRO stage ``cfg.zero_stage``, bf16 when ``cfg.dtype`` is
        bfloat16, gradients accumulated in fp32 whatever the dtype (``data_types.grad_accum_dtype``; DeepSpeed's
        default is the model's dtype, and it accumulates bf16 weights' gradients in fp32 at ZeRO stages 1-3
        only, which ``LearnerConfig`` enforces) and reduced across ranks in fp32 (``communication_data_type``;
        DeepSpeed's default is bf16 for bf16 weights: twice the bytes for unrounded gradients), global-norm
        gradient clipping ``cfg.grad_clip``, and a client
        optimizer allowed. With ``cfg.offload_optimizer == "cpu"``: ``zero_optimization.offload_optimizer =
        {"device": "cpu", "pin_memory": on_gpu}`` (page-locked host buffers speed the GPU's copies; on the CPU
        there is nothing to copy from); the client optimizer must then be DeepSpeed's CPU Adam, which DeepSpeed
        checks itself (``zero_force_ds_cpu_optimizer``, left at its default).

    Raises:
        ValueError: ``world_size < 1``.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be >= 1")
    zero: dict[str, Any] = {"stage": int(cfg.zero_stage)}
    if cfg.zero_stage >= 1:
        # CPU: plain reductions, no communication overlap threads; GPU: reductions overlap the backward.
        zero.update({"overlap_comm": bool(on_gpu), "contiguous_gradients": True})
    if cfg.zero_stage == 3 and cfg.zero3_param_persistence_threshold is not None:
        zero["stage3_param_persistence_threshold"] = int(cfg.zero3_param_persistence_threshold)
    if cfg.offload_optimizer == "cpu":  # LearnerConfig refuses it at stage 0
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": bool(on_gpu)}
    return {
        "train_micro_batch_size_per_gpu": int(cfg.micro_batch_size),
        "gradient_accumulation_steps": 1,
        "train_batch_size": int(cfg.micro_batch_size) * int(world_size),
        "gradient_clipping": 0.0 if policy and policy_clips_itself(cfg) else float(cfg.grad_clip),
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.dtype == "bfloat16"},
        "fp16": {"enabled": False},
        "data_types": {"grad_accum_dtype": "fp32"},  # float32 runs: the same as DeepSpeed's default
        # gradients reduced across ranks in fp32: DeepSpeed's default for bf16 is bf16, which rounds the
        # fp32-accumulated gradients before the fp32 master weights see them (FSDP's reduce_dtype in verl is fp32)
        "communication_data_type": "fp32",
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
