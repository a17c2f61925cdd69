"""``learner.old_logprob_source=auto`` end to end (real Ray, vLLM and DeepSpeed on the CPU): the shipped config
(configs/tiny_moe.yaml) with an engine made to disagree by a real mechanism, the engine in bfloat16
(``rollout.dtype=bfloat16``, ``precision`` unset) beside the float32 learner: its first check step measures
the gap above ``learner.max_rollout_logprob_gap``, trains on the recomputed log-probs, logs why once and
recomputes from then on, and the switch is in the checkpoint's ``trainer_state.json``. The same config in
float32 stays on the engine's log-probs: checked on its step 1 in tests/integration/test_distill.py (and on a
partial rollout's step in test_partial_rollouts.py), whose runs start anyway."""

from __future__ import annotations

import json
import logging

import pytest

from tests.helpers import REPO_ROOT

RUN = ["trainer.prompts_per_step=8", "trainer.group_size=4", "learner.micro_batch_size=8", "learner.num_minibatches=1",
       "warm_start.steps=0", "data.num_eval=8", "trainer.eval_every=0", "wandb.mode=disabled", "trainer.plots=false",
       "trainer.total_steps=2", "trainer.save_every=2", "learner.mismatch_monitor_every=1"]


@pytest.fixture(scope="module")
def ray_session():
    yield
    import ray

    ray.shutdown()


def _run(tmp_path, name: str, extra: list[str]) -> list[dict]:
    """Train ``RUN`` on the shipped config with ``extra``; its RL steps' metrics."""
    from cluster.config import load_config
    from cluster.driver.trainer import Trainer

    cfg = load_config(REPO_ROOT / "configs" / "tiny_moe.yaml",
                      [*RUN, f"trainer.output_dir={tmp_path}", f"trainer.run_name={name}", *extra])
    assert cfg.learner.old_logprob_source == "auto" and cfg.learner.dtype == "float32"  # the default, unset
    trainer = Trainer(cfg)
    trainer.start()
    try:
        trainer.run()
    finally:
        trainer.shutdown()
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()][1:]


# A whole run (about 40 s on 2 cores): in the matrix; make test keeps the learner-level switch on real DeepSpeed
# ranks (tests/integration/test_mismatch_monitor.py: a check step above the bound trains as recompute does).
@pytest.mark.matrix
def test_a_bf16_engine_switches_to_recompute_and_says_why(tmp_path, ray_session, caplog):
    caplog.set_level(logging.WARNING, logger="cluster.train")
    steps = _run(tmp_path, "bf16_engine", ["rollout.dtype=bfloat16"])
    bound = 1e-4
    first, second = steps
    # measured 1.6e-3 nats per token on an AVX2 EPYC (bf16 weights' rounding alone is of that order)
    assert first["actor/old_logprob_gap"] > bound and first["actor/old_logprob_gap_tokens"] > 0, first
    assert first["actor/old_logprob_recomputed"] == 1.0  # the check step trains on what it recomputed
    assert second["actor/old_logprob_recomputed"] == 1.0 and "actor/old_logprob_gap" not in second  # sticky
    assert second["actor/train_rollout_logprob_diff"] > bound  # the pass runs every step now
    lines = [r.getMessage() for r in caplog.records if "max_rollout_logprob_gap" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("step 1: engine/learner log-prob gap"), lines
    assert f"{first['actor/old_logprob_gap']:.3g}" in lines[0]
    saved = json.loads((tmp_path / "bf16_engine" / "checkpoints" / "step_00000002" / "trainer_state.json").read_text())
    assert saved["recompute_since"] == 1 and saved["recompute_gap"] == first["actor/old_logprob_gap"]

