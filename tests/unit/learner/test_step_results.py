"""The typed results of the learner's remote steps (``learner.contracts``): ``RolloutTrainResult`` built from the
RL step's metrics dict, and ``SFTStepResult``. The real steps that build them run in
tests/integration/test_learner_service.py and test_health_guard.py."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from learner.contracts import BY_LENGTH_KEY, RolloutTrainResult, SFTStepResult


def _step_metrics(**extra) -> dict:
    """A step's metrics dict in the order ``learner.step.RolloutBatchStep`` builds it (the guard's keys last)."""
    return {
        "actor/entropy": 0.7,
        "loss/policy": -0.125,
        "loss/policy_minibatches": [-0.25, 0.0],
        "actor/clip_fraction": 0.5,
        "actor/grad_norm": 3.0,
        "actor/num_optimizer_steps": 2.0,
        "actor/num_response_tokens": 40.0,
        BY_LENGTH_KEY: {3: [2.0, 2.5, 1.0, 2.0], 7: [1.0, 0.5, 0.0, 1.0]},
        "loss/kl": 0.0,
        **extra,
    }


def test_a_refused_step_reads_the_guard_keys_and_keeps_the_logged_record():
    raw = _step_metrics(**{"health/skipped": 1.0, "health/steps_undone": 2.0,
                           "health/failed_checks": "nonfinite_log_probs,max_grad_norm",
                           "health/reasons": "nonfinite_log_probs: 1 > 0; max_grad_norm: actor/grad_norm=3 > 1",
                           "health/nonfinite_log_probs": 1.0})
    raw["actor/num_optimizer_steps"] = 0.0  # the guard's verdict zeroes it
    before = dict(raw)
    r = RolloutTrainResult.from_metrics(raw)
    assert raw == before  # the step's dict is left as it was
    assert (r.loss, r.optimizer_steps, r.grad_norm) == (-0.125, 0, 3.0)
    assert isinstance(r.optimizer_steps, int) and r.skipped is True
    assert r.failed_checks == ("nonfinite_log_probs", "max_grad_norm")
    assert r.reasons.startswith("nonfinite_log_probs: 1 > 0; ")
    assert r.by_response_length == {3: [2.0, 2.5, 1.0, 2.0], 7: [1.0, 0.5, 0.0, 1.0]}
    # the logged record: every key but the per-length sums, values and order unchanged (metrics.jsonl)
    assert list(r.metrics) == [k for k in raw if k != BY_LENGTH_KEY]
    assert all(r.metrics[k] == raw[k] for k in r.metrics)
    assert r.metrics["health/failed_checks"] == "nonfinite_log_probs,max_grad_norm"  # still logged as a string
    # the audit's metrics.json: everything the learner returned
    assert r.record() == raw


def test_an_unguarded_step_has_no_verdict():
    r = RolloutTrainResult.from_metrics(_step_metrics())
    assert r.skipped is False and r.failed_checks == () and r.reasons == ""
    assert r.optimizer_steps == 2 and not any(k.startswith("health/") for k in r.metrics)


def test_a_passed_guard_is_not_skipped():
    r = RolloutTrainResult.from_metrics(_step_metrics(**{"health/skipped": 0.0, "health/failed_checks": "",
                                                         "health/reasons": ""}))
    assert r.skipped is False and r.failed_checks == () and r.metrics["health/skipped"] == 0.0


def test_a_step_without_per_length_sums_has_none():
    raw = _step_metrics()
    del raw[BY_LENGTH_KEY]
    r = RolloutTrainResult.from_metrics(raw)
    assert r.by_response_length == {} and r.record() == {**raw, BY_LENGTH_KEY: {}}


@pytest.mark.parametrize("key", ["loss/policy", "actor/num_optimizer_steps", "actor/grad_norm"])
def test_a_dict_without_a_typed_field_is_refused(key):
    raw = _step_metrics()
    del raw[key]
    with pytest.raises(KeyError, match=key):
        RolloutTrainResult.from_metrics(raw)


def test_results_are_frozen_and_cross_a_process_boundary_unchanged():
    r = RolloutTrainResult.from_metrics(_step_metrics(**{"health/skipped": 0.0}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.loss = 0.0
    assert pickle.loads(pickle.dumps(r)) == r  # Ray pickles the actor's answer
    s = SFTStepResult(loss=2.5, grad_norm=0.75, lr=1e-3, num_tokens=88)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.loss = 0.0
    assert pickle.loads(pickle.dumps(s)) == s
