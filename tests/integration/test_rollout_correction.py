"""Mismatch corrections beside GSPO (learner/rollout_correction.py), by hand."""

from __future__ import annotations

import pytest

from learner.config import LearnerConfig


def test_learner_step_logs_mismatch_and_drops_sequences(model_path):
    """On the learner: mismatch metrics with the correction off; a seq_geo_rs band that excludes every sequence
    (make_batch's rollout log-probs are the model's own + noise 0.05) drops them all, so the policy loss is 0."""
    from tests.helpers.learner import make_batch
    from tests.helpers.moe import _rank, _train

    batch = make_batch(model_path, 4, seed=51, noise=0.05)
    off = _train(_rank(model_path, LearnerConfig(algorithm="gspo", zero_stage=2, micro_batch_size=2,
                                                 num_minibatches=1)), [batch])
    assert off.metrics["mismatch/log_ratio_abs_max"] > 0.01 and off.metrics["mismatch/masked_seq_share"] == 0.0
    cfg = LearnerConfig(algorithm="gspo", zero_stage=2, micro_batch_size=2, num_minibatches=1,
                        rollout_correction="seq_geo_rs", rollout_correction_low=1.0, rollout_correction_high=1.0)
    on = _train(_rank(model_path, cfg), [batch])
    assert on.metrics["mismatch/masked_seq_share"] == 1.0 and on.loss == 0.0
    assert on.metrics["mismatch/log_ratio_mean"] == pytest.approx(off.metrics["mismatch/log_ratio_mean"])
