"""On-policy distillation's per-token signal (``learner.distill``) against hand-computed values and edge cases:
masked positions, invalid samples (NaN reward, NaN teacher log-probs), per-token reward advantages, shapes."""

from __future__ import annotations

import math

import pytest
import torch

from learner.distill import distill_advantages, reverse_kl_stats, reverse_kl_tokens, usable_rows

NAN = float("nan")


def _t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def _close(got: torch.Tensor, want) -> None:
    torch.testing.assert_close(got, _t(want), rtol=0, atol=1e-6)


def test_reverse_kl_is_behaviour_minus_teacher_on_the_mask_only():
    old = _t([[-0.5, -1.0, -2.0], [-0.1, -0.2, -9.0]])
    teacher = _t([[-1.5, -1.0, -0.5], [-0.3, NAN, NAN]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    k = reverse_kl_tokens(old, teacher, mask)
    # by hand: -0.5 - -1.5 = 1.0; -1 - -1 = 0; -2 - -0.5 = -1.5; -0.1 - -0.3 = 0.2; masked -> 0 (NaN there ignored)
    _close(k, [[1.0, 0.0, -1.5], [0.2, 0.0, 0.0]])
    assert k.dtype == torch.float32


def test_advantage_is_reward_weight_times_a_minus_kl_coef_times_k():
    k = _t([[1.0, 0.0, -1.5], [0.2, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    valid = torch.tensor([True, True])
    reward_adv = _t([0.5, -2.0])
    adv = distill_advantages(reward_adv, k, mask, valid, kl_coef=2.0, reward_weight=0.5)
    # row 0: 0.5*0.5 - 2*[1, 0, -1.5] = [0.25-2, 0.25, 0.25+3]; row 1: 0.5*-2 - 2*[0.2, 0] = [-1.4, -1.0], pad 0
    _close(adv, [[-1.75, 0.25, 3.25], [-1.4, -1.0, 0.0]])
    alone = distill_advantages(reward_adv, k, mask, valid, kl_coef=1.0, reward_weight=0.0)
    _close(alone, [[-1.0, 0.0, 1.5], [-0.2, 0.0, 0.0]])  # -k, the reward only logged


def test_per_token_reward_advantages_are_taken_as_they_are():
    k = _t([[0.1, 0.2]])
    mask = torch.tensor([[True, True]])
    adv = distill_advantages(_t([[1.0, 3.0]]), k, mask, torch.tensor([True]), kl_coef=1.0, reward_weight=1.0)
    _close(adv, [[0.9, 2.8]])


def test_invalid_samples_and_failed_teacher_rows_get_zero():
    old = _t([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    teacher = _t([[-2.0, -2.0], [NAN, NAN], [-2.0, -3.0]])
    mask = torch.ones((3, 2), dtype=torch.bool)
    k = reverse_kl_tokens(old, teacher, mask)
    valid = torch.tensor([True, True, False])  # row 2: a NaN reward
    assert usable_rows(k, mask, valid).tolist() == [True, False, False]
    adv = distill_advantages(_t([1.0, NAN, NAN]), k, mask, valid, kl_coef=1.0, reward_weight=1.0)
    _close(adv, [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])  # row 0: 1 - 1 = 0
    assert torch.isfinite(adv).all()
    stats = reverse_kl_stats(k, mask, usable_rows(k, mask, valid))
    assert stats == {"distill/reverse_kl": pytest.approx(1.0), "distill/reverse_kl_seq": pytest.approx(2.0)}


def test_a_nan_teacher_value_off_the_mask_does_not_invalidate_a_sample():
    k = reverse_kl_tokens(_t([[-1.0, 0.0]]), _t([[-1.0, NAN]]), torch.tensor([[True, False]]))
    assert usable_rows(k, torch.tensor([[True, False]]), torch.tensor([True])).tolist() == [True]


def test_stats_are_nan_without_tokens_and_weighted_by_tokens():
    mask = torch.tensor([[True, True, True], [True, False, False]])
    k = _t([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    stats = reverse_kl_stats(k, mask, torch.tensor([True, True]))
    assert stats["distill/reverse_kl"] == pytest.approx(7.0 / 4)  # per token
    assert stats["distill/reverse_kl_seq"] == pytest.approx((3.0 + 4.0) / 2)  # per sample's sum
    empty = reverse_kl_stats(k, mask, torch.tensor([False, False]))
    assert all(math.isnan(v) for v in empty.values())


@pytest.mark.parametrize("kwargs, match", [
    ({"kl_coef": 0.0, "reward_weight": 0.0}, "kl_coef"),
    ({"kl_coef": float("inf"), "reward_weight": 0.0}, "kl_coef"),
    ({"kl_coef": 1.0, "reward_weight": -0.1}, "reward_weight"),
])
def test_bad_weights_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        distill_advantages(_t([0.0]), _t([[0.0]]), torch.tensor([[True]]), torch.tensor([True]), **kwargs)


def test_shapes_and_dtypes_are_checked():
    mask = torch.ones((2, 3), dtype=torch.bool)
    with pytest.raises(ValueError, match="teacher_logprobs"):
        reverse_kl_tokens(torch.zeros(2, 3), torch.zeros(2, 2), mask)
    with pytest.raises(ValueError, match="bool"):
        reverse_kl_tokens(torch.zeros(2, 3), torch.zeros(2, 3), mask.int())
    with pytest.raises(ValueError, match="reward_advantages"):
        distill_advantages(torch.zeros(3), torch.zeros(2, 3), mask, torch.ones(2, dtype=torch.bool), kl_coef=1.0,
                           reward_weight=1.0)
    with pytest.raises(ValueError, match="valid"):
        usable_rows(torch.zeros(2, 3), mask, torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="finite"):  # a NaN reward advantage on a sample that trains
        distill_advantages(_t([NAN, 0.0]), torch.zeros(2, 3), mask, torch.ones(2, dtype=torch.bool), kl_coef=1.0,
                           reward_weight=1.0)
