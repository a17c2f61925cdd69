"""A run on a 3-node Ray cluster (``ray.cluster_utils.Cluster``: a head and two worker nodes, each with its own
raylet, object store and resources, on this machine): the learner's ranks on the head through
``learner.node_resources``, one engine per worker node through ``rollout.node_resources``. Two RL steps after a
short warm start; ``placement.json`` must say so, the weight sync must report both engines as cross-node, and
after the steps the engines' log-probs of a fixed sequence must equal the learner's within 1e-5, over the
object store and then over a gloo group whose members are on three nodes.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import REPO_ROOT


OBJECT_STORE = 300 * 2**20  # per node: three nodes share this machine


@pytest.fixture(scope="module")
def three_nodes():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"learner_node": 1}, "object_store_memory": OBJECT_STORE,
        "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=1, resources={"rollout_node": 1}, object_store_memory=OBJECT_STORE)
               for _ in range(2)]
    cluster.wait_for_nodes()
    try:
        yield cluster, [w.node_id for w in workers]
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def trainer(three_nodes, tmp_path_factory):
    from cluster.config import load_config
    from cluster.driver.trainer import Trainer

    cluster, _ = three_nodes
    cfg = load_config(REPO_ROOT / "configs" / "tiny_moe_zero2.yaml", [
        f"trainer.output_dir={tmp_path_factory.mktemp('multinode')}", "trainer.run_name=three_nodes",
        f"trainer.ray_address={cluster.address}", "trainer.total_steps=2", "trainer.prompts_per_step=8",
        "trainer.group_size=4", "trainer.eval_every=0", "trainer.save_every=0", "trainer.plots=false",
        "learner.micro_batch_size=2", "warm_start.steps=5", "warm_start.batch_size=16", "data.num_eval=8",
        "rollout.num_engines=2", "rollout.node_resources={rollout_node: 1}",
        "learner.node_resources={learner_node: 0.5}", "wandb.mode=disabled",
    ])
    t = Trainer(cfg)
    t.start()
    yield t
    t.shutdown()


def _engine_matches_learner(t, atol: float) -> None:
    """Log-probs of a fixed sequence: every engine against learner rank 0, within ``atol``."""
    import ray

    from cluster.driver.batching import build_train_batch
    from rollout.contracts import Completion

    prompt = t.tokenizer("12+34=", add_special_tokens=False)["input_ids"]
    response = t.tokenizer("46", add_special_tokens=False)["input_ids"] + [t.tokenizer.eos_token_id]
    comp = Completion("fixed", 0, prompt, response, [0.0] * len(response), "46", "stop", 0)
    batch = build_train_batch([comp], torch.zeros(1), torch.zeros(1), pad_token_id=0)
    learner_lp = t.learners.call("compute_log_probs", batch)[0][0][batch.response_mask[0]].float()
    for engine in t.fleet.engines:
        engine_lp = torch.tensor(ray.get(engine.sequence_logprobs.remote(prompt + response, len(prompt))))
        assert engine_lp.shape == learner_lp.shape
        assert (engine_lp - learner_lp).abs().max().item() <= atol, (engine_lp, learner_lp)


def test_roles_on_their_nodes_and_sync_exact_across_nodes(three_nodes, trainer):
    import ray

    cluster, worker_ids = three_nodes
    head_id = cluster.head_node.node_id
    trainer.run()

    rows = json.loads((trainer.run_dir / "placement.json").read_text())
    by_role = {role: [r for r in rows if r["role"] == role] for role in ("learner", "rollout", "reward")}
    assert [r["index"] for r in by_role["learner"]] == [0, 1]
    assert {r["node_id"] for r in by_role["learner"]} == {head_id}
    assert sorted(r["node_id"] for r in by_role["rollout"]) == sorted(worker_ids)  # one engine per worker node
    assert all(r["node_resources"].get("rollout_node") == 1 for r in by_role["rollout"])
    assert by_role["learner"][0]["node_resources"].get("learner_node") == 1
    assert len(by_role["reward"]) == 1 and by_role["reward"][0]["node_id"] in worker_ids  # the head is full
    assert all(r["node_ip"] for r in rows)

    steps = [json.loads(l) for l in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["step"] > 0]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["sync/cross_node"] == 2.0 and s["sync/bytes"] > 0 and s["sync/seconds"] > 0
        assert s["actor/train_rollout_logprob_diff"] < 1e-5
    _engine_matches_learner(trainer, atol=1e-5)
    # Every node saw the driver's model, output folder and data (cluster.runtime.node_files, also run at start).
    from cluster.runtime.node_files import check_nodes
    from cluster.runtime.services import actor_env

    assert check_nodes(trainer.cfg, trainer.model_path, [], actor_env(1)) == 3

    # The same weights again, broadcast over gloo: the group's members are on the three nodes.
    sc = trainer.cfg.sync
    version = trainer.weight_version + 1
    report = trainer.learners.sync_weights(list(trainer.fleet.engines), version, sc.bucket_mb,
                                           sc.max_buckets_in_flight, sc.engine_timeout_s, "collective")
    assert report.transport == "collective" and not report.failed_engines, report
    assert ray.get([e.weight_version.remote() for e in trainer.fleet.engines]) == [version, version]
    _engine_matches_learner(trainer, atol=1e-5)
