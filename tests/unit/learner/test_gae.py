"""PPO's critic math (learner/gae.py) against hand-computed values: terminal rewards, GAE, whitening, value loss."""

from __future__ import annotations

import math

import pytest
import torch

from learner.gae import gae, terminal_rewards, value_loss, whiten, whiten_stats, whiten_sums

T, F = True, False


def test_terminal_reward_sits_on_each_rows_last_response_token():
    mask = torch.tensor([[F, T, T, F], [T, F, F, F], [F, F, F, F]])
    out = terminal_rewards(torch.tensor([1.0, 0.5, float("nan")]), mask)
    assert out.tolist() == [[0, 0, 1, 0], [0.5, 0, 0, 0], [0, 0, 0, 0]]  # NaN row has no response token


def test_terminal_reward_refuses_a_nan_reward_on_a_row_with_tokens():
    with pytest.raises(ValueError, match="finite"):
        terminal_rewards(torch.tensor([float("nan")]), torch.tensor([[T, T]]))
    with pytest.raises(ValueError, match=r"\[B\]"):
        terminal_rewards(torch.tensor([1.0, 2.0]), torch.tensor([[T, T]]))


def test_gae_gamma_lambda_one_is_reward_minus_value():
    """gamma = lam = 1 (the default): A_t = r - V(t), R_t = r, on the response tokens only."""
    mask = torch.tensor([[F, T, T, T]])
    values = torch.tensor([[9.0, 0.2, 0.5, 0.9]], dtype=torch.float64)
    adv, ret = gae(terminal_rewards(torch.tensor([1.0], dtype=torch.float64), mask), values, mask, 1.0, 1.0)
    assert adv[0].tolist() == pytest.approx([0.0, 0.8, 0.5, 0.1], abs=1e-12)
    assert ret[0].tolist() == pytest.approx([0.0, 1.0, 1.0, 1.0], abs=1e-12)


def test_gae_discounted_by_hand():
    """gamma 0.9, lam 0.5, V = (0.5, 0.4, 0.2), reward 1 at the end:
    delta_2 = 1 - 0.2 = 0.8, A_2 = 0.8; delta_1 = 0.9*0.2 - 0.4 = -0.22, A_1 = -0.22 + 0.45*0.8 = 0.14;
    delta_0 = 0.9*0.4 - 0.5 = -0.14, A_0 = -0.14 + 0.45*0.14 = -0.077; R = A + V."""
    mask = torch.tensor([[T, T, T]])
    values = torch.tensor([[0.5, 0.4, 0.2]], dtype=torch.float64)
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    adv, ret = gae(rewards, values, mask, 0.9, 0.5)
    assert adv[0].tolist() == pytest.approx([-0.077, 0.14, 0.8], abs=1e-12)
    assert ret[0].tolist() == pytest.approx([0.423, 0.54, 1.0], abs=1e-12)


def test_gae_skips_positions_outside_the_mask():
    """A masked position in the middle (an observation token) is skipped: the next response token's value
    bootstraps. delta_0 = 0.9*0.2 - 0.5 = -0.32, A_0 = -0.32 + 0.45*0.8 = 0.04; its own value (7) is unused."""
    mask = torch.tensor([[T, F, T]])
    values = torch.tensor([[0.5, 7.0, 0.2]], dtype=torch.float64)
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    adv, ret = gae(rewards, values, mask, 0.9, 0.5)
    assert adv[0].tolist() == pytest.approx([0.04, 0.0, 0.8], abs=1e-12)
    assert ret[0].tolist() == pytest.approx([0.54, 0.0, 1.0], abs=1e-12)


def test_gae_empty_row_and_bad_arguments():
    adv, ret = gae(torch.zeros(1, 3), torch.ones(1, 3), torch.zeros(1, 3, dtype=torch.bool), 1.0, 1.0)
    assert adv.abs().sum() == 0 and ret.abs().sum() == 0
    with pytest.raises(ValueError, match="gamma"):
        gae(torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3, dtype=torch.bool), 1.5, 1.0)
    with pytest.raises(ValueError, match="lam"):
        gae(torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3, dtype=torch.bool), 1.0, -0.1)
    with pytest.raises(ValueError, match="same"):
        gae(torch.zeros(1, 3), torch.ones(1, 2), torch.ones(1, 3, dtype=torch.bool), 1.0, 1.0)


def test_whitening_uses_the_unbiased_variance_over_all_parts():
    """x = 1, 2, 3, 4 (and a masked 100): mean 2.5, unbiased var 5/3; the sums of two parts give the same."""
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[T, T, F], [T, T, F]])
    parts = [whiten_sums(x[:1], mask[:1]), whiten_sums(x[1:], mask[1:])]
    mean, var = whiten_stats(*[a + b for a, b in zip(*parts)])
    assert (mean, var) == pytest.approx((2.5, 5.0 / 3.0), abs=1e-12)
    out = whiten(x, mask, mean, var)
    s = math.sqrt(5.0 / 3.0 + 1e-8)
    assert out.reshape(-1).tolist() == pytest.approx([-1.5 / s, -0.5 / s, 0.0, 0.5 / s, 1.5 / s, 0.0], abs=1e-12)
    assert whiten_stats(0.0, 0.0, 0.0) == (0.0, 0.0)
    assert whiten_stats(3.0, 9.0, 1.0) == (3.0, 0.0)  # one element: whitened to 0


def test_value_loss_clipped_by_hand():
    """clip 0.2. Token 0: V 0.5, old 0, R 1: (V-R)^2 = 0.25, V_clip = 0.2, (0.2-1)^2 = 0.64 -> 0.64, clipped,
    no gradient. Token 1: V 1, old 0.9, R 0: V_clip = V, 1.0. loss = 0.5 (0.64 + 1) / 2 = 0.41;
    dloss/dV_1 = 0.5 * 2 (V - R) / 2 = 0.5."""
    v = torch.tensor([[0.5, 1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.0, 0.9]], dtype=torch.float64)
    ret = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    loss, m = value_loss(v, old, ret, torch.tensor([[T, T]]), clip=0.2)
    assert float(loss.detach()) == pytest.approx(0.41, abs=1e-12)
    loss.backward()
    assert v.grad[0].tolist() == pytest.approx([0.0, 0.5], abs=1e-12)
    assert m == {"num_tokens": 2.0, "num_clipped": 1.0, "sq_error_sum": pytest.approx(1.25), "value_sum": 1.5}


def test_value_loss_unclipped_term_wins_and_no_clip():
    """V 0, old 0.5, R 1, clip 0.2: (V-R)^2 = 1 > (0.3-1)^2 = 0.49 -> 1, gradient (V - R) = -1.
    clip None: 0.5 (V - R)^2 everywhere."""
    v = torch.tensor([[0.0]], dtype=torch.float64, requires_grad=True)
    old, ret, mask = torch.tensor([[0.5]], dtype=torch.float64), torch.tensor([[1.0]], dtype=torch.float64), torch.tensor([[T]])
    loss, m = value_loss(v, old, ret, mask, clip=0.2)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(0.5) and v.grad.item() == pytest.approx(-1.0) and m["num_clipped"] == 0.0
    v2 = torch.tensor([[0.5, 1.0]], dtype=torch.float64)
    loss2, _ = value_loss(v2, torch.zeros(1, 2, dtype=torch.float64), torch.tensor([[1.0, 0.0]], dtype=torch.float64),
                          torch.tensor([[T, T]]), clip=None)
    assert float(loss2) == pytest.approx(0.5 * (0.25 + 1.0) / 2)


def test_value_loss_parts_sum_to_the_whole_and_masked_nan_is_ignored():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(4, 5, generator=g, dtype=torch.float64)
    old, ret = torch.randn(4, 5, generator=g, dtype=torch.float64), torch.randn(4, 5, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 5, generator=g) > 0.3
    v_nan = torch.where(mask, v, float("nan"))
    whole, _ = value_loss(v_nan, old, ret, mask, clip=0.3)
    n = float(mask.sum())
    parts = sum(float(value_loss(v[i : i + 2], old[i : i + 2], ret[i : i + 2], mask[i : i + 2], 0.3, num_tokens=n)[0])
                for i in (0, 2))
    assert math.isfinite(float(whole)) and parts == pytest.approx(float(whole), abs=1e-12)
    with pytest.raises(ValueError, match="num_tokens"):
        value_loss(v, old, ret, mask, 0.3, num_tokens=1.0)
    with pytest.raises(ValueError, match="clip"):
        value_loss(v, old, ret, mask, 0.0)
    empty, m = value_loss(v, old, ret, torch.zeros_like(mask), 0.3)
    assert float(empty) == 0.0 and m["num_tokens"] == 0.0
