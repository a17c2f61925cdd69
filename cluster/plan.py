"""Resource plan of a run, computed from the config alone (``--dry-run``): placement per node and GPU memory.

Nothing is started. The plan mirrors what ``cluster/services.py`` asks Ray for: the learner ranks share one
placement group (STRICT_PACK, so one node, when they hold GPUs; PACK on CPU), every rollout engine has a
group of its own with ``tensor_parallel_size`` GPUs on one node, reward workers hold CPUs only. Nodes are
assumed alike (``gpus_per_node`` GPUs of ``gpu_memory_gib`` each); Ray may place groups differently, but never
with less memory per GPU than planned here.

Memory per GPU (GiB = 2**30 bytes), with P = ``model.num_params_b`` x 1e9 parameters, N = ``learner.world_size``:

- learner rank (ZeRO paper, Rajbhandari et al. 2020, Sec. 5 and Fig. 1: (2 + 2 + K) P bytes for mixed
  precision Adam, each term divided by N once its ZeRO stage partitions it):

      weights   = b P / (N if stage >= 3 else 1)
      gradients = b P / (N if stage >= 2 else 1)
      optimizer = K P / (N if stage >= 1 else 1)
      reference = b P                      (only when learner.kl_coef > 0: an unsharded frozen copy)
      total     = weights + gradients + optimizer + reference + LEARNER_OVERHEAD_GIB

  b = 2 bytes (bfloat16) or 4 (float32); K = 12 for bfloat16 (fp32 master weights + Adam's two moments) and
  8 for float32 (the weights are the master copy; the two moments). ``LEARNER_OVERHEAD_GIB`` covers the CUDA
  context, NCCL and DeepSpeed's communication buckets. Activations are not modelled: the plan reports the
  headroom left for them.
- rollout engine GPU: vLLM claims ``rollout.gpu_memory_utilization`` x the GPU's memory; inside it the weights
  take b_r P / ``tensor_parallel_size`` (b_r from ``rollout.dtype``; every expert of an MoE stays resident) plus
  ``ROLLOUT_OVERHEAD_GIB`` (activations, CUDA graphs); the rest is KV cache.
- a GPU shared by fractional requests (``num_gpus_per_rank`` or ``num_gpus_per_engine`` below 1) must hold the
  sum of its occupants' claims.

Over budget raises ``PlanError`` naming the numbers.
"""

from __future__ import annotations

from typing import Any

from cluster.config import Config, ConfigError

#: GPU memory choices, GiB (2**30 bytes) of total device memory: pass one as ``gpu_memory_gib``. Marketing "GB"
#: are not GiB: an H100 80GB has about 79.6 GiB, an H200 "141 GB" about 140 GiB. The default, 80, is the H100.
GPU_MEMORY_GIB = {"A100-40GB": 40.0, "A100-80GB": 80.0, "H100-80GB": 80.0, "H200": 140.0}
DEFAULT_GPU_MEMORY_GIB = 80.0
DEFAULT_GPUS_PER_NODE = 8
LEARNER_OVERHEAD_GIB = 4.0
ROLLOUT_OVERHEAD_GIB = 2.0
#: below this share of the GPU left for activations, the plan warns (it does not refuse).
MIN_ACTIVATION_HEADROOM = 0.10

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_GIB = float(2**30)


class PlanError(ConfigError):
    """The run does not fit the GPUs it asks for; the message names the fields and the numbers."""


def learner_memory_gib(num_params: float, *, zero_stage: int, dtype: str, world_size: int,
                       reference_model: bool = False) -> dict[str, float]:
    """Static memory of one learner rank (see the module docstring for the formula and its source).

    Args:
        num_params: parameter count P (not billions).
        zero_stage: DeepSpeed ZeRO stage 0-3.
        dtype: training dtype, ``"bfloat16"`` or ``"float32"``.
        world_size: data-parallel ranks N (>= 1).
        reference_model: a frozen reference copy is held (``kl_coef > 0``).

    Returns:
        GiB per rank: ``weights``, ``gradients``, ``optimizer``, ``reference``, ``overhead`` and ``total``.

    Raises:
        ValueError: unknown dtype, a stage outside 0-3, ``world_size < 1`` or ``num_params <= 0``.
    """
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"learner dtype {dtype!r}: expected 'bfloat16' or 'float32'")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r} must be 0, 1, 2 or 3")
    if world_size < 1 or num_params <= 0:
        raise ValueError(f"world_size={world_size!r} must be >= 1 and num_params={num_params!r} > 0")
    b = _BYTES[dtype]
    k = 12 if dtype == "bfloat16" else 8
    n = world_size
    parts = {
        "weights": b * num_params / (n if zero_stage >= 3 else 1),
        "gradients": b * num_params / (n if zero_stage >= 2 else 1),
        "optimizer": k * num_params / (n if zero_stage >= 1 else 1),
        "reference": b * num_params if reference_model else 0.0,
    }
    out = {key: v / _GIB for key, v in parts.items()}
    out["overhead"] = LEARNER_OVERHEAD_GIB
    out["total"] = sum(out.values())
    return out


def rollout_weights_gib(num_params: float, *, dtype: str, tensor_parallel_size: int) -> float:
    """GiB of model weights on each GPU of one vLLM engine: ``b_r P / tensor_parallel_size``."""
    return _BYTES[dtype] * num_params / tensor_parallel_size / _GIB


# ----------------------------------------------------------------------------------------- placement


class _Node:
    def __init__(self, index: int, num_gpus: int):
        self.index = index
        self.gpu_free = [1.0] * num_gpus
        self.gpu_users: list[list[str]] = [[] for _ in range(num_gpus)]
        self.cpus = 0.0
        self.actors: list[str] = []

    def take_gpus(self, count: int, share: float) -> list[int] | None:
        """``count`` distinct GPUs with ``share`` free each (first fit), or None."""
        idx = [i for i, free in enumerate(self.gpu_free) if free + 1e-9 >= share][:count]
        return idx if len(idx) == count else None


def _gpu_slots(gpus: float, what: str, field: str) -> tuple[int, float]:
    """How a GPU request maps on devices: (devices, share of each). Fractions below 1 share one device."""
    if gpus <= 1:
        return 1, gpus
    if abs(gpus - round(gpus)) > 1e-9:
        raise PlanError(f"{field}={gpus}: {what} above one GPU must hold whole GPUs")
    return int(round(gpus)), 1.0


def _place(cfg: Config, gpus_per_node: int) -> tuple[list[_Node], dict[str, list[tuple[int, list[int]]]]]:
    """Assign learner ranks, engines and reward workers to nodes and GPU indices (first fit)."""
    lc, rc, wc = cfg.learner, cfg.rollout, cfg.reward
    nodes: list[_Node] = []
    where: dict[str, list[tuple[int, list[int]]]] = {"learner": [], "rollout": []}

    def node(i: int) -> _Node:
        while len(nodes) <= i:
            nodes.append(_Node(len(nodes), gpus_per_node))
        return nodes[i]

    # Learner: one STRICT_PACK group, so every rank on node 0.
    if lc.num_gpus_per_rank:
        count, share = _gpu_slots(lc.num_gpus_per_rank, "a learner rank", "learner.num_gpus_per_rank")
        n0 = node(0)
        for r in range(lc.world_size):
            got = n0.take_gpus(count, share)
            if got is None:
                raise PlanError(
                    f"learner.world_size={lc.world_size} x learner.num_gpus_per_rank={lc.num_gpus_per_rank} "
                    f"does not fit one node of {gpus_per_node} GPUs: the learner's placement group is STRICT_PACK "
                    "(all ranks on one node). Use fewer ranks, or nodes with more GPUs."
                )
            for g in got:
                n0.gpu_free[g] -= share
                n0.gpu_users[g].append(f"learner rank {r}")
            where["learner"].append((0, got))
    else:
        node(0)
        where["learner"] = [(0, []) for _ in range(lc.world_size)]
    nodes[0].cpus += lc.world_size * lc.num_cpus_per_rank
    nodes[0].actors += [f"learner rank {r}" for r in range(lc.world_size)]

    # Rollout engines: one STRICT_PACK group each, tensor_parallel_size devices on one node.
    for e in range(rc.num_engines):
        label = f"rollout engine {e}"
        if rc.num_gpus_per_engine:
            if rc.tensor_parallel_size > 1 and rc.num_gpus_per_engine < 1:
                raise PlanError(
                    f"rollout.tensor_parallel_size={rc.tensor_parallel_size} needs a whole GPU per shard: "
                    f"rollout.num_gpus_per_engine={rc.num_gpus_per_engine} must be 1"
                )
            count, share = _gpu_slots(rc.num_gpus_per_engine, "a rollout shard", "rollout.num_gpus_per_engine")
            count *= rc.tensor_parallel_size
            if count > gpus_per_node:
                raise PlanError(
                    f"rollout.tensor_parallel_size={rc.tensor_parallel_size} x rollout.num_gpus_per_engine="
                    f"{rc.num_gpus_per_engine} GPUs do not fit one node of {gpus_per_node} GPUs"
                )
            i = 0
            while (got := node(i).take_gpus(count, share)) is None:
                i += 1
            for g in got:
                nodes[i].gpu_free[g] -= share
                nodes[i].gpu_users[g].append(label)
            where["rollout"].append((i, got))
        else:
            i = 0
            where["rollout"].append((0, []))
        nodes[i].cpus += rc.num_cpus_per_engine
        nodes[i].actors.append(label)
    # Reward workers: CPUs only; spread over the nodes there are.
    for w in range(wc.num_workers):
        n = nodes[w % len(nodes)]
        n.cpus += wc.num_cpus_per_worker
        n.actors.append(f"reward worker {w}")
    return nodes, where


# -------------------------------------------------------------------------------------------- plan


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
        and KV cache per engine GPU, the fullest GPU, headroom, warnings).

    Raises:
        PlanError: the learner group does not fit one node, a tensor-parallel engine asks for GPU fractions, or
            the memory of some GPU is over budget (the message names the numbers).
    """
    if gpu_memory_gib <= 0 or gpus_per_node < 1:
        raise ValueError(f"gpu_memory_gib={gpu_memory_gib!r} must be > 0 and gpus_per_node={gpus_per_node!r} >= 1")
    lc, rc, wc = cfg.learner, cfg.rollout, cfg.reward
    uses_gpus = bool(lc.num_gpus_per_rank or rc.num_gpus_per_engine)
    out: dict[str, Any] = {
        "placement": _placement_groups(cfg),
        "logical_cpus": lc.world_size * lc.num_cpus_per_rank + rc.num_engines * rc.num_cpus_per_engine
        + wc.num_workers * wc.num_cpus_per_worker,
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
    if not cfg.model.num_params_b:
        if uses_gpus:
            out["memory"] = {"checked": False, "why": "model.num_params_b is not set"}
        return out
    out["memory"] = _memory(cfg, nodes, gpu_memory_gib if uses_gpus else None)
    return out


def _placement_groups(cfg: Config) -> dict[str, Any]:
    """The placement groups as ``cluster/services.py`` requests them (bundles and strategy per service)."""
    lc, rc, wc = cfg.learner, cfg.rollout, cfg.reward
    return {
        "learner": {"bundles": [{"CPU": lc.num_cpus_per_rank, "GPU": lc.num_gpus_per_rank} for _ in range(lc.world_size)],
                    "strategy": "STRICT_PACK" if lc.num_gpus_per_rank else "PACK"},
        "rollout": {"bundles_per_engine": {"CPU": rc.num_cpus_per_engine, "GPU": rc.num_gpus_per_engine * rc.tensor_parallel_size},
                    "engines": rc.num_engines, "tensor_parallel_size": rc.tensor_parallel_size,
                    "strategy": "STRICT_PACK (one group per engine)"},
        "reward": {"bundles_per_worker": {"CPU": wc.num_cpus_per_worker}, "workers": wc.num_workers},
    }


def _memory(cfg: Config, nodes: list[_Node], gpu_memory_gib: float | None) -> dict[str, Any]:
    """The plan's ``memory`` section: the learner's breakdown per rank and, when GPUs are requested
    (``gpu_memory_gib`` given), every GPU's claims against its memory and the headroom warnings.

    Raises:
        PlanError: a rollout engine's weights exceed vLLM's share, or some GPU's claims exceed its memory.
    """
    lc, rc = cfg.learner, cfg.rollout
    p = cfg.model.num_params_b * 1e9
    lm = learner_memory_gib(p, zero_stage=lc.zero_stage, dtype=lc.dtype, world_size=lc.world_size,
                            reference_model=lc.kl_coef > 0)
    mem: dict[str, Any] = {
        "num_params_b": cfg.model.num_params_b,
        "learner_per_rank_gib": {k: round(v, 2) for k, v in lm.items()},
        "learner_formula": f"ZeRO-{lc.zero_stage}, {lc.dtype}, AdamW, N={lc.world_size}"
        + (", + reference model" if lc.kl_coef > 0 else ""),
    }
    if gpu_memory_gib is None:
        mem["checked"] = False
        mem["why"] = "no GPUs requested (host memory is not checked)"
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
    warnings = []
    if "learner" in claims:
        headroom = g * min(1.0, lc.num_gpus_per_rank) - claims["learner"]
        mem["learner_activation_headroom_gib"] = round(headroom, 2)
        if headroom < MIN_ACTIVATION_HEADROOM * g:
            warnings.append(
                f"learner ranks leave {headroom:.1f} GiB for activations (< {MIN_ACTIVATION_HEADROOM:.0%} of "
                f"{g:.0f} GiB): lower learner.micro_batch_size or raise learner.zero_stage / world_size"
            )
    if "rollout" in claims and mem["rollout_per_gpu_gib"]["kv_cache"] < MIN_ACTIVATION_HEADROOM * g:
        warnings.append(
            f"rollout engines keep {mem['rollout_per_gpu_gib']['kv_cache']:.1f} GiB of KV cache per GPU: few "
            "sequences fit at once; raise rollout.tensor_parallel_size"
        )
    mem["checked"] = True
    mem["warnings"] = warnings
    return mem


def _rollout_gpu_budget(cfg: Config, g: float) -> tuple[float, dict[str, float]]:
    """One engine GPU of ``g`` GiB: ``(vLLM's claim, breakdown)``. The claim is ``gpu_memory_utilization`` x
    ``g``; the breakdown (GiB, rounded to 0.01) holds the claim, the weights, the overhead and the KV cache left.

    Raises:
        PlanError: the weights and the overhead exceed vLLM's claim.
    """
    rc = cfg.rollout
    wts = rollout_weights_gib(cfg.model.num_params_b * 1e9, dtype=rc.dtype, tensor_parallel_size=rc.tensor_parallel_size)
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
            f"{lm['optimizer']:.1f} + reference {lm['reference']:.1f} + overhead {lm['overhead']:.1f} GiB "
            f"(model.num_params_b={cfg.model.num_params_b}, learner.zero_stage={lc.zero_stage}, "
            f"learner.dtype={lc.dtype}, learner.world_size={lc.world_size})")
    fixes = []
    if lc.zero_stage < 3:
        fixes.append(f"raise learner.zero_stage (now {lc.zero_stage})")
    fixes.append("raise learner.world_size")
    if lc.dtype == "float32":
        fixes.append("train in learner.dtype=bfloat16")
    if len(users) > 1:
        fixes.append("give each service whole GPUs (num_gpus_per_rank / num_gpus_per_engine = 1)")
    fixes.append("use GPUs with more memory")
    hint_fix = "To fit: " + ", ".join(fixes) + "."
    return (f"GPU memory over budget on {name}: {used:.1f} GiB needed > {g:.0f} GiB per GPU ({detail}); {hint}. "
            + hint_fix)
def fits(cfg: Config, **kwargs: Any) -> bool:
    """True when ``plan(cfg, **kwargs)`` raises no ``PlanError``."""
    try:
        plan(cfg, **kwargs)
    except PlanError:
        return False
    return True
