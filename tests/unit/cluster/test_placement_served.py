"""The served models' engines (the LLM judge's, ``reward.judge``; the distillation teacher's, ``distill``) in
cluster/runtime/placement.py without a cluster (fast): their rows in ``placement.json`` (fake placement groups
and fleets, a fake ``ray.nodes()``), and their ``node_resources`` in the check of the cluster's nodes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from cluster.config import ConfigError, load_config
from cluster.runtime import placement
from cluster.runtime.placement import check_node_resources, role_demand
from tests.helpers import REPO_ROOT

DISTILL = REPO_ROOT / "configs" / "tiny_distill.yaml"


def _cfg(*overrides: str):
    """configs/tiny_distill.yaml with the builtin teacher (the student's tokenizer) and ``overrides``."""
    return load_config(DISTILL, ["distill.model_path=builtin:tiny_moe", *overrides])


def _node(node_id: str, cpus: float = 4, alive: bool = True, **custom: float) -> dict:
    """A ``ray.nodes()`` row (its address ``ip-<node_id>``)."""
    return {"NodeID": node_id, "Alive": alive, "NodeManagerAddress": f"ip-{node_id}",
            "Resources": {"CPU": cpus, "memory": 1e9, "object_store_memory": 5e8, f"node:{node_id}": 1.0, **custom}}


class _Group:
    """A placement group as ``PlacementRecord`` sees it: an ``id`` and a ``bundle_count``."""

    def __init__(self, gid: str, bundles: int = 1):
        self.id, self.bundle_count = gid, bundles


def _fleet(role: str, *gids: str):
    """A served model's fleet as ``actor_slots`` sees it (``cluster.runtime.model_fleet.ModelFleet``)."""
    return SimpleNamespace(role=role, groups=[_Group(g) for g in gids])


@pytest.fixture
def cluster(monkeypatch):
    """Three fake live nodes; ``where`` maps a group id to the node of all its bundles."""
    import ray

    nodes = [_node("head"), _node("w1", judge_node=1), _node("w2", teacher_node=2)]
    where: dict[str, str] = {}
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    monkeypatch.setattr(placement, "_bundle_nodes", lambda pg: {b: where[pg.id] for b in range(pg.bundle_count)})
    return SimpleNamespace(nodes=nodes, where=where)


def test_placement_rows_list_judge_and_teacher_engines_with_their_nodes(tmp_path, cluster):
    cluster.where.update({"L": "head", "E0": "head", "R0": "w1", "J0": "w1", "J1": "head", "T0": "w2"})
    learners = SimpleNamespace(groups=[_Group("L", bundles=2)])
    fleet = SimpleNamespace(groups=[_Group("E0")])
    rewards = SimpleNamespace(groups={0: _Group("R0")})
    judged = SimpleNamespace(judge=_fleet("judge", "J0", "J1"))  # JudgedRewards: .judge is the JudgeFleet
    distiller = SimpleNamespace(teacher=_fleet("teacher", "T0"))
    served = placement.served_fleets(judged, distiller)
    assert [f.role for f in served] == ["judge", "teacher"]
    rows = placement.PlacementRecord(tmp_path).update(learners, fleet, rewards, None, served)
    got = [(r["role"], r["index"], r["node_id"]) for r in rows]
    assert got == [("learner", 0, "head"), ("learner", 1, "head"), ("rollout", 0, "head"), ("reward", 0, "w1"),
                   ("judge", 0, "w1"), ("judge", 1, "head"), ("teacher", 0, "w2")]
    judge0 = next(r for r in rows if r["role"] == "judge" and r["index"] == 0)
    assert judge0["node_resources"] == {"judge_node": 1} and judge0["node_ip"] == "ip-w1"
    assert json.loads((tmp_path / "placement.json").read_text()) == rows
    assert placement.cross_node_engines(rows) == 0  # served engines never count as the sync's engines


def test_a_replaced_served_engine_is_written_at_the_next_update(tmp_path, cluster):
    cluster.where.update({"R0": "head", "T0": "w1", "T0b": "w2"})
    rewards = SimpleNamespace(groups={0: _Group("R0")})
    teacher = _fleet("teacher", "T0")
    record = placement.PlacementRecord(tmp_path)
    served = placement.served_fleets(SimpleNamespace(), SimpleNamespace(teacher=teacher))  # no judge: a plain pool
    assert [r["node_id"] for r in record.update(None, None, rewards, None, served)] == ["head", "w1"]
    teacher.groups[0] = _Group("T0b")  # ModelFleet._replace: a new engine in a new placement group
    record.update(None, None, rewards, None, served)
    saved = json.loads((tmp_path / "placement.json").read_text())
    assert [(r["role"], r["index"], r["node_id"]) for r in saved] == [("reward", 0, "head"), ("teacher", 0, "w2")]


def test_no_served_models_no_served_rows(tmp_path, cluster):
    cluster.where.update({"R0": "w1"})
    assert placement.served_fleets(SimpleNamespace(), None) == []
    rows = placement.PlacementRecord(tmp_path).update(None, None, SimpleNamespace(groups={0: _Group("R0")}))
    assert [r["role"] for r in rows] == ["reward"]


def test_role_demand_counts_the_served_engines_only_when_on():
    demand = role_demand(_cfg("distill.num_engines=2", "distill.node_resources={teacher_node: 1}",
                              "reward.judge.model_path=builtin:tiny_moe", "reward.judge.num_cpus_per_engine=0.5"))
    assert demand["teacher"] == (2, {"CPU": 0.5, "teacher_node": 1.0})
    assert demand["judge"] == (1, {"CPU": 0.5})
    plain = role_demand(load_config(REPO_ROOT / "configs" / "tiny_moe_zero2.yaml"))
    assert list(plain) == ["learner", "rollout", "reward", "env"]


def test_a_teacher_resource_no_live_node_offers_is_refused_naming_distill_node_resources():
    cfg = _cfg("distill.node_resources={teacher_node: 1}")
    with pytest.raises(ConfigError) as err:
        check_node_resources(cfg, [_node("head"), _node("w1", alive=False, teacher_node=1)])
    msg = str(err.value)
    assert msg.startswith("distill.node_resources asks teacher_node=1 per teacher actor") and "change distill" in msg
    check_node_resources(cfg, [_node("head"), _node("w1", teacher_node=1)])


def test_the_judges_engines_together_need_what_they_ask_naming_reward_judge():
    cfg = _cfg("reward.judge.model_path=builtin:tiny_moe", "reward.judge.num_engines=2",
               "reward.judge.node_resources={judge_node: 1}")
    with pytest.raises(ConfigError, match=r"judge_node: judge \(2 x 1\) need 2 in all.*offer 1"):
        check_node_resources(cfg, [_node("head"), _node("w1", judge_node=1)])
    with pytest.raises(ConfigError, match=r"reward\.judge\.node_resources=.*whole judge bundle"):
        check_node_resources(cfg, [_node("head"), _node("w1", cpus=0.5, judge_node=2)])
    check_node_resources(cfg, [_node("head"), _node("w1", judge_node=2)])


def test_a_resource_shared_by_the_teacher_and_the_rollout_engines_is_counted_for_both():
    cfg = _cfg("distill.node_resources={box: 1}", "rollout.node_resources={box: 1}")
    with pytest.raises(ConfigError, match=r"box: rollout \(1 x 1\), teacher \(1 x 1\) need 2 in all"):
        check_node_resources(cfg, [_node("head"), _node("w1", box=1)])
    check_node_resources(cfg, [_node("head"), _node("w1", box=2)])


def test_an_off_served_model_asks_nothing():
    cfg = load_config(REPO_ROOT / "configs" / "tiny_moe_zero2.yaml", ["reward.judge.node_resources={judge_node: 1}"])
    check_node_resources(cfg, [_node("head")])  # no judge model: its node_resources are not asked
