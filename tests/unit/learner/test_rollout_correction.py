"""Mismatch corrections beside GSPO (learner/rollout_correction.py), by hand."""

from __future__ import annotations

import math

import pytest
import torch

from learner.config import LearnerConfig
from learner.objectives import policy_loss, resolve_objective
from learner.rollout_correction import mismatch_metrics, mismatch_sums, rollout_correction

# two sequences, 3 positions; row 1 has 2 response tokens. d = train - engine
TRAIN = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])


ENGINE = torch.tensor([[-1.0, -2.0 - math.log(3.0), -0.5 + math.log(4.0)], [-1.2, -0.9, 0.0]])


MASK = torch.tensor([[True, True, True], [True, True, False]])


def test_token_tis_weights_are_capped_ratios():
    w, kept, dropped = rollout_correction(TRAIN, ENGINE, MASK, "token_tis", 0.5, 2.0)
    assert torch.equal(kept, MASK) and not dropped.any()
    expected = torch.tensor([[1.0, 2.0, 0.25], [math.exp(0.2), math.exp(-0.1), 1.0]])
    assert torch.allclose(w[MASK], expected[MASK], atol=1e-6)


def test_token_and_sequence_masks_by_hand():
    _, kept, dropped = rollout_correction(TRAIN, ENGINE, MASK, "token_mis", 0.5, 2.0)
    assert dropped.tolist() == [[False, True, True], [False, False, False]]
    assert torch.equal(kept, MASK & ~dropped)
    # seq_mis: row 0 product exp(ln3 - ln4) = 0.75, row 1 exp(0.1) -> band [0.8, 2] drops row 0 only
    _, kept, dropped = rollout_correction(TRAIN, ENGINE, MASK, "seq_mis", 0.8, 2.0)
    assert dropped[0].all() and not dropped[1].any() and not kept[0].any()
    # seq_geo_rs: row 0 exp((ln3 - ln4)/3) = 0.9086, row 1 exp(0.05) = 1.0513 -> band [0.95, 1.05] drops both
    _, kept, dropped = rollout_correction(TRAIN, ENGINE, MASK, "seq_geo_rs", 0.95, 1.05)
    assert torch.equal(dropped, MASK) and not kept.any()
    _, kept, dropped = rollout_correction(TRAIN, ENGINE, MASK, "seq_geo_rs", 0.9, 1.06)
    assert not dropped.any()


def test_mismatch_metrics_by_hand():
    _, _, dropped = rollout_correction(TRAIN, ENGINE, MASK, "token_mis", 0.5, 2.0)
    s = mismatch_sums(TRAIN, ENGINE, MASK, dropped)
    m = mismatch_metrics(s[:2] + [0.0, 0.0] + s[4:], s[2:4])
    assert m["mismatch/log_ratio_mean"] == pytest.approx((math.log(3) - math.log(4) + 0.1) / 5, abs=1e-6)
    assert m["mismatch/log_ratio_abs_max"] == pytest.approx(math.log(4), abs=1e-6)
    assert m["mismatch/seq_log_ratio_abs_max"] == pytest.approx((math.log(4) - math.log(3)) / 3, abs=1e-6)
    assert m["mismatch/masked_token_share"] == pytest.approx(2 / 5)
    assert m["mismatch/masked_seq_share"] == pytest.approx(1 / 2)


def test_token_weights_multiply_grpo_surrogates_and_are_refused_for_gspo():
    lp = torch.zeros(1, 2, requires_grad=True)
    old = torch.zeros(1, 2)
    adv = torch.tensor([1.0])
    mask = torch.ones(1, 2, dtype=torch.bool)
    w = torch.tensor([[2.0, 0.5]])
    result = policy_loss(lp, old, adv, mask, resolve_objective("grpo", loss_agg="token_mean"), token_weights=w)
    loss, _ = result.loss, result.metrics
    loss.backward()
    # ratio 1, inside the clip: loss = -(2 + 0.5)/2, d loss / d lp_t = -w_t / 2
    assert float(loss.detach()) == pytest.approx(-1.25)
    assert lp.grad.tolist() == [[-1.0, -0.25]]
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss(lp, old, adv, mask, resolve_objective("gspo"), token_weights=w)


def test_config_refuses_token_corrections_with_gspo():
    with pytest.raises(ValueError, match="learner.rollout_correction='token_tis' with learner.algorithm='gspo'"):
        LearnerConfig(algorithm="gspo", rollout_correction="token_tis")
    with pytest.raises(ValueError, match="empty band"):
        LearnerConfig(rollout_correction="seq_mis", rollout_correction_low=2.0, rollout_correction_high=1.0)
    assert LearnerConfig(algorithm="gspo", rollout_correction="seq_geo_rs").pre_update_pass_needs(None, is_moe=False) == [
        "learner.rollout_correction='seq_geo_rs'"]
