"""Env workers on their own node: a 2-node Ray cluster (``ray.cluster_utils.Cluster`` on this machine), the env
workers pinned through ``env.node_resources`` to the worker node, the learner, engine and reward worker on the
head. One GSPO step of the calculator agent after a short warm start; ``placement.json`` must put both env workers
on the worker node, and the episodes must have run there (tool calls made, no environment failed)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import REPO_ROOT

OBJECT_STORE = 300 * 2**20  # per node: both nodes share this machine


@pytest.mark.timeout(900)
def test_env_workers_run_on_the_node_their_resources_name(local_cluster, tmp_path):
    from cluster.config import load_config
    from cluster.driver.trainer import Trainer

    cluster = local_cluster({"num_cpus": 2, "object_store_memory": OBJECT_STORE, "include_dashboard": False})
    env_node = cluster.add_node(num_cpus=1, resources={"env_node": 2}, object_store_memory=OBJECT_STORE)
    cluster.wait_for_nodes()
    cfg = load_config(REPO_ROOT / "configs" / "tiny_agent_calc.yaml", [
        f"trainer.output_dir={tmp_path}", "trainer.run_name=env_node", f"trainer.ray_address={cluster.address}",
        "trainer.total_steps=1", "trainer.prompts_per_step=8", "trainer.group_size=4", "trainer.eval_every=0",
        "trainer.save_every=0", "trainer.plots=false", "learner.micro_batch_size=8", "warm_start.steps=150",
        "data.num_train=512", "data.num_eval=8", "wandb.mode=disabled", "env.num_workers=2",
        "env.node_resources={env_node: 1}"])
    t = Trainer(cfg)
    t.start()
    try:
        t.run()  # the warm start, step 0's evaluation, one step
    finally:
        t.shutdown()
    rows = json.loads((tmp_path / "env_node" / "placement.json").read_text())
    env_rows = [r for r in rows if r["role"] == "env"]
    assert [r["index"] for r in env_rows] == [0, 1]
    assert {r["node_id"] for r in env_rows} == {env_node.node_id}
    assert all(r["node_id"] != env_node.node_id for r in rows if r["role"] != "env")
    step = [json.loads(l) for l in (tmp_path / "env_node" / "metrics.jsonl").read_text().splitlines()][-1]
    assert step["step"] == 1 and step["agent/env_failed"] == 0.0 and step["agent/tool_calls_mean"] > 0.5
