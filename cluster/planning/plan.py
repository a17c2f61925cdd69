"""Resource plan of a run, computed from the config alone (``--dry-run``): placement per node and GPU memory.

Nothing is started. ``plan`` places the actors on nodes and GPUs (``actor_placement.py``: what Ray is asked for
and where the plan puts it) and checks the memory of every GPU and host against its budget
(``memory_budget.py``: the formulas, with the byte counts of ``memory_model.py``).

Over budget raises ``PlanError`` naming the numbers.
"""

from __future__ import annotations

from typing import Any

from cluster.config import Config
from cluster.planning.actor_placement import PlanError, _place, _placement_groups, served_models
from cluster.planning.memory_budget import _memory, num_params

#: GPU memory choices, GiB (2**30 bytes) of total device memory: pass one as ``gpu_memory_gib``. Marketing "GB"
#: are not GiB: an H100 80GB has about 79.6 GiB, an H200 "141 GB" about 140 GiB. The default, 80, is the H100.
GPU_MEMORY_GIB = {"A100-40GB": 40.0, "A100-80GB": 80.0, "H100-80GB": 80.0, "H200": 140.0}
DEFAULT_GPU_MEMORY_GIB = 80.0
DEFAULT_GPUS_PER_NODE = 8


def plan(cfg: Config, *, gpu_memory_gib: float = DEFAULT_GPU_MEMORY_GIB,
         gpus_per_node: int = DEFAULT_GPUS_PER_NODE) -> dict[str, Any]:
    """The placement plan per node and the per-GPU memory check, without starting anything.

    Args:
        cfg: a validated config.
        gpu_memory_gib: memory of one GPU, GiB (80 for H100 80GB, 141 for H200; see ``GPU_MEMORY_GIB``).
        gpus_per_node: GPUs of one node (nodes are assumed alike).

    Returns:
        A YAML-ready dict: ``placement`` (the placement groups as requested), ``logical_cpus`` and
        ``gpus_total`` (Ray resources reserved by the actors), ``nodes`` (per node: CPUs, actors, and who holds
        each GPU), and, when ``model.num_params_b`` is set, ``memory`` (learner breakdown per rank, vLLM weights
        and KV cache per engine GPU, the fullest GPU, headroom, warnings). The served models' engines (the LLM
        judge's, the distillation teacher's: ``actor_placement.served_models``) are among the actors, CPUs,
        placement groups and host RAM parts.

    Raises:
        PlanError: a learner rank does not fit one node, a tensor-parallel engine asks for GPU fractions, the
            memory of some GPU is over budget, or a node's host RAM is over ``cluster.host_memory_gib`` (the
            message names the numbers and the parts).
    """
    if gpu_memory_gib <= 0 or gpus_per_node < 1:
        raise ValueError(f"gpu_memory_gib={gpu_memory_gib!r} must be > 0 and gpus_per_node={gpus_per_node!r} >= 1")
    lc, rc, wc = cfg.learner, cfg.rollout, cfg.reward
    uses_gpus = bool(lc.num_gpus_per_rank or rc.num_gpus_per_engine)
    out: dict[str, Any] = {
        "placement": _placement_groups(cfg, gpus_per_node),
        "logical_cpus": lc.world_size * lc.num_cpus_per_rank + rc.num_engines * rc.num_cpus_per_engine
        + wc.num_workers * wc.num_cpus_per_worker
        + sum(sm.settings.num_engines * sm.settings.num_cpus_per_engine for sm in served_models(cfg)),
        "gpus_total": lc.world_size * lc.num_gpus_per_rank
        + rc.num_engines * rc.num_gpus_per_engine * rc.tensor_parallel_size,
    }
    nodes, _ = _place(cfg, gpus_per_node if uses_gpus else 0)
    out["nodes"] = [
        {"node": n.index, "cpus": n.cpus, "actors": n.actors,
         **({"gpus": {g: users for g, users in enumerate(n.gpu_users) if users}} if uses_gpus else {})}
        for n in nodes
    ]
    if uses_gpus:
        out["nodes_needed"] = len(nodes)
        out["gpus_per_node"] = gpus_per_node
    if num_params(cfg) is None:
        if uses_gpus:
            out["memory"] = {"checked": False, "why": "model.num_params_b is not set"}
        return out
    out["memory"] = _memory(cfg, nodes, gpu_memory_gib if uses_gpus else None)
    return out


def fits(cfg: Config, **kwargs: Any) -> bool:
    """True when ``plan(cfg, **kwargs)`` raises no ``PlanError``."""
    try:
        plan(cfg, **kwargs)
    except PlanError:
        return False
    return True
