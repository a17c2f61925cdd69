"""Resource plan of a run, computed from the config alone (``--dry-run``): placement groups and memory."""

from __future__ import annotations

from typing import Any

from cluster.config import Config


def plan(cfg: Config) -> dict[str, Any]:
    """The placement plan and a per-GPU memory estimate, without starting anything.

    Memory per learner GPU (bytes) = P x (w + g) / shard_wg + P x 12 / shard_opt, with P the parameter count,
    w and g the bytes of weights and gradients in the training dtype, 12 bytes of fp32 master weights and
    Adam moments, sharded over the data-parallel ranks by ZeRO stage (1: optimizer, 2: + gradients,
    3: + weights). Activations are not included.
    """
    lc, rc = cfg.learner, cfg.rollout
    groups = {
        "learner": {"bundles": [{"CPU": lc.num_cpus_per_rank, "GPU": lc.num_gpus_per_rank} for _ in range(lc.world_size)],
                    "strategy": "STRICT_PACK" if lc.num_gpus_per_rank else "PACK"},
        "rollout": {"bundles_per_engine": {"CPU": rc.num_cpus_per_engine, "GPU": rc.num_gpus_per_engine * rc.tensor_parallel_size},
                    "engines": rc.num_engines, "tensor_parallel_size": rc.tensor_parallel_size},
        "reward": {"bundles_per_worker": {"CPU": cfg.reward.num_cpus_per_worker}, "workers": cfg.reward.num_workers},
    }
    out: dict[str, Any] = {"placement": groups, "logical_cpus": (
        lc.world_size * lc.num_cpus_per_rank + rc.num_engines * rc.num_cpus_per_engine
        + cfg.reward.num_workers * cfg.reward.num_cpus_per_worker)}
    if cfg.model.num_params_b:
        p = cfg.model.num_params_b * 1e9
        wb = 2 if lc.dtype == "bfloat16" else 4
        z, n = lc.zero_stage, lc.world_size
        weights = p * wb / (n if z >= 3 else 1)
        grads = p * wb / (n if z >= 2 else 1)
        optim = p * 12 / (n if z >= 1 else 1)
        out["learner_memory_gib_per_rank"] = round((weights + grads + optim) / 2**30, 2)
        out["rollout_weights_gib_per_engine_gpu"] = round(p * 2 / rc.tensor_parallel_size / 2**30, 2)
    return out
