"""Where the run's actors are on a multi-node cluster: ``placement.json``, the weight sync's cross-node count,
and the check that the cluster offers the custom resources the config asks for (``*.node_resources``).

The roles are the learner ranks, rollout engines, reward workers and env workers, and the served models'
engines (``cluster.planning.actor_placement.served_models``): role ``judge`` (``reward.judge``) and role
``teacher`` (``distill``), each only when its ``model_path`` is set.

Everything here reads Ray's own tables (``ray.nodes()`` and ``ray.util.placement_group_table``); no actor is
called. A role's actors are found through their placement groups (each actor of this project runs in a bundle
of its own group), so a record costs one GCS query per group.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from cluster.config import Config, ConfigError
from cluster.planning.actor_placement import served_models

PLACEMENT_FILE = "placement.json"

#: resources every Ray node has (not a custom resource a user starts a node with)
RAY_OWN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")

ROLES = ("learner", "rollout", "reward", "env")  # the run's own roles; the served models' follow (role_demand)


def custom_resources(resources: dict[str, float]) -> dict[str, float]:
    """The custom part of a node's resources: without CPU, GPU, memory, object store and Ray's per-node
    (``node:...``) and accelerator (``accelerator_type:...``) markers."""
    return {k: v for k, v in resources.items()
            if k not in RAY_OWN_RESOURCES and not k.startswith(("node:", "accelerator_type:"))}


def role_sections(cfg: Config) -> dict[str, tuple[str, Any]]:
    """Per role, in ``role_demand``'s order: the config section's dotted name (``"distill"``: the fields in
    messages are ``distill.node_resources``, ...) and the section itself. The served models are there only when
    enabled."""
    out: dict[str, tuple[str, Any]] = {role: (role, getattr(cfg, role)) for role in ROLES}
    out.update({m.name: (m.section, m.settings) for m in served_models(cfg)})
    return out


def role_demand(cfg: Config) -> dict[str, tuple[int, dict[str, float]]]:
    """Per role: (number of actors, the bundle of one actor: CPUs, GPUs and ``node_resources``). The roles of
    ``ROLES`` always (an off role counts 0 actors), then ``judge`` and ``teacher`` when their model is set (one
    CPU bundle per engine, ``cluster/runtime/model_fleet.py``)."""
    rc, lc, wc = cfg.rollout, cfg.learner, cfg.reward
    engine = {"CPU": rc.num_cpus_per_engine, **rc.node_resources}
    if rc.num_gpus_per_engine:
        engine["GPU"] = rc.num_gpus_per_engine * rc.tensor_parallel_size
    rank = {"CPU": lc.num_cpus_per_rank, **lc.node_resources}
    if lc.num_gpus_per_rank:
        rank["GPU"] = lc.num_gpus_per_rank
    ec = cfg.env  # env workers of multi-turn episodes: none without an env section
    demand = {"learner": (lc.world_size, rank), "rollout": (rc.num_engines, engine),
              "reward": (wc.num_workers, {"CPU": wc.num_cpus_per_worker, **wc.node_resources}),
              "env": (ec.num_workers if ec.enabled else 0, {"CPU": ec.num_cpus_per_worker, **ec.node_resources})}
    for m in served_models(cfg):
        sm = m.settings
        demand[m.name] = (sm.num_engines, {"CPU": sm.num_cpus_per_engine, **sm.node_resources})
    return demand


def check_node_resources(cfg: Config, nodes: list[dict[str, Any]], where: str = "the cluster") -> None:
    """Refuse a config whose ``*.node_resources`` no live node of ``nodes`` (``ray.nodes()`` rows) offers.

    Per role: some live node must offer each named resource at the asked amount, and one node the whole bundle
    (CPUs and GPUs too); per custom resource, the live nodes together must offer what all actors asking for it
    take. Only custom resources are checked: CPUs overall are the plan's concern (``cluster.planning.plan``).
    The served models' engines count as roles ``judge`` (``reward.judge.node_resources``) and ``teacher``
    (``distill.node_resources``) when their model is set.

    Raises:
        ConfigError: naming the role's field (``<section>.node_resources``), the resource and what the nodes
            offer.
    """
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive")]
    offered = sorted({k for r in alive for k in custom_resources(r)})
    demand, sections = role_demand(cfg), role_sections(cfg)
    totals: dict[str, float] = {}
    for role, (count, bundle) in demand.items():
        field = f"{sections[role][0]}.node_resources"
        asked = sections[role][1].node_resources if count else {}
        for name, amount in asked.items():
            if not any(r.get(name, 0) >= amount for r in alive):
                raise ConfigError(
                    f"{field} asks {name}={amount:g} per {role} actor, but no live node of {where} "
                    f"offers it (custom resources offered: {offered or 'none'}); start nodes with "
                    f"`ray start --resources '{{\"{name}\": N}}'` (gspo-cluster up --node-resources {name}=N) "
                    f"or change {field}")
            totals[name] = totals.get(name, 0.0) + count * amount
        if asked and not any(all(r.get(k, 0) >= v for k, v in bundle.items()) for r in alive):
            raise ConfigError(f"{field}={asked}: no live node of {where} offers a whole {role} "
                              f"bundle {bundle} (CPUs and GPUs on the same node as the custom resources)")
    for name, need in totals.items():
        have = sum(r.get(name, 0) for r in alive)
        if need > have + 1e-9:
            users = [f"{role} ({count} x {sections[role][1].node_resources[name]:g})"
                     for role, (count, _) in demand.items() if count and name in sections[role][1].node_resources]
            raise ConfigError(f"custom resource {name}: {', '.join(users)} need {need:g} in all, the live nodes "
                              f"of {where} offer {have:g}; add nodes or lower the counts")


def check_live_cluster(cfg: Config, address: str) -> list[dict[str, Any]]:
    """``check_node_resources`` against the running cluster at ``address`` (connects, reads ``ray.nodes()``,
    disconnects). Returns a summary per live node (``node_id``, ``node_ip``, ``cpus``, ``resources``).

    Raises:
        ConfigError: the cluster does not answer, or it lacks a resource the config asks for.
    """
    import ray

    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    except Exception as e:  # noqa: BLE001 - any failure to connect is the user's address or cluster
        raise ConfigError(f"trainer.ray_address={address!r}: cannot connect ({type(e).__name__}: {e})") from None
    try:
        nodes = ray.nodes()
    finally:
        ray.shutdown()
    check_node_resources(cfg, nodes, where=f"trainer.ray_address={address!r}")
    return [{"node_id": n["NodeID"], "node_ip": n["NodeManagerAddress"], "cpus": n["Resources"].get("CPU", 0),
             "resources": custom_resources(n["Resources"])} for n in nodes if n.get("Alive")]


def check_connected(cfg: Config) -> None:
    """``check_node_resources`` against the cluster this process is connected to (``ray.init`` done).

    Raises:
        ConfigError: see ``check_node_resources``.
    """
    import ray

    check_node_resources(cfg, ray.nodes(), where=f"the Ray cluster at {cfg.trainer.ray_address or 'this run'}")


# ------------------------------------------------------------------------------------------ placement.json


def _bundle_nodes(pg) -> dict[int, str]:
    """Bundle index -> hex node id of a placement group (empty while unplaced)."""
    from ray.util.placement_group import placement_group_table

    return {int(i): n for i, n in placement_group_table(pg).get("bundles_to_node_id", {}).items()}


def served_fleets(rewards: Any, distiller: Any) -> list[Any]:
    """The served models' fleets (``cluster.runtime.model_fleet.ModelFleet``) a run holds, the judge's first:
    ``rewards.judge`` (a ``cluster.runtime.judge.JudgedRewards``; a plain reward pool has none) and
    ``distiller.teacher`` (a ``cluster.driver.distill.Distiller``; None without distillation)."""
    return [f for f in (getattr(rewards, "judge", None), getattr(distiller, "teacher", None)) if f is not None]


def actor_slots(learners, fleet, reward_groups, env_groups=None, served=()) -> list[tuple[str, int, Any, int]]:
    """(role, index, placement group, bundle index) of every actor: learner ranks in rank order (their groups'
    bundles in order), engines by slot, reward workers by slot, env workers by slot (``env_groups``: None
    without episodes), then per served fleet of ``served`` (``served_fleets``) its engines by slot under the
    fleet's ``role`` (``"judge"``, ``"teacher"``; one group of one bundle each)."""
    slots: list[tuple[str, int, Any, int]] = []
    rank = 0
    for pg in getattr(learners, "groups", []):
        for b in range(pg.bundle_count):
            slots.append(("learner", rank, pg, b))
            rank += 1
    slots += [("rollout", i, pg, 0) for i, pg in enumerate(getattr(fleet, "groups", []))]
    groups = getattr(reward_groups, "groups", {}) or {}
    slots += [("reward", slot, groups[slot], 0) for slot in sorted(groups)]
    groups = getattr(env_groups, "groups", {}) or {}
    slots += [("env", slot, groups[slot], 0) for slot in sorted(groups)]
    for model in served:
        slots += [(model.role, i, pg, 0) for i, pg in enumerate(model.groups)]
    return slots


def placement_rows(slots: list[tuple[str, int, Any, int]]) -> list[dict[str, Any]]:
    """The rows of ``placement.json``: per actor ``role``, ``index``, ``node_id`` (Ray's hex node id, None while
    its bundle is unplaced), ``node_ip`` and ``node_resources`` (the node's custom resources, totals)."""
    import ray

    nodes = {n["NodeID"]: n for n in ray.nodes()}
    tables: dict[Any, dict[int, str]] = {}
    rows = []
    for role, index, pg, bundle in slots:
        if pg.id not in tables:
            tables[pg.id] = _bundle_nodes(pg)
        node_id = tables[pg.id].get(bundle)
        node = nodes.get(node_id, {})
        rows.append({"role": role, "index": index, "node_id": node_id, "node_ip": node.get("NodeManagerAddress"),
                     "node_resources": custom_resources(node.get("Resources", {}))})
    return rows


def cross_node_engines(rows: list[dict[str, Any]]) -> int:
    """How many rollout engines are on another node than learner rank 0 (their weights cross a node)."""
    rank0 = next((r["node_id"] for r in rows if r["role"] == "learner" and r["index"] == 0), None)
    return sum(1 for r in rows if r["role"] == "rollout" and r["node_id"] != rank0)


class PlacementRecord:
    """``<run_dir>/placement.json``, rewritten (atomically) whenever an actor's node changed since the last
    write: call ``update`` after the services start and at every weight sync (which follows every engine
    replacement and every change of the fleet's size). A served model's engine is replaced (a new placement
    group) within a step's collection, so the step's weight sync writes it; a step without a sync leaves it to
    the next sync."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / PLACEMENT_FILE
        self.rows: list[dict[str, Any]] = []
        self.slots: list[tuple[str, int, Any, int]] = []  # the slots read last (role, index, group id, bundle)

    def update(self, learners, fleet, reward_groups, env_groups=None, served=()) -> list[dict[str, Any]]:
        """Read where every actor is now (``served``: the served models' fleets, ``served_fleets``; none for a
        run without them); write ``placement.json`` when it changed. Returns the rows. The placement groups are
        the same as at the last call (no actor replaced, added or removed) and every node of the last rows is
        alive: the rows of that call, with one question to Ray's GCS (the live nodes). A group's bundle moves
        only when its node is lost: Ray places the bundle again on another node and restarts the actor there in
        the same group, so a lost node makes the rows be read again."""
        slots = actor_slots(learners, fleet, reward_groups, env_groups, served)
        key = [(role, index, pg.id, bundle) for role, index, pg, bundle in slots]
        if key == self.slots and self.path.is_file() and self._nodes_alive():
            return self.rows
        self.slots = key
        rows = placement_rows(slots)
        if rows != self.rows or not self.path.is_file():
            tmp = self.path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(rows, indent=1))
            os.replace(tmp, self.path)
            self.rows = rows
        return rows

    def _nodes_alive(self) -> bool:
        """Whether every node the last rows name is alive in Ray's GCS (a row with no node counts as lost)."""
        import ray

        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        return all(r["node_id"] in alive for r in self.rows)

    @property
    def cross_node(self) -> int:
        """Engines on another node than learner rank 0 at the last ``update``."""
        return cross_node_engines(self.rows)
