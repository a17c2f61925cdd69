"""A reward worker's node and then the learner's node lost under a run on a local multi-node Ray cluster
(``ray.cluster_utils.Cluster``), and the run resumed on a node added afterwards:

1. the reward worker's node is removed between steps: Ray places its bundle again on the other node offering
   ``reward_node`` and restarts the worker there; the next step scores every completion (none invalid), no
   prompt is lost or trained twice, and ``placement.json`` shows the worker's new node;
2. the node of both learner ranks is removed: the next step fails fast with a Ray error from the ranks that
   ``cluster.train.learner_lost`` recognises (exit 3), the checkpoint written before stays intact;
3. a new node with ``learner_node`` joins, and a run with ``trainer.resume=true`` continues from that
   checkpoint's step with its ranks on the new node.

A matrix test (``make test-matrix``).
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import REPO_ROOT
from tests.helpers.nodes import remove_node

STORE = 300 * 2**20


def _rows(t, role: str) -> list[dict]:
    return [r for r in json.loads((t.run_dir / "placement.json").read_text()) if r["role"] == role]


def test_reward_node_lost_then_learner_node_lost_then_resume_on_a_new_node(tmp_path, local_cluster):
    import ray

    from cluster.config import load_config
    from cluster.driver import checkpoint
    from cluster.driver.trainer import Trainer
    from cluster.train import learner_lost

    cluster = local_cluster({
        "num_cpus": 1, "resources": {"rollout_node": 1}, "object_store_memory": STORE, "include_dashboard": False})
    reward_nodes = [cluster.add_node(num_cpus=1, resources={"reward_node": 1}, object_store_memory=STORE)
                    for _ in range(2)]
    learner_node = cluster.add_node(num_cpus=1, resources={"learner_node": 1}, object_store_memory=STORE)
    cluster.wait_for_nodes()
    overrides = [
        f"trainer.output_dir={tmp_path}", "trainer.run_name=loss2", f"trainer.ray_address={cluster.address}",
        "trainer.total_steps=4", "trainer.prompts_per_step=8", "trainer.group_size=4", "trainer.eval_every=0",
        "trainer.plots=false", "learner.micro_batch_size=2", "warm_start.steps=0", "data.num_eval=8",
        "rollout.node_resources={rollout_node: 1}", "learner.node_resources={learner_node: 0.5}",
        "reward.node_resources={reward_node: 1}", "cluster.placement_timeout_s=60", "wandb.mode=disabled",
    ]
    t = Trainer(load_config(REPO_ROOT / "configs" / "tiny_moe_zero2.yaml", overrides))
    try:
        t.start()
        t.rl_step()
        first = _rows(t, "reward")[0]["node_id"]
        remove_node(cluster, next(n for n in reward_nodes if n.node_id == first))
        m = t.rl_step()
        assert m["reward/invalid"] == 0.0
        other = next(n for n in reward_nodes if n.node_id != first)
        assert [r["node_id"] for r in _rows(t, "reward")] == [other.node_id]
        uids = [u for step in t.trained_uids for u in step]
        assert len(uids) == len(set(uids)) == 2 * 8
        saved = t.save()

        assert {r["node_id"] for r in _rows(t, "learner")} == {learner_node.node_id}
        remove_node(cluster, learner_node)
        # The dead ranks' own ActorDiedError, or a peer's gloo error raised before it died too: either is a
        # lost rank for cluster.train (exit 3), never a wait until learner.dist_timeout_s.
        with pytest.raises(ray.exceptions.RayError) as err:
            t.rl_step()
        assert learner_lost(t, err.value)
        assert checkpoint.latest_checkpoint(t.run_dir) == saved
    finally:
        t.shutdown()

    new_node = cluster.add_node(num_cpus=1, resources={"learner_node": 1}, object_store_memory=STORE)
    cluster.wait_for_nodes()
    t = Trainer(load_config(REPO_ROOT / "configs" / "tiny_moe_zero2.yaml", overrides + ["trainer.resume=true"]))
    try:
        t.start()
        assert t.step == 2 and t.weight_version == 2
        assert {r["node_id"] for r in _rows(t, "learner")} == {new_node.node_id}
        m = t.rl_step()
        assert m["step"] == 3 and m["weight_version"] == 3
        assert m["actor/train_rollout_logprob_diff"] < 1e-5  # the engines hold the resumed weights
    finally:
        t.shutdown()
