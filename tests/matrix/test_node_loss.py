"""Nodes lost and added under a run on a local multi-node Ray cluster (``ray.cluster_utils.Cluster``; a removed
node's raylet, object store and workers end, as when a machine is lost). One run, step by step:

1. one engine on a rollout node; that node is removed between steps: the next step replaces the engine on the
   other rollout node (``placement.json`` rewritten, ``fault/rollout_restarts``), no prompt lost or trained twice;
2. a new rollout node joins and ``control.yaml`` raises ``rollout.num_engines`` to 2: the new engine lands on the
   new node holding the current weights;
3. the engines' nodes are all removed: the run waits ``cluster.placement_timeout_s`` for a node offering
   ``rollout_node`` (a log line names it), then stops with ``PlacementTimeout``; the checkpoint written before
   is intact and loads.

A matrix test (``make test-matrix``): about 3 minutes on 2 busy cores.
"""

from __future__ import annotations

import json
import logging

import pytest

from tests.helpers import REPO_ROOT
from tests.helpers.nodes import remove_node

STORE = 300 * 2**20


def _placement(t) -> dict[str, list[dict]]:
    rows = json.loads((t.run_dir / "placement.json").read_text())
    return {role: [r for r in rows if r["role"] == role] for role in ("learner", "rollout", "reward")}




def test_engine_node_lost_replaced_then_node_added_then_no_room(tmp_path, caplog, local_cluster):
    import ray

    from cluster.config import load_config
    from cluster.driver import checkpoint
    from cluster.driver.trainer import Trainer
    from cluster.runtime.services import PlacementTimeout

    cluster = local_cluster({
        "num_cpus": 2, "resources": {"learner_node": 1, "reward_node": 1}, "object_store_memory": STORE,
        "include_dashboard": False})
    rollout_nodes = [cluster.add_node(num_cpus=1, resources={"rollout_node": 1}, object_store_memory=STORE)
                     for _ in range(2)]
    cluster.wait_for_nodes()
    cfg = load_config(REPO_ROOT / "configs" / "tiny_moe_zero2.yaml", [
        f"trainer.output_dir={tmp_path}", "trainer.run_name=loss", f"trainer.ray_address={cluster.address}",
        "trainer.total_steps=4", "trainer.prompts_per_step=8", "trainer.group_size=4", "trainer.eval_every=0",
        "trainer.plots=false", "learner.micro_batch_size=2", "warm_start.steps=0", "data.num_eval=8",
        "rollout.num_engines=1", "rollout.node_resources={rollout_node: 1}",
        "learner.node_resources={learner_node: 0.5}", "reward.node_resources={reward_node: 1}",
        "cluster.placement_timeout_s=8", "wandb.mode=disabled",
    ])
    t = Trainer(cfg)
    try:
        t.start()
        t.rl_step()
        first = _placement(t)["rollout"][0]["node_id"]
        lost = next(n for n in rollout_nodes if n.node_id == first)
        remove_node(cluster, lost)
        m = t.rl_step()  # the dead engine is found in the rollout and replaced
        assert m["fault/rollout_restarts"] >= 1
        survivor = next(n for n in rollout_nodes if n is not lost)
        assert [r["node_id"] for r in _placement(t)["rollout"]] == [survivor.node_id]
        assert m["sync/cross_node"] == 1.0 and m["actor/train_rollout_logprob_diff"] < 1e-5
        uids = [u for step in t.trained_uids for u in step]
        assert len(uids) == len(set(uids)) == 2 * 8  # no prompt lost or trained twice

        added = cluster.add_node(num_cpus=1, resources={"rollout_node": 1}, object_store_memory=STORE)
        cluster.wait_for_nodes()
        (t.run_dir / "control.yaml").write_text("rollout.num_engines: 2\n")
        m = t.rl_step()
        engines = _placement(t)["rollout"]
        assert sorted(r["node_id"] for r in engines) == sorted([survivor.node_id, added.node_id])
        assert ray.get([e.weight_version.remote() for e in t.fleet.engines]) == [t.weight_version] * 2
        assert m["sync/cross_node"] == 2.0
        saved = t.save()

        for node in (survivor, added):
            remove_node(cluster, node)
        with caplog.at_level(logging.WARNING, logger="cluster.runtime.services"):
            with pytest.raises(PlacementTimeout, match="rollout_node"):
                t.rl_step()
        assert any("rollout_node" in r.getMessage() and "waits up to 8s" in r.getMessage() for r in caplog.records)
        assert checkpoint.latest_checkpoint(t.run_dir) == saved
        assert checkpoint.read_state(saved)["step"] == 3
    finally:
        t.shutdown()
