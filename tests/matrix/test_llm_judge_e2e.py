"""A run with an LLM judge beside the exact verifier (``reward.judge`` on the embedded tiny model, weighted by 0.5):
two GSPO steps of configs/tiny_moe.yaml through the real trainer. Every rollout sample is judged once per step, the
judge's counters reach metrics.jsonl, its failures are NaN rewards counted in ``reward/invalid``, and the run
trains and checkpoints. Not in ``make test`` (a run plus a judge engine, about a minute on 2 cores):
``make test-matrix``.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import REPO_ROOT
from tests.helpers.judge import tiny_judge_config


@pytest.mark.timeout(1200)
def test_a_run_with_a_judge_trains_and_counts_its_verdicts(tmp_path, tiny_moe):
    from cluster.config import load_config
    from cluster.driver.trainer import Trainer

    cfg = load_config(REPO_ROOT / "configs" / "tiny_moe.yaml",
                      [f"trainer.output_dir={tmp_path}", "trainer.run_name=judge", "trainer.total_steps=2",
                       "trainer.eval_every=0", "trainer.plots=false", "warm_start.steps=0", "data.num_eval=8",
                       "wandb.mode=disabled"])
    cfg.reward.judge = tiny_judge_config(tiny_moe, template="{prompt}{response}:", num_cpus_per_engine=0.5)
    t = Trainer(cfg)
    try:
        t.start()
        t.run()
    finally:
        t.shutdown()
        import ray

        ray.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "judge" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 1 and "reward/judge_asked" in r]
    assert [r["step"] for r in steps] == [1, 2]
    samples = cfg.trainer.prompts_per_step * cfg.trainer.group_size
    for r in steps:
        assert r["reward/judge_asked"] == samples
        assert r["reward/judge_failed"] == r["reward/judge_unparsed"] + r["reward/judge_timeouts"]
        assert r["reward/invalid"] >= r["reward/judge_failed"]
        assert 0.0 <= r["reward/judge_mean"] <= 1.0
    assert (tmp_path / "judge" / "checkpoints").is_dir() and (tmp_path / "judge" / "summary.json").is_file()
