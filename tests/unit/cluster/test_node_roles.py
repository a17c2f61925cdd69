"""Roles on nodes without a cluster (fast): the ``*.node_resources`` config keys, the check of a cluster's nodes
against them (cluster/runtime/placement.py), the cross-node count, and ``gspo-cluster``'s resource arguments."""

from __future__ import annotations

import json

import pytest

from cluster.config import ConfigError, load_config
from cluster.runtime.local_cluster import parse_resources
from cluster.runtime.placement import check_node_resources, cross_node_engines, custom_resources
from tests.helpers import REPO_ROOT

CONFIG = REPO_ROOT / "configs" / "tiny_moe_zero2.yaml"


def _cfg(*overrides: str):
    return load_config(CONFIG, list(overrides))


def _node(cpus: float, alive: bool = True, **custom: float) -> dict:
    """A ``ray.nodes()`` row."""
    return {"NodeID": "x", "Alive": alive, "NodeManagerAddress": "127.0.0.1",
            "Resources": {"CPU": cpus, "memory": 1e9, "object_store_memory": 5e8, "node:127.0.0.1": 1.0, **custom}}


@pytest.mark.parametrize("section", ["rollout", "learner", "reward"])
def test_node_resources_load_from_yaml_into_every_role(section):
    cfg = _cfg(f"{section}.node_resources={{box_a: 1, box_b: 0.5}}")
    assert getattr(cfg, section).node_resources == {"box_a": 1.0, "box_b": 0.5}


@pytest.mark.parametrize("value,needle", [("{CPU: 1}", "'CPU'"), ("{'node:127.0.0.1': 1}", "node:"),
                                          ("{box: 0}", "box=0"), ("{box: -1}", "box=-1")])
def test_node_resources_refuse_ray_own_names_and_bad_amounts(value, needle):
    with pytest.raises(ConfigError) as err:
        _cfg(f"rollout.node_resources={value}")
    assert "rollout.node_resources" in str(err.value) and needle in str(err.value)


def test_check_refuses_a_resource_no_live_node_offers_naming_role_and_resource():
    cfg = _cfg("reward.node_resources={judge_node: 1}")
    nodes = [_node(2, learner_node=1), _node(1, alive=False, judge_node=1)]  # only a dead node offers it
    with pytest.raises(ConfigError) as err:
        check_node_resources(cfg, nodes)
    msg = str(err.value)
    assert "reward.node_resources" in msg and "judge_node=1" in msg and "learner_node" in msg


def test_check_counts_what_all_actors_asking_for_a_resource_take():
    cfg = _cfg("rollout.node_resources={rollout_node: 1}", "rollout.num_engines=3")
    nodes = [_node(1, rollout_node=1), _node(1, rollout_node=1)]
    with pytest.raises(ConfigError, match=r"rollout_node: rollout \(3 x 1\) need 3 in all.*offer 2"):
        check_node_resources(cfg, nodes)
    check_node_resources(cfg, nodes + [_node(1, rollout_node=1)])  # a third node: accepted


def test_check_wants_the_cpus_on_the_same_node_as_the_resource():
    cfg = _cfg("learner.node_resources={learner_node: 0.5}")  # 2 ranks x 0.5 CPU
    with pytest.raises(ConfigError, match="whole learner bundle"):
        check_node_resources(cfg, [_node(0.25, learner_node=1), _node(4)])
    check_node_resources(cfg, [_node(1, learner_node=1), _node(4)])


def test_check_accepts_a_config_without_node_resources_anywhere():
    check_node_resources(_cfg(), [_node(1)])


def test_custom_resources_drop_ray_own_keys():
    assert custom_resources(_node(2, rollout_node=1, **{"accelerator_type:A100": 1})["Resources"]) == {"rollout_node": 1}


def test_cross_node_counts_engines_away_from_learner_rank_0():
    rows = [{"role": "learner", "index": 0, "node_id": "h"}, {"role": "learner", "index": 1, "node_id": "w1"},
            {"role": "rollout", "index": 0, "node_id": "h"}, {"role": "rollout", "index": 1, "node_id": "w1"},
            {"role": "rollout", "index": 2, "node_id": "w2"}, {"role": "reward", "index": 0, "node_id": "w2"}]
    assert cross_node_engines(rows) == 2


def test_parse_resources_defaults_the_amount_to_one_and_refuses_bad_items():
    assert parse_resources(["rollout_node", "big=2.5"]) == {"rollout_node": 1.0, "big": 2.5}
    for bad in ["CPU=1", "=1", "x=abc", "x=0"]:
        with pytest.raises(ValueError, match="--node-resources"):
            parse_resources([bad])


class _Group:
    """A placement group as ``PlacementRecord`` sees it: an ``id`` and a ``bundle_count``."""

    def __init__(self, gid: str):
        self.id, self.bundle_count = gid, 1


def test_placement_record_reads_again_when_a_node_of_its_rows_is_lost(tmp_path, monkeypatch):
    """Ray restarts a worker whose node is lost in the same placement group on another node: the record must
    not keep the lost node (the same groups are no reason to skip the read when a node they name is gone)."""
    import ray

    from cluster.runtime import placement

    nodes = {"n1": True, "n2": True}
    where = {"reward": "n1"}
    monkeypatch.setattr(ray, "nodes", lambda: [{**_node(1), "NodeID": n, "Alive": a} for n, a in nodes.items()])
    monkeypatch.setattr(placement, "_bundle_nodes", lambda pg: {0: where[pg.id]})
    rewards = type("Pool", (), {"groups": {0: _Group("reward")}})()
    record = placement.PlacementRecord(tmp_path)
    assert [r["node_id"] for r in record.update(None, None, rewards)] == ["n1"]
    where["reward"] = "n2"  # moved while its node lives: not possible in Ray, so the cached rows stand
    assert [r["node_id"] for r in record.update(None, None, rewards)] == ["n1"]
    nodes["n1"] = False  # the node is lost and Ray placed the bundle on n2
    assert [r["node_id"] for r in record.update(None, None, rewards)] == ["n2"]
    assert [r["node_id"] for r in json.loads((tmp_path / "placement.json").read_text())] == ["n2"]


def test_env_workers_node_resources_are_checked_like_the_other_roles():
    agent = REPO_ROOT / "configs" / "tiny_agent_calc.yaml"
    with pytest.raises(ConfigError, match="env.node_resources"):
        load_config(agent, ["env.node_resources={CPU: 1}"])
    cfg = load_config(agent, ["env.node_resources={env_node: 1}", "env.num_workers=2"])
    with pytest.raises(ConfigError, match=r"env.node_resources asks env_node=1 per env actor"):
        check_node_resources(cfg, [_node(4)])
    with pytest.raises(ConfigError, match=r"env_node: env \(2 x 1\) need 2 in all"):
        check_node_resources(cfg, [_node(4), _node(1, env_node=1)])
    check_node_resources(cfg, [_node(4), _node(1, env_node=2)])
    check_node_resources(_cfg("env.node_resources={env_node: 1}"), [_node(4)])  # no env section: not asked
