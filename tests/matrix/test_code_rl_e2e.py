"""Code RL end to end on the CPU with real components: configs/tiny_code.yaml (the procedural code task judged
by the code verifier with the solution in the sandbox), shortened to a few warm-start steps and one RL step.

Checks what the run writes: step 0's greedy accuracy with pass@1, pass@2 and mean@2 from 2 samples per held-out
prompt; step 1's metrics per response-length bucket (counts adding up to the step's completions, rollout and
learner keys); the length plot; the pass@k start/final keys of the summary.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import REPO_ROOT, assert_png
from tests.helpers.sandbox import sandbox_backend


@pytest.mark.timeout(1500)
def test_code_task_trains_through_the_sandbox(tmp_path):
    from cluster.config import load_config
    from cluster.driver.trainer import Trainer

    cfg = load_config(
        REPO_ROOT / "configs" / "tiny_code.yaml",
        [f"trainer.output_dir={tmp_path}", "trainer.run_name=code", "trainer.total_steps=1", "trainer.prompts_per_step=4",
         "trainer.eval_every=0", "trainer.eval_samples=2", "learner.micro_batch_size=8", "warm_start.steps=2",
         "warm_start.batch_size=8", "data.num_eval=8", "wandb.mode=disabled",
         f"reward.sandbox.backend={sandbox_backend()}"],
    )
    t = Trainer(cfg)
    try:
        t.start()
        summary = t.run()
    finally:
        t.shutdown()
        import ray

        ray.shutdown()
    assert all(r.verifier == "code" and r.meta["tests"] for r in t.eval_rows)
    rows = [json.loads(line) for line in (tmp_path / "code" / "metrics.jsonl").read_text().splitlines()]
    start, step1 = rows[0], rows[-1]
    assert start["step"] == 0 and step1["step"] == 1
    for key in ("eval/accuracy", "eval/pass@1", "eval/pass@2", "eval/mean@2"):
        assert 0.0 <= start[key] <= 1.0, key
    assert start["eval/pass@1"] == pytest.approx(start["eval/mean@2"])
    assert start["eval/pass@2"] >= start["eval/pass@1"]
    counts = {k: v for k, v in step1.items() if k.startswith("length/") and k.endswith("/count")}
    assert sorted(counts) == ["length/0-20/count", "length/21-40/count", "length/41-60/count", "length/61-80/count"]
    assert sum(counts.values()) == 4 * cfg.trainer.group_size
    filled = [k.rsplit("/", 1)[0] for k, v in counts.items() if v]
    for label in filled:
        for metric in ("accuracy", "clip_fraction", "seq_ratio_mean"):
            assert f"{label}/{metric}" in step1, (label, metric)
    assert "actor/by_response_length" not in step1  # the learner's raw sums are folded into the buckets
    assert_png(tmp_path / "code" / "length_slices.png", 1000, 700)
    assert {"eval/pass@2_start", "eval/pass@2_final", "eval/mean@2_start", "eval/mean@2_final"} <= set(summary)
