"""Placement of a run's actors on nodes and GPUs for the resource plan (``cluster/planning/plan.py``), from the
config alone, and ``PlanError``, the plan's refusal (the memory budget, ``memory_budget.py``, raises it too).

What Ray is asked for (``cluster/runtime/learner_group.py``, ``cluster/runtime/services.py``): on GPUs the
learner ranks in one STRICT_PACK placement group per node (``cluster.gpus_per_node / learner.num_gpus_per_rank``
ranks each), on the CPU one PACK group for all ranks; every rollout engine a STRICT_PACK group of its own with
``tensor_parallel_size`` GPUs on one node; every reward worker a STRICT_PACK group of one CPU bundle. The plan
is stricter for the learner: it puts every rank on the first node and refuses a learner that does not fit one
node. Engines go to the first node with room, reward workers round-robin over the planned nodes. Nodes are
assumed alike (``gpus_per_node`` GPUs of ``gpu_memory_gib`` each); Ray may place groups differently, but never
with less memory per GPU than planned here.

The served models (``served_models``: the LLM judge, ``reward.judge``, and the distillation teacher, ``distill``)
run vLLM engines of their own on the CPU, each a STRICT_PACK group of one bundle ``{"CPU": num_cpus_per_engine,
**node_resources}`` (``cluster/runtime/model_fleet.py``). The plan puts them on the first node, as it puts CPU
rollout engines: the node that also holds the driver and the learner, so its host RAM is the fullest the plan
can make it (Ray may put a group on any node with free CPUs and the named custom resources).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from cluster.config import Config, ConfigError


class PlanError(ConfigError):
    """The run does not fit the GPUs it asks for; the message names the fields and the numbers."""


class ServedModel(NamedTuple):
    """An enabled served model: ``name`` (``"judge"``, ``"teacher"``: its actors are ``"<name> engine <i>"``),
    ``section`` (the config section's dotted name, for messages) and ``settings`` (a
    ``reward.config.ServedModelConfig``)."""

    name: str
    section: str
    settings: Any


def served_models(cfg: Config) -> list[ServedModel]:
    """The served models the run starts, in this order: the LLM judge (``reward.judge``) and the on-policy
    distillation teacher (``distill``), each only when its ``model_path`` is set. A config without a ``distill``
    section (or without ``reward.judge``) simply has none of that model."""
    out = []
    for name, section, settings in (("judge", "reward.judge", getattr(getattr(cfg, "reward", None), "judge", None)),
                                    ("teacher", "distill", getattr(cfg, "distill", None))):
        if settings is not None and getattr(settings, "model_path", None) is not None:
            out.append(ServedModel(name, section, settings))
    return out


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


def _place_learner(cfg: Config, gpus_per_node: int, node, where: dict[str, list[tuple[int, list[int]]]]) -> None:
    """Learner ranks as ``cluster/runtime/learner_group.py`` starts them: on GPUs one STRICT_PACK group per
    node's worth of ranks (``gpus_per_node / learner.num_gpus_per_rank``), group ``g`` on node ``g``; on the
    CPU one PACK group on node 0. ``node(i)`` returns node ``i`` (made on first use)."""
    lc = cfg.learner
    if not lc.num_gpus_per_rank:
        n0 = node(0)
        where["learner"] = [(0, []) for _ in range(lc.world_size)]
        n0.cpus += lc.world_size * lc.num_cpus_per_rank
        n0.actors += [f"learner rank {r}" for r in range(lc.world_size)]
        return
    count, share = _gpu_slots(lc.num_gpus_per_rank, "a learner rank", "learner.num_gpus_per_rank")
    per_group = learner_ranks_per_group(cfg, gpus_per_node)
    for r in range(lc.world_size):
        n = node(r // per_group)
        got = n.take_gpus(count, share)
        if got is None:
            raise PlanError(
                f"learner.num_gpus_per_rank={lc.num_gpus_per_rank} does not fit one node of {gpus_per_node} GPUs: "
                "a rank's GPUs are on one node. Use fewer GPUs per rank, or nodes with more GPUs."
            )
        for g in got:
            n.gpu_free[g] -= share
            n.gpu_users[g].append(f"learner rank {r}")
        where["learner"].append((n.index, got))
        n.cpus += lc.num_cpus_per_rank
        n.actors.append(f"learner rank {r}")


def _place(cfg: Config, gpus_per_node: int) -> tuple[list[_Node], dict[str, list[tuple[int, list[int]]]]]:
    """Assign learner ranks, engines and reward workers to nodes and GPU indices (first fit)."""
    rc, wc = cfg.rollout, cfg.reward
    nodes: list[_Node] = []
    where: dict[str, list[tuple[int, list[int]]]] = {"learner": [], "rollout": []}

    def node(i: int) -> _Node:
        while len(nodes) <= i:
            nodes.append(_Node(len(nodes), gpus_per_node))
        return nodes[i]

    _place_learner(cfg, gpus_per_node, node, where)

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
    # Served models' engines (judge, teacher): CPUs only, on the first node (module docstring).
    for sm in served_models(cfg):
        where[sm.name] = [(0, []) for _ in range(sm.settings.num_engines)]
        nodes[0].cpus += sm.settings.num_engines * sm.settings.num_cpus_per_engine
        nodes[0].actors += [f"{sm.name} engine {e}" for e in range(sm.settings.num_engines)]
    return nodes, where


def learner_ranks_per_group(cfg: Config, gpus_per_node: int) -> int:
    """Learner ranks in one placement group, as ``cluster/runtime/learner_group.py`` groups them: a node's worth
    on GPUs (``gpus_per_node / learner.num_gpus_per_rank``, at least 1), all of them on the CPU."""
    lc = cfg.learner
    if not lc.num_gpus_per_rank:
        return lc.world_size
    return max(1, min(lc.world_size, int(gpus_per_node / lc.num_gpus_per_rank)))


def _placement_groups(cfg: Config, gpus_per_node: int) -> dict[str, Any]:
    """The placement groups as ``cluster/runtime/services.py`` requests them (bundles and strategy per service),
    the served models' (``served_models``: one STRICT_PACK group per engine) under their names."""
    lc, rc, wc = cfg.learner, cfg.rollout, cfg.reward
    per_group = learner_ranks_per_group(cfg, gpus_per_node)
    return {
        "learner": {"bundles": [{"CPU": lc.num_cpus_per_rank, "GPU": lc.num_gpus_per_rank} for _ in range(lc.world_size)],
                    "groups": -(-lc.world_size // per_group), "ranks_per_group": per_group,
                    "strategy": "STRICT_PACK" if lc.num_gpus_per_rank else "PACK"},  # one group per node
        "rollout": {"bundles_per_engine": {"CPU": rc.num_cpus_per_engine, "GPU": rc.num_gpus_per_engine * rc.tensor_parallel_size},
                    "engines": rc.num_engines, "tensor_parallel_size": rc.tensor_parallel_size,
                    "strategy": "STRICT_PACK (one group per engine)",
                    "engine_actor": {"num_gpus": rc.num_gpus_per_engine * rc.tensor_parallel_size,
                                     "vllm_executor": "mp: one worker process per TP rank inside the engine actor"
                                     if rc.tensor_parallel_size > 1 else "uni: the model runs in the engine actor"}},
        "reward": {"bundles_per_worker": {"CPU": wc.num_cpus_per_worker}, "workers": wc.num_workers},
        **{sm.name: {"bundles_per_engine": {"CPU": sm.settings.num_cpus_per_engine, **sm.settings.node_resources},
                     "engines": sm.settings.num_engines, "strategy": "STRICT_PACK (one group per engine)",
                     "model_path": sm.settings.model_path, "section": sm.section}
           for sm in served_models(cfg)},
    }


def cpu_oversubscription(cfg: Config, cores: int) -> str | None:
    """A warning when a CPU-only run would keep more compute threads busy at once than ``cores``, else None.

    The overlapped step (``trainer.max_staleness >= 1``) runs the engines beside the learner ranks, so their
    threads add up; the on-policy step alternates them. Oversubscribed cores slow both sides (measured on 2
    cores: the overlapped ``make train`` with a 2-thread engine beside 2 learner ranks was slower than on-policy;
    README, "Speed").

    The served models' engines (``served_models``; ``num_engines x threads_per_engine`` threads each) count
    where the driver keeps them busy:

    - the LLM judge scores every piece of the rollout as it arrives while the engines generate the pieces still
      queued (``cluster/driver/collect.py``, ``Collector._generate_and_score``): its threads add to the rollout
      engines';
    - the teacher is asked once a step's rollout is complete (``cluster/driver/distill.py``,
      ``Distiller.annotate``, after ``Collector.collect`` returns, in the same thread): never beside that
      rollout's engines, so the collecting side is busy with ``max(engines + judge, teacher)`` threads.

    Busy threads are then ``max(collecting, learner)`` on-policy and ``collecting + learner`` overlapped (the
    collecting thread, teacher included, runs beside the learner). Without served models the count and the
    message are as before.

    Args:
        cfg: a validated config.
        cores: CPU cores the run's actors share (the local machine's, for a run that starts its own Ray).

    Returns:
        The warning text (names the keys and the thread counts), or None (the threads fit, or GPUs are used).
    """
    lc, rc = cfg.learner, cfg.rollout
    if lc.num_gpus_per_rank or rc.num_gpus_per_engine:
        return None
    served = {sm.name: (sm, sm.settings.num_engines * sm.settings.threads_per_engine) for sm in served_models(cfg)}
    judge = served["judge"][1] if "judge" in served else 0
    teacher = served["teacher"][1] if "teacher" in served else 0
    engines, learner = rc.num_engines * rc.threads_per_engine, lc.world_size * lc.threads_per_rank
    collecting = max(engines + judge, teacher)
    overlapped = cfg.trainer.max_staleness >= 1
    busy = collecting + learner if overlapped else max(collecting, learner)
    if busy <= cores:
        return None

    def threads(sm: ServedModel) -> str:
        return (f"{sm.section}.num_engines={sm.settings.num_engines} x {sm.section}.threads_per_engine="
                f"{sm.settings.threads_per_engine}")

    beside = f" + {threads(served['judge'][0])}" if judge else ""
    if teacher:
        beside += f" (then {threads(served['teacher'][0])} once the rollout is complete)"
    return (f"{busy} compute threads at once on {cores} CPU cores: rollout.num_engines={rc.num_engines} x "
            f"rollout.threads_per_engine={rc.threads_per_engine}" + beside
            + (f" beside learner.world_size={lc.world_size} x learner.threads_per_rank={lc.threads_per_rank} "
               f"(trainer.max_staleness={cfg.trainer.max_staleness} overlaps them)" if overlapped else
               f" or learner.world_size={lc.world_size} x learner.threads_per_rank={lc.threads_per_rank}")
            + "; oversubscribed cores slow both sides. Fewer threads or ranks fit (on 2 cores the measured split is "
            "rollout.threads_per_engine=1 learner.world_size=1 learner.zero_stage=0 learner.max_threads_per_rank=2)")
