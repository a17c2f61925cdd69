"""The equal-budget comparison (cluster/compare/runs.py): settings per algorithm, the report's figures on hand-made
histories, and (slow) two real 2-step runs that share one warm start and end in a report and a plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.compare import runs as compare
from tests.helpers import assert_png
from tests.helpers.compare import CONFIG


def test_two_algorithms_one_seed_report(tmp_path):
    rc = compare.main([
        CONFIG, "--algorithms", "gspo,grpo", "--seeds", "1", "--name", "t", "--output-dir", str(tmp_path),
        "trainer.total_steps=2", "trainer.prompts_per_step=4", "trainer.group_size=4", "trainer.eval_every=1",
        "trainer.save_every=0", "trainer.plots=false", "learner.world_size=1", "learner.num_minibatches=2",
        "learner.micro_batch_size=4", "warm_start.steps=2", "warm_start.batch_size=8", "data.num_eval=8",
        "wandb.mode=disabled",
        # a format term (a digit anywhere) so that rewards differ within groups after a 2-step warm start
        "reward.extra_terms=[{verifier: format, weight: 1.0}]", 'reward.format_regex="[0-9]"',
    ])
    out = tmp_path / "t"
    assert rc == 0, (out / "report.md").read_text() if (out / "report.md").exists() else rc
    text = (out / "report.md").read_text()
    assert any(line.startswith("| gspo | ") and "| 1 |" in line for line in text.splitlines()), text
    assert any(line.startswith("| grpo | ") and "| 1 |" in line for line in text.splitlines()), text
    assert_png(out / "curves.png", 1100, 750)  # figsize (11, 7.5) at 100 dpi
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [(r["algorithm"], r["status"]) for r in runs] == [("gspo", "ok"), ("grpo", "ok")]
    assert all(r["figures"]["steps"] == 2 for r in runs)
    # Same warm start: the step-0 held-out accuracy (greedy, same weights) is identical across algorithms, and
    # the second run resumed from the first run's warm-start checkpoint.
    assert runs[0]["figures"]["start_accuracy"] == runs[1]["figures"]["start_accuracy"]
    assert runs[0]["warm_start"] and not runs[1]["warm_start"]
    assert (out / "warm_start" / "seed0" / "checkpoints" / "step_00000000" / "COMPLETE").is_file()
    # the objectives really differed: GSPO clips sequences in a 3e-4 band, GRPO tokens in 0.2
    metrics = [[json.loads(l) for l in (Path(r["run_dir"]) / "metrics.jsonl").read_text().splitlines()] for r in runs]
    assert all(m[-1]["step"] == 2 for m in metrics)
    # Step 1's rollouts come from the same weights with the same seeds: same prompts, same rewards.
    step1 = [next(r for r in m if r["step"] == 1) for m in metrics]
    assert step1[0]["reward/mean"] == step1[1]["reward/mean"]
    assert step1[0]["response/length_mean"] == step1[1]["response/length_mean"]
    assert "gspo" in runs[0]["settings"] and "grpo, clip_low=0.2, clip_high=0.27" in runs[1]["settings"]
