"""End to end on the CPU with real components: Ray, vLLM engines, 2 DeepSpeed learner ranks, reward workers.

Runs 2 RL steps (after a few warm-start steps) and checks that the weights changed, that every engine reports
the new weight version, and that after the sync an engine's log-probs of a fixed sequence equal the learner's
within 1e-4. Also checks the run's outputs: metrics.jsonl with the documented keys, a checkpoint, the plot.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.helpers import REPO_ROOT, assert_png

REQUIRED_KEYS = [
    "step", "reward/mean", "reward/accuracy", "loss/policy", "actor/clip_fraction", "actor/seq_ratio_mean",
    "actor/seq_ratio_max", "actor/entropy", "actor/grad_norm", "actor/train_rollout_logprob_diff",
    "response/length_mean", "response/clip_ratio", "timing/rollout_s", "timing/reward_s", "timing/learner_s",
    "timing/weight_sync_s", "timing/step_s", "throughput/rollout_tokens_per_s", "weight_version",
]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from cluster.config import load_config
    from cluster.driver.trainer import Trainer

    out = tmp_path_factory.mktemp("e2e")
    cfg = load_config(
        REPO_ROOT / "configs" / "tiny_moe_zero2.yaml",
        [
            f"trainer.output_dir={out}", "trainer.run_name=e2e", "trainer.total_steps=2", "trainer.prompts_per_step=8",
            "trainer.group_size=4", "trainer.eval_every=0", "trainer.save_every=0", "learner.micro_batch_size=2",
            "warm_start.steps=3", "warm_start.batch_size=16", "rollout.num_engines=2", "reward.num_workers=2",
            "data.num_eval=16", "wandb.mode=disabled",
        ],
    )
    t = Trainer(cfg)
    t.start()
    yield t
    t.shutdown()
    import ray

    ray.shutdown()


def _checksums(t):
    return t.learners.call("state_checksum")


def test_two_steps_end_to_end(trainer):
    import ray

    from cluster.driver.batching import build_train_batch
    from rollout.contracts import Completion

    before = _checksums(trainer)
    summary = trainer.run()
    after = _checksums(trainer)
    assert before[0] != after[0], "weights did not change"
    assert after[0] == after[1], "learner ranks diverged"
    # 1 version for the warm start sync, +1 per RL step
    versions = ray.get([e.weight_version.remote() for e in trainer.fleet.engines])
    assert versions == [3, 3] and trainer.weight_version == 3

    # The engines now hold the learner's weights: log-probs of a fixed sequence agree within 1e-4.
    prompt = trainer.tokenizer("12+34=", add_special_tokens=False)["input_ids"]
    response = trainer.tokenizer("46", add_special_tokens=False)["input_ids"] + [trainer.tokenizer.eos_token_id]
    seq = prompt + response
    comp = Completion("fixed", 0, prompt, response, [0.0] * len(response), "46", "stop", 0)
    batch = build_train_batch([comp], torch.zeros(1), torch.zeros(1), pad_token_id=0)
    learner_lp = trainer.learners.call("compute_log_probs", batch)[0][0][batch.response_mask[0]]
    for engine in trainer.fleet.engines:
        engine_lp = torch.tensor(ray.get(engine.sequence_logprobs.remote(seq, len(prompt))))
        assert engine_lp.shape == learner_lp.shape
        assert torch.allclose(engine_lp, learner_lp.float(), atol=1e-4), (engine_lp, learner_lp)

    lines = [json.loads(l) for l in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [l for l in lines if l["step"] > 0]
    assert [l["step"] for l in steps] == [1, 2]
    for key in REQUIRED_KEYS:
        assert key in steps[-1], key
    assert steps[-1]["weight_version"] == 3
    assert lines[0]["step"] == 0 and "eval/accuracy" in lines[0]
    assert "eval/accuracy" in steps[-1]  # final eval
    assert math.isfinite(steps[-1]["loss/policy"])
    assert_png(trainer.run_dir / "curves.png", 1000, 700)  # figsize (10, 7) at 100 dpi
    from cluster.driver.checkpoint import latest_checkpoint

    ck = latest_checkpoint(trainer.run_dir)
    assert ck is not None and ck.name == "step_00000002"
    # every prompt of every step trained once
    uids = [u for step in trainer.trained_uids for u in step]
    assert len(uids) == len(set(uids)) == 16
    assert "eval/accuracy_final" in summary
    # where the run trained and sampled (cluster.runtime.devices): every rank and engine on the CPU, as configured
    from cluster.runtime.devices import DEVICES_FILE, device_problems

    report = json.loads((trainer.run_dir / DEVICES_FILE).read_text())
    assert len(report["learner"]) == 2 and len(report["engines"]) == 2
    assert device_problems(report, trainer.cfg) == [], report
