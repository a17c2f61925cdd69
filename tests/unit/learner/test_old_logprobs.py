"""``learner.old_logprob_source='auto'``: the decision rule (learner/old_logprobs.py) with hand values and edge
cases, the check steps (``LearnerConfig.gap_check_at``), and the driver's side (cluster/driver/behaviour.py):
the switch recorded once, carried by ``DriverState`` through ``trainer_state.json`` so a resumed run gets the
sources the uninterrupted one used."""

from __future__ import annotations

import json
import math

import pytest

from cluster.driver import behaviour
from cluster.driver.resume import DriverState
from learner.config import LearnerConfig
from learner.old_logprobs import CHECK, RECOMPUTE, ROLLOUT, gap_too_large, mean_gap, step_source, switch_message


def test_auto_is_the_default_with_its_bound():
    cfg = LearnerConfig()
    assert cfg.old_logprob_source == "auto" and cfg.max_rollout_logprob_gap == 1e-4
    with pytest.raises(ValueError, match="max_rollout_logprob_gap"):
        LearnerConfig(max_rollout_logprob_gap=0.0)


@pytest.mark.parametrize("configured,since,due,expected", [
    ("rollout", None, True, ROLLOUT), ("rollout", 3, True, ROLLOUT),  # the configured source, whatever else
    ("recompute", None, False, RECOMPUTE),
    ("auto", None, False, ROLLOUT), ("auto", None, True, CHECK),
    ("auto", 1, False, RECOMPUTE), ("auto", 1, True, RECOMPUTE),  # switched: no more checks, the pass every step
])
def test_step_source_table(configured, since, due, expected):
    assert step_source(configured, since, due) == expected


def test_step_source_refuses_an_unknown_name():
    with pytest.raises(ValueError, match="'engine'"):
        step_source("engine", None, True)


@pytest.mark.parametrize("gap,bound,too_large", [
    (3e-7, 1e-4, False),  # float32 on both sides, measured on the CPU
    (1e-4, 1e-4, False),  # equal is within
    (1.0001e-4, 1e-4, True),
    (0.033, 1e-4, True),  # a bf16 engine and learner (docs/results.md)
    (0.0, 1e-4, False),
    (math.nan, 1e-4, True),  # a non-finite log-prob: no evidence that they agree
    (math.inf, 1e-4, True),
])
def test_gap_against_the_bound(gap, bound, too_large):
    assert gap_too_large(gap, bound) is too_large


def test_mean_gap_by_hand_and_with_no_tokens():
    assert mean_gap(3.0e-6, 10.0) == pytest.approx(3.0e-7)
    assert mean_gap(0.0, 0.0) == 0.0  # nothing measured: no switch
    assert not gap_too_large(mean_gap(5.0, 0.0), 1e-4)


def test_check_steps_follow_the_monitor_and_need_a_pass():
    cfg = LearnerConfig(mismatch_monitor_every=10)
    assert [i for i in range(25) if cfg.gap_check_at(i)] == [0, 10, 20]  # RL steps 1, 11, 21
    assert [i for i in range(4) if LearnerConfig(mismatch_monitor_every=1).gap_check_at(i)] == [0, 1, 2, 3]
    assert not any(LearnerConfig(mismatch_monitor_every=0).gap_check_at(i) for i in range(5))
    lean = LearnerConfig(pre_update_pass="never", moe_diagnostics=False)
    assert not lean.gap_check_at(0)
    assert LearnerConfig(pre_update_pass="always").gap_check_at(0)  # the pass runs anyway: it checks
    assert not LearnerConfig(old_logprob_source="rollout").gap_check_at(0)


def test_switch_message_names_the_step_the_gap_and_the_bound():
    text = switch_message(11, 0.0331, 1e-4)
    assert "step 11" in text and "0.0331" in text and "max_rollout_logprob_gap=0.0001" in text
    assert "nan" in switch_message(1, math.nan, 1e-4)


def _run(cfg: LearnerConfig, state: DriverState, gaps: dict[int, float], steps: range) -> list[str]:
    """Drive ``steps`` as the trainer does, each check step's learner answering with ``gaps[step]`` (the
    learner's rule: recomputed when too large); returns the source per step."""
    out = []
    for step in steps:
        source = behaviour.source_for_step(cfg, state, step)
        out.append(source)
        recomputed = source == RECOMPUTE or (source == CHECK and gap_too_large(gaps[step], cfg.max_rollout_logprob_gap))
        metrics = {"actor/old_logprob_recomputed": float(recomputed)}
        if source == CHECK:
            metrics["actor/old_logprob_gap"] = gaps[step]
        behaviour.record_step(cfg, state, step, source, metrics)
    return out


def test_driver_switches_once_from_the_check_that_found_the_gap_and_resumes_there():
    cfg = LearnerConfig(mismatch_monitor_every=3)
    gaps = {1: 3e-7, 4: 2e-7, 7: 5e-3, 10: 1e-7}  # step 7's check is above; step 10's would be below again
    state = DriverState()
    whole = _run(cfg, state, gaps, range(1, 12))
    assert whole == ["check", "rollout", "rollout", "check", "rollout", "rollout", "check",
                     "recompute", "recompute", "recompute", "recompute"]  # sticky: no check after the switch
    assert (state.recompute_since, state.recompute_gap) == (7, 5e-3)
    # interrupted after step 8 and resumed from its trainer_state.json: the same sources after it
    first = DriverState()
    _run(cfg, first, gaps, range(1, 9))
    resumed = DriverState.from_json(json.loads(json.dumps(first.to_json())))
    assert resumed.recompute_since == 7
    assert _run(cfg, resumed, gaps, range(9, 12)) == whole[8:]


def test_record_step_logs_only_a_switch():
    cfg, state = LearnerConfig(), DriverState()
    assert behaviour.record_step(cfg, state, 1, CHECK, {"actor/old_logprob_recomputed": 0.0,
                                                        "actor/old_logprob_gap": 3e-7}) is None
    assert behaviour.record_step(cfg, state, 2, ROLLOUT, {"actor/old_logprob_recomputed": 0.0}) is None
    assert state.recompute_since is None
    line = behaviour.record_step(cfg, state, 11, CHECK, {"actor/old_logprob_recomputed": 1.0,
                                                         "actor/old_logprob_gap": 0.02})
    assert "step 11" in line and "0.02" in line and state.recompute_since == 11
    # a recompute step after it records nothing new
    assert behaviour.record_step(cfg, state, 12, RECOMPUTE, {"actor/old_logprob_recomputed": 1.0}) is None
    assert state.recompute_since == 11


def test_older_trainer_state_reads_as_not_switched():
    old = {"step": 5, "weight_version": 6, "warm_start_done": True, "stream_position": 160, "sft_rng": None}
    state = DriverState.from_json(old)
    assert state.recompute_since is None and state.recompute_gap is None


def test_warning_when_auto_can_never_check():
    assert behaviour.unchecked_warning(LearnerConfig()) is None
    assert behaviour.unchecked_warning(LearnerConfig(old_logprob_source="rollout", mismatch_monitor_every=0)) is None
    text = behaviour.unchecked_warning(LearnerConfig(mismatch_monitor_every=0))
    assert "unchecked" in text and "mismatch_monitor_every=0" in text
