"""Health guard, learner side: ``train_rollout_batch(..., guard=...)`` skips a bad step's update exactly.

Faults are injected for real: a NaN / inf behaviour log-prob on a response token, a huge advantage that blows
up the gradient norm (or overflows it to inf), a clip-fraction limit the step breaks. After a refused step the
weights (``state_digest``) and every rank's optimizer state (``optimizer_state_digest``) are bit-identical to
before, and training afterwards is bit-identical to a run that never saw the bad step.
"""

from __future__ import annotations

import pytest

from learner.health import GUARD_CHECKS, failed_checks, validate_guard


def test_validate_guard():
    assert validate_guard(None) is None
    assert validate_guard({}) == {}
    assert validate_guard({"max_grad_norm": 5}) == {"max_grad_norm": 5.0}
    assert set(GUARD_CHECKS) == {"max_grad_norm", "max_clip_fraction", "max_logprob_diff", "min_entropy",
                                 "max_load_imbalance"}
    with pytest.raises(ValueError, match="'max_gradnorm' is unknown"):
        validate_guard({"max_gradnorm": 1.0})
    with pytest.raises(ValueError, match="max_clip_fraction"):
        validate_guard({"max_clip_fraction": -0.1})
    with pytest.raises(ValueError, match="min_entropy"):
        validate_guard({"min_entropy": float("nan")})
    with pytest.raises(ValueError, match="must be a number"):
        validate_guard({"max_grad_norm": "big"})


def test_failed_checks_by_phase_and_nan():
    guard = {"max_grad_norm": 10.0, "min_entropy": 0.5, "max_load_imbalance": 2.0}
    metrics = {"actor/grad_norm_max": 11.0, "actor/entropy": float("nan"), "actor/clip_fraction": 0.9}
    pre = failed_checks(guard, metrics, "pre")
    assert [n for n, _ in pre] == ["min_entropy"]  # NaN never passes; no MoE metric: not evaluated
    assert "actor/entropy=nan < 0.5" in pre[0][1]
    assert failed_checks(guard, metrics, "post") == [("max_grad_norm", "actor/grad_norm_max=11 > 10")]
    assert failed_checks(guard, {"actor/grad_norm_max": 10.0, "actor/entropy": 0.5}, "post") == []
    assert failed_checks(guard, {"actor/grad_norm_max": 10.0, "actor/entropy": 0.5}, "pre") == []
