"""group_advantages against hand-computed values and a float64 evaluation of GSPO Eq. 6."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from learner.advantages import group_advantages

NAN = float("nan")


def _reference(rewards: list[float], group_size: int, normalize_std: bool = True, eps: float = 1e-6) -> list[float]:
    """Eq. 6 in plain Python floats: population std over the valid (non-NaN) rewards of each group."""
    out = []
    for g in range(0, len(rewards), group_size):
        group = rewards[g : g + group_size]
        valid = [r for r in group if not math.isnan(r)]
        degenerate = len(valid) <= 1 or max(valid) == min(valid)
        mean = statistics.fmean(valid) if valid else 0.0
        std = statistics.pstdev(valid) if len(valid) > 1 else 0.0
        for r in group:
            if math.isnan(r) or degenerate:
                out.append(0.0)
            else:
                out.append((r - mean) / (std + eps) if normalize_std else r - mean)
    return out


def test_hand_computed_binary_groups():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]), 4)
    # group 1: mean 0.5, population std 0.5 -> +-0.5 / (0.5 + 1e-6)
    a = 0.5 / (0.5 + 1e-6)
    # group 2: mean 0.25, std sqrt(0.1875); correct one 0.75 / std = sqrt(3), wrong ones -0.25 / std
    s = math.sqrt(0.1875)
    expected = [a, -a, -a, a, 0.75 / (s + 1e-6), -0.25 / (s + 1e-6), -0.25 / (s + 1e-6), -0.25 / (s + 1e-6)]
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-6, atol=1e-7)
    assert adv[4].item() == pytest.approx(math.sqrt(3), rel=1e-5)


def test_mean_only_dr_grpo():
    adv = group_advantages(torch.tensor([3.0, 1.0, 2.0, 0.0, 0.5, 1.0]), 3, normalize_std=False)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, -0.5, 0.0, 0.5]))


def test_matches_float64_formula_random():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(64, generator=g, dtype=torch.float64) * 3 - 1
    rewards[[3, 10, 11, 40]] = NAN
    for normalize_std in (True, False):
        adv = group_advantages(rewards, 8, normalize_std=normalize_std)
        expected = torch.tensor(_reference(rewards.tolist(), 8, normalize_std), dtype=torch.float64)
        assert adv.dtype == torch.float64
        torch.testing.assert_close(adv, expected, rtol=1e-12, atol=1e-12)


def test_population_std_is_used():
    # {0, 2}: population std 1 gives +-1; the sample std sqrt(2) would give +-1/sqrt(2).
    adv = group_advantages(torch.tensor([0.0, 2.0]), 2, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0]))


def test_all_equal_group_is_exactly_zero():
    # 0.1 * 3 / 3 != 0.1 in floating point: the result must still be exactly 0, not a rounding residue.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 1.0, 0.0, 1.0], dtype=torch.float64)
    for normalize_std in (True, False):
        adv = group_advantages(rewards, 3, normalize_std=normalize_std)
        assert adv[:6].tolist() == [0.0] * 6
        assert adv[6:].abs().min() > 0.1


def test_nan_rewards_are_invalid():
    adv = group_advantages(torch.tensor([1.0, NAN, 0.0, 0.0]), 4)
    # valid [1, 0, 0]: mean 1/3, population std sqrt(2)/3
    std = math.sqrt(2) / 3
    expected = [(2 / 3) / (std + 1e-6), 0.0, (-1 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6)]
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-6, atol=1e-7)
    assert adv[1].item() == 0.0


def test_group_with_at_most_one_valid_sample_is_zero():
    rewards = torch.tensor([NAN, NAN, 1.0, NAN, NAN, NAN, NAN, NAN, 5.0, 0.0, 1.0, 3.0])
    adv = group_advantages(rewards, 4)
    assert adv[:8].tolist() == [0.0] * 8
    assert torch.isfinite(adv).all()
    assert adv[8:].abs().min() > 0.1


def test_group_of_one():
    adv = group_advantages(torch.tensor([1.0, 0.0, NAN, 3.0]), 1)
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_eps_in_denominator():
    adv = group_advantages(torch.tensor([0.0, 2.0], dtype=torch.float64), 2, eps=1.0)
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5], dtype=torch.float64))


def test_errors_name_the_value():
    with pytest.raises(ValueError, match=r"N=5.*group_size=2"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="group_size=0"):
        group_advantages(torch.zeros(4), 0)
    with pytest.raises(ValueError, match="inf"):
        group_advantages(torch.tensor([1.0, float("inf")]), 2)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="float"):
        group_advantages(torch.zeros(4, dtype=torch.long), 2)
