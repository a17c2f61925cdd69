"""On-policy distillation beside the reward, for three steps of configs/tiny_moe.yaml through the trainer in its
overlapped layout (the next step's rollout, and its teacher call, beside the learner), and a teacher that times
out: its samples get NaN rewards counted in ``distill/failed``, its engine is replaced and the new one answers.
Not in ``make test`` (a run plus a teacher engine and a replacement, about two minutes on 2 cores):
``make test-matrix``. The short real check is tests/integration/test_distill.py.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers.distill import distill_config


@pytest.mark.timeout(1800)
def test_distillation_beside_the_reward_and_a_teacher_that_times_out(tmp_path):
    import ray

    from cluster.driver.trainer import Trainer
    from cluster.runtime.model_fleet import CallFailure

    cfg = distill_config(tmp_path, "trainer.total_steps=3", "warm_start.steps=20", "distill.reward_weight=0.5")
    t = Trainer(cfg, verbose=False)
    try:
        t.start()
        t.run()
        rows = [json.loads(line) for line in (tmp_path / "distill" / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if r["step"] >= 1]
        assert [r["step"] for r in steps] == [1, 2, 3]
        assert max(r["rollout/staleness_max"] for r in steps) == 1.0  # the overlapped rollouts were annotated too
        for r in steps:
            assert r["distill/failed"] == 0.0 and r["distill/reverse_kl"] > 0.0 and r["distill/teacher_s"] > 0.0
            assert r["distill/reverse_kl_seq"] >= r["distill/reverse_kl"] and not r["health/skipped"]

        fleet = t.distiller.teacher
        c = t.collector.collect(3)
        settings = fleet.settings
        fleet.settings = settings.model_copy(update={"timeout_s": 1e-3})
        try:
            t.distiller.annotate(c)
        finally:
            fleet.settings = settings
        answered = [x for x in c.completions if x.response_token_ids]
        assert c.teacher_logprobs.count(None) == len(answered) and fleet.replaced == 1
        assert c.reward_metrics["distill/failed"] == len(answered)
        assert all(math.isnan(r.score) and r.status == "timeout" for r, x in zip(c.results, c.completions)
                   if x.response_token_ids)
        got = fleet.logprobs(c.completions)  # the replacement answers
        assert not any(isinstance(g, CallFailure) for g in got)
        assert [len(g) for g in got] == [len(x.response_token_ids) for x in c.completions]
    finally:
        t.shutdown()
        ray.shutdown()
