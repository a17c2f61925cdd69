"""Objectives against hand-computed values and direct float64 evaluations of the papers' formulas.

The references below are written in plain Python floats (float64), one sequence and one token at a time,
straight from GSPO Eq. 5-7 / section 4.3 and the GRPO / DAPO token objectives; they share no code with
learner.objectives, learner.policy_metrics or learner.kl.
"""

from __future__ import annotations

import math

import pytest
import torch

from learner.kl import kl_penalty
from learner.objectives import (
    LOG_RATIO_CLAMP,
    Objective,
    loss_normalisers,
    policy_loss,
    resolve_objective,
    sequence_log_ratio,
)
from learner.policy_metrics import combine_policy_metrics

NAN, INF = float("nan"), float("inf")


METRIC_KEYS = ("clip_fraction", "clip_fraction_low", "clip_fraction_high", "ratio_mean", "ratio_min", "ratio_max",
               "log_ratio_abs_max")


def _clip(x, lo, hi):
    return min(max(x, lo), hi)


def ref_loss(log_ratios, adv, algorithm, clip_low, clip_high, loss_agg):
    """float64 reference. log_ratios: per sequence, the list of its response tokens' log pi - log pi_old.
    adv: per sequence a float, or a list of per-token floats."""
    lo, hi = 1 - clip_low, 1 + clip_high
    nonempty = [i for i, lr in enumerate(log_ratios) if lr]
    S, N = len(nonempty), sum(len(lr) for lr in log_ratios)
    token_adv = [a if isinstance(a, list) else [a] * len(lr) for a, lr in zip(adv, log_ratios)]
    if algorithm == "gspo":
        total = 0.0
        for i in nonempty:
            s = math.exp(sum(log_ratios[i]) / len(log_ratios[i]))  # Eq. 7
            total += min(s * adv[i], _clip(s, lo, hi) * adv[i])  # Eq. 5
        return -total / S
    per_token = []
    for i, lr in enumerate(log_ratios):
        row = []
        for t, x in enumerate(lr):
            r = math.exp(sum(lr) / len(lr)) if algorithm == "gspo_token" else math.exp(x)
            a = token_adv[i][t]
            row.append(min(r * a, _clip(r, lo, hi) * a))
        per_token.append(row)
    if loss_agg == "token_mean":
        return -sum(sum(r) for r in per_token) / N
    if loss_agg == "seq_mean_token_mean":
        return -sum(sum(r) / len(r) for r in per_token if r) / S
    return -sum(sum(r) for r in per_token) / S


def make_batch(log_ratios, T=None, dtype=torch.float32, pad=0.0, seed=0):
    """Right-padded [B, T] log_probs / old_log_probs / mask with the given per-token log-ratios."""
    g = torch.Generator().manual_seed(seed)
    B = len(log_ratios)
    T = T or max(1, max(len(lr) for lr in log_ratios))
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    lp = old.clone()
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, lr in enumerate(log_ratios):
        n = len(lr)
        lp[i, :n] = old[i, :n] + torch.tensor(lr, dtype=torch.float64)
        mask[i, :n] = True
    lp[~mask] = pad
    old[~mask] = pad
    return lp.to(dtype), old.to(dtype), mask


def random_log_ratios(B, max_len, scale, seed, min_len=1):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (B,), generator=g).tolist()
    return [(torch.randn(n, generator=g, dtype=torch.float64) * scale).tolist() for n in lengths]


def test_sequence_log_ratio_hand_values_different_lengths_and_empty():
    lp, old, mask = make_batch([[0.1, -0.3], [0.2, 0.2, 0.5], []], T=4)
    out = sequence_log_ratio(lp, old, mask)
    torch.testing.assert_close(out, torch.tensor([-0.1, 0.3, 0.0]), rtol=0, atol=1e-6)


def test_sequence_log_ratio_nan_inf_in_padding_never_reach_result_or_gradient():
    lp, old, mask = make_batch([[0.1, -0.3], [0.2, 0.2, 0.5], []], T=5)
    lp[0, 2], lp[0, 3], old[0, 4] = NAN, INF, -INF
    lp[2, :] = NAN
    old[1, 3:] = INF
    lp.requires_grad_(True)
    out = sequence_log_ratio(lp, old, mask.int())  # 0/1 mask accepted
    torch.testing.assert_close(out.detach(), torch.tensor([-0.1, 0.3, 0.0]), rtol=0, atol=1e-6)
    out.sum().backward()
    assert torch.isfinite(lp.grad).all()
    assert (lp.grad[~mask] == 0).all()
    torch.testing.assert_close(lp.grad[0, :2], torch.full((2,), 0.5))
    torch.testing.assert_close(lp.grad[1, :3], torch.full((3,), 1 / 3))


def test_9000_token_response_ratio_is_length_normalised():
    lp, old, mask = make_batch([[-0.002] * 9000, [0.001] * 10])
    lr = sequence_log_ratio(lp, old, mask)
    assert lr[0].item() == pytest.approx(-0.002, abs=1e-6)
    result = policy_loss(lp, old, torch.tensor([1.0, 0.0]), mask, resolve_objective("gspo"))
    loss, m = result.loss, result.metrics
    s = math.exp(-0.002)  # 0.998002, below 1 - 3e-4 but A > 0: the min keeps the unclipped term
    assert m["ratio_min"] == pytest.approx(s, abs=1e-6)
    assert m["ratio_min"] > 0.99  # a token product would be exp(-18) ~ 1.5e-8
    assert loss.item() == pytest.approx(-s / 2, abs=1e-6)
    assert m["clip_fraction"] == 0.0


@pytest.mark.parametrize("clips", [(None, None), (0.05, 0.08)])
def test_gspo_matches_float64_formula(clips):
    log_ratios = random_log_ratios(12, 9, scale=0.08, seed=1) + [[]]
    g = torch.Generator().manual_seed(2)
    adv = (torch.randn(13, generator=g, dtype=torch.float64)).tolist()
    objective = resolve_objective("gspo", *clips)
    clip_low, clip_high = objective.clip_low, objective.clip_high
    lp, old, mask = make_batch(log_ratios, dtype=torch.float64)
    result = policy_loss(lp, old, torch.tensor(adv, dtype=torch.float64), mask,
        resolve_objective("gspo", clip_low=clips[0], clip_high=clips[1]))
    loss, m = result.loss, result.metrics
    expected = ref_loss(log_ratios, adv, "gspo", clip_low, clip_high, "seq_mean_token_mean")
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-14)
    # clip statistics from the definition: sequence clipped when min picks a different, clipped term
    ratios = [math.exp(sum(lr) / len(lr)) for lr in log_ratios if lr]
    advs = [a for a, lr in zip(adv, log_ratios) if lr]
    high = sum(1 for s, a in zip(ratios, advs) if a > 0 and s > 1 + clip_high)
    low = sum(1 for s, a in zip(ratios, advs) if a < 0 and s < 1 - clip_low)
    assert 0 < high + low < 12  # the case exercises both branches
    assert m["num_sequences"] == 12 and m["num_ratios"] == 12
    assert m["clip_fraction_high"] == pytest.approx(high / 12)
    assert m["clip_fraction_low"] == pytest.approx(low / 12)
    assert m["clip_fraction"] == pytest.approx((high + low) / 12)
    assert m["ratio_mean"] == pytest.approx(sum(ratios) / 12, rel=1e-12)
    assert m["ratio_min"] == pytest.approx(min(ratios), rel=1e-12)
    assert m["ratio_max"] == pytest.approx(max(ratios), rel=1e-12)
    assert m["log_ratio_abs_max"] == pytest.approx(max(abs(math.log(s)) for s in ratios), rel=1e-9)
    assert all(isinstance(m[k], float) for k in METRIC_KEYS)


@pytest.mark.parametrize("side", ["high", "low"])
@pytest.mark.parametrize("adv_sign", [1.0, -1.0])
@pytest.mark.parametrize("outside", [False, True])
def test_gspo_just_inside_and_just_outside_clip_range(side, adv_sign, outside):
    clip_low, clip_high = 3e-4, 4e-4
    bound = 1 + clip_high if side == "high" else 1 - clip_low
    delta = 2e-5 if outside else -2e-5
    if side == "low":
        delta = -delta
    per_token = math.log(bound) + delta  # mean token log-ratio just inside / outside the range
    lp, old, mask = make_batch([[per_token] * 7])
    lp.requires_grad_(True)
    A = torch.tensor([adv_sign * 1.5])
    result = policy_loss(lp, old, A, mask, resolve_objective("gspo"))
    loss, m = result.loss, result.metrics
    loss.backward()
    s = math.exp(per_token)
    clipped = outside and ((side == "high" and adv_sign > 0) or (side == "low" and adv_sign < 0))
    expected = -(bound if clipped else s) * adv_sign * 1.5
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert m["clip_fraction"] == (1.0 if clipped else 0.0)
    assert m[f"clip_fraction_{side}"] == (1.0 if clipped else 0.0)
    if clipped:
        assert (lp.grad == 0).all()
    else:
        torch.testing.assert_close(lp.grad[0], torch.full((7,), -adv_sign * 1.5 * s / 7), rtol=1e-5, atol=0)


def test_gspo_gradient_identity():
    """d loss / d log pi(y_i,t) = -A_i s_i / (|y_i| B) when unclipped, 0 when clipped, 0 on padding."""
    log_ratios = [[0.01, -0.02, 0.005], [0.3, 0.1], [-0.2] * 5, [0.0004, 0.0001, -0.0002, 0.0], [0.05], [-0.4, 0.0]]
    adv = [0.7, 1.2, -0.5, 2.0, -1.0, 0.9]
    clip_low, clip_high = 0.1, 0.15
    lp, old, mask = make_batch(log_ratios, T=6, dtype=torch.float64)
    lp[~mask] = NAN
    lp.requires_grad_(True)
    result = policy_loss(lp, old, torch.tensor(adv, dtype=torch.float64), mask,
        resolve_objective("gspo", clip_low=clip_low, clip_high=clip_high))
    loss, m = result.loss, result.metrics
    loss.backward()
    B = len(log_ratios)
    n_clipped = 0
    for i, lr in enumerate(log_ratios):
        s = math.exp(sum(lr) / len(lr))
        clipped = (adv[i] > 0 and s > 1 + clip_high) or (adv[i] < 0 and s < 1 - clip_low)
        n_clipped += clipped
        want = 0.0 if clipped else -adv[i] * s / (len(lr) * B)
        torch.testing.assert_close(lp.grad[i, : len(lr)], torch.full((len(lr),), want, dtype=torch.float64),
                                   rtol=1e-12, atol=1e-15)
        assert (lp.grad[i, len(lr):] == 0).all()
    assert n_clipped == 2  # rows 1 (s = 1.22, A > 0) and 2 (s = 0.82, A < 0)
    assert m["clip_fraction"] == pytest.approx(2 / 6)


def test_gspo_token_equals_gspo_for_sequence_advantages():
    log_ratios = random_log_ratios(10, 12, scale=0.05, seed=3) + [[]]
    g = torch.Generator().manual_seed(4)
    adv = torch.randn(11, generator=g, dtype=torch.float64)
    results = {}
    for algorithm, a in (("gspo", adv), ("gspo_token", adv), ("gspo_token_2d", None)):
        lp, old, mask = make_batch(log_ratios, dtype=torch.float64, pad=NAN)
        lp.requires_grad_(True)
        if a is None:
            a = adv[:, None].expand_as(lp).clone()
            a[~mask] = NAN
        result = policy_loss(lp, old, a, mask,
            resolve_objective(algorithm.replace("_2d", ""), clip_low=0.01, clip_high=0.02))
        loss, m = result.loss, result.metrics
        loss.backward()
        results[algorithm] = (loss.detach(), lp.grad, m)
    ref_loss_, ref_grad, ref_m = results["gspo"]
    assert 0 < ref_m["clip_fraction"] < 1
    for name in ("gspo_token", "gspo_token_2d"):
        loss, grad, m = results[name]
        torch.testing.assert_close(loss, ref_loss_, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-15)
        for k in METRIC_KEYS:
            assert m[k] == pytest.approx(ref_m[k], rel=1e-12), k


def test_gspo_token_with_token_advantages_matches_formula():
    log_ratios = random_log_ratios(6, 8, scale=0.03, seed=5)
    g = torch.Generator().manual_seed(6)
    token_adv = [torch.randn(len(lr), generator=g, dtype=torch.float64).tolist() for lr in log_ratios]
    lp, old, mask = make_batch(log_ratios, dtype=torch.float64)
    A = torch.zeros(mask.shape, dtype=torch.float64)
    for i, a in enumerate(token_adv):
        A[i, : len(a)] = torch.tensor(a, dtype=torch.float64)
    lp.requires_grad_(True)
    result = policy_loss(lp, old, A, mask, resolve_objective("gspo_token", clip_low=0.005, clip_high=0.005))
    loss, m = result.loss, result.metrics
    expected = ref_loss(log_ratios, token_adv, "gspo_token", 0.005, 0.005, "seq_mean_token_mean")
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    # gradient of token t: -A_t s_i / (|y_i| B) when that token's term is unclipped
    loss.backward()
    for i, lr in enumerate(log_ratios):
        s = math.exp(sum(lr) / len(lr))
        for t, a in enumerate(token_adv[i]):
            clipped = (a > 0 and s > 1.005) or (a < 0 and s < 0.995)
            want = 0.0 if clipped else -a * s / (len(lr) * 6)
            assert lp.grad[i, t].item() == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert 0 < m["clip_fraction"] < 1


def test_identical_log_probs_clip_fraction_is_exactly_zero():
    g = torch.Generator().manual_seed(7)
    lp = -torch.rand(16, 40, generator=g) * 8
    mask = torch.rand(16, 40, generator=g) > 0.2
    adv = torch.randn(16, generator=g)
    for algorithm in ("gspo", "gspo_token", "grpo"):
        result = policy_loss(lp, lp.clone(), adv, mask, resolve_objective(algorithm))
        loss, m = result.loss, result.metrics
        assert m["clip_fraction"] == 0.0
        assert m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0 and m["log_ratio_abs_max"] == 0.0


@pytest.mark.parametrize("algorithm", ["gspo", "gspo_token", "grpo"])
def test_extreme_log_ratios_stay_finite(algorithm):
    log_ratios = [[100.0] * 3, [100.0] * 3, [-100.0] * 3, [-100.0] * 3]
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    lp, old, mask = make_batch(log_ratios)
    lp.requires_grad_(True)
    result = policy_loss(lp, old, adv, mask, resolve_objective(algorithm))
    loss, m = result.loss, result.metrics
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert all(math.isfinite(v) for v in m.values())
    assert m["log_ratio_abs_max"] == pytest.approx(100.0, rel=1e-5)
    objective = resolve_objective(algorithm)
    clip_low, clip_high = objective.clip_low, objective.clip_high
    big, small = math.exp(LOG_RATIO_CLAMP), math.exp(-LOG_RATIO_CLAMP)
    # +100 A>0: clipped high; +100 A<0: unclipped, s capped at exp(20); -100 A>0: unclipped ~0; -100 A<0: clipped
    per_seq = [(1 + clip_high) * 1.0, big * -1.0, small * 1.0, (1 - clip_low) * -1.0]
    assert loss.item() == pytest.approx(-sum(per_seq) / 4, rel=1e-5)
    assert m["ratio_max"] == pytest.approx(big, rel=1e-5)
    assert m["clip_fraction"] == 0.5
    assert (lp.grad == 0).all()  # clipped, or outside the clamp band (no gradient there)


def test_clamp_acts_on_sequence_mean_not_tokens():
    # tokens at +30 / -29.98 (outside the band) whose mean 0.01 is well inside: the ratio is exp(0.01); a
    # per-token clamp would give exp(0.005)
    lp, old, mask = make_batch([[30.0, -29.98, 0.0, 0.02]], dtype=torch.float64)
    result = policy_loss(lp, old, torch.tensor([1.0], dtype=torch.float64), mask,
        resolve_objective("gspo", clip_low=0.1, clip_high=0.1))
    loss, m = result.loss, result.metrics
    assert m["ratio_mean"] == pytest.approx(math.exp(0.01), rel=1e-12)
    assert loss.item() == pytest.approx(-math.exp(0.01), rel=1e-12)


@pytest.mark.parametrize("algorithm", ["gspo", "gspo_token", "grpo"])
def test_nan_inf_in_padding_policy_loss(algorithm):
    log_ratios = [[0.01, -0.02], [0.03, 0.0, 0.01, -0.05], []]
    adv = torch.tensor([1.0, -0.5, 2.0])
    clean = make_batch(log_ratios, T=6)
    lp, old, mask = make_batch(log_ratios, T=6)
    lp[0, 2:4] = torch.tensor([NAN, INF])
    lp[2, :] = -INF
    old[0, 4:] = torch.tensor([INF, NAN])
    old[1, 5] = NAN
    losses, grads = [], []
    for a, b, msk in (clean, (lp, old, mask)):
        a = a.clone().requires_grad_(True)
        result = policy_loss(a, b, adv, msk, resolve_objective(algorithm))
        loss, m = result.loss, result.metrics
        loss.backward()
        assert all(math.isfinite(v) for v in m.values())
        losses.append(loss.detach())
        grads.append(a.grad)
    assert torch.isfinite(losses[1])
    assert losses[0].item() == losses[1].item()
    assert torch.equal(grads[0], grads[1])
    assert (grads[1][~mask] == 0).all()


def test_empty_responses_are_not_counted():
    lp, old, mask = make_batch([[0.01, 0.02], [], [-0.01]], dtype=torch.float64)
    adv = torch.tensor([1.0, 5.0, -1.0], dtype=torch.float64)
    result = policy_loss(lp, old, adv, mask, resolve_objective("gspo", clip_low=0.1, clip_high=0.1))
    loss, m = result.loss, result.metrics
    expected = -(math.exp(0.015) * 1.0 + math.exp(-0.01) * -1.0) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert m["num_sequences"] == 2 and m["num_tokens"] == 3
    assert loss_normalisers(mask) == (2, 3)


@pytest.mark.parametrize("algorithm", ["gspo", "gspo_token", "grpo"])
def test_zero_valid_sequences_gives_zero_loss_and_clean_metrics(algorithm):
    lp = torch.full((3, 4), NAN, requires_grad=True)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    result = policy_loss(lp, lp.detach().clone(), torch.ones(3), mask,
        resolve_objective(algorithm), num_sequences=8, num_tokens=40)
    loss, m = result.loss, result.metrics
    loss.backward()
    assert loss.item() == 0.0 and (lp.grad == 0).all()
    assert all(math.isfinite(v) for v in m.values())
    assert m["num_ratios"] == 0 and m["clip_fraction"] == 0.0 and m["ratio_mean"] == 1.0


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_grpo_matches_float64_formula(loss_agg):
    log_ratios = random_log_ratios(9, 10, scale=0.25, seed=8) + [[]]
    g = torch.Generator().manual_seed(9)
    adv = torch.randn(10, generator=g, dtype=torch.float64).tolist()
    lp, old, mask = make_batch(log_ratios, dtype=torch.float64)
    result = policy_loss(lp, old, torch.tensor(adv, dtype=torch.float64), mask,
        resolve_objective("grpo", loss_agg=loss_agg))
    loss, m = result.loss, result.metrics
    expected = ref_loss(log_ratios, adv, "grpo", 0.2, 0.2, loss_agg)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    n_tok = sum(len(lr) for lr in log_ratios)
    clipped = sum(1 for lr, a in zip(log_ratios, adv) for x in lr
                  if (a > 0 and math.exp(x) > 1.2) or (a < 0 and math.exp(x) < 0.8))
    assert clipped > 0
    assert m["num_ratios"] == n_tok
    assert m["clip_fraction"] == pytest.approx(clipped / n_tok)


def test_grpo_default_is_token_mean():
    log_ratios = [[0.1], [0.05, -0.1, 0.2, 0.0, 0.02]]
    lp, old, mask = make_batch(log_ratios, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    result = policy_loss(lp, old, adv, mask, resolve_objective("grpo"))
    loss, _ = result.loss, result.metrics
    per_token = [math.exp(0.1)] + [-math.exp(x) for x in log_ratios[1]]
    assert loss.item() == pytest.approx(-sum(per_token) / 6, rel=1e-12)


def test_dapo_clip_higher():
    # token ratio 1.25 with A > 0: clipped by the symmetric 0.2 range, not by DAPO's 0.2 / 0.28
    # token ratio 0.75 with A < 0: clipped by both (the low side stays 0.2)
    log_ratios = [[math.log(1.25), math.log(0.75)]]
    lp, old, mask = make_batch(log_ratios, dtype=torch.float64)
    A = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    result = policy_loss(lp, old, A, mask, resolve_objective("grpo"))
    loss_sym, m_sym = result.loss, result.metrics
    result = policy_loss(lp, old, A, mask, resolve_objective("grpo", clip_low=0.2, clip_high=0.28))
    loss_dapo, m_dapo = result.loss, result.metrics
    assert loss_sym.item() == pytest.approx(-(1.2 - 0.8) / 2, rel=1e-12)
    assert loss_dapo.item() == pytest.approx(-(1.25 - 0.8) / 2, rel=1e-12)
    assert (m_sym["clip_fraction_high"], m_sym["clip_fraction_low"]) == (0.5, 0.5)
    assert (m_dapo["clip_fraction_high"], m_dapo["clip_fraction_low"]) == (0.0, 0.5)


@pytest.mark.parametrize(
    "algorithm,loss_agg",
    [("gspo", None), ("gspo_token", None), ("grpo", "token_mean"), ("grpo", "seq_mean_token_mean"),
     ("grpo", "seq_mean_token_sum")],
)
def test_four_micro_batches_equal_whole_minibatch(algorithm, loss_agg):
    log_ratios = random_log_ratios(16, 20, scale=0.2 if algorithm == "grpo" else 0.02, seed=10, min_len=0)
    log_ratios[4:8] = [[], [], [], []]  # one micro-batch with no response token at all
    g = torch.Generator().manual_seed(11)
    adv = torch.randn(16, generator=g)
    clips = dict(clip_low=0.003, clip_high=0.004) if algorithm != "grpo" else {}
    lp, old, mask = make_batch(log_ratios, pad=NAN)

    whole_lp = lp.clone().requires_grad_(True)
    objective = resolve_objective(algorithm, loss_agg=loss_agg, **clips)
    result = policy_loss(whole_lp, old, adv, mask, objective)
    whole, whole_m = result.loss, result.metrics
    whole.backward()

    parts_lp = lp.clone().requires_grad_(True)
    counts = [loss_normalisers(mask[i : i + 4]) for i in range(0, 16, 4)]
    num_sequences, num_tokens = sum(c[0] for c in counts), sum(c[1] for c in counts)
    total, metrics = 0.0, []
    for i in range(0, 16, 4):
        result = policy_loss(parts_lp[i : i + 4], old[i : i + 4], adv[i : i + 4], mask[i : i + 4], objective,
                             num_sequences=num_sequences, num_tokens=num_tokens)
        loss, m = result.loss, result.metrics
        loss.backward()
        total = total + loss.detach()
        metrics.append(m)
    assert abs(total.item() - whole.item()) <= 1e-6
    torch.testing.assert_close(parts_lp.grad, whole_lp.grad, rtol=0, atol=1e-6)
    assert whole_lp.grad.abs().max() > 1e-3  # not a vacuous comparison
    combined = combine_policy_metrics(metrics)
    assert metrics[1]["num_ratios"] == 0 and all(math.isfinite(v) for v in metrics[1].values())
    for k in METRIC_KEYS + ("num_sequences", "num_tokens", "num_clipped"):
        assert combined[k] == pytest.approx(whole_m[k], rel=1e-6), k
    assert 0 < whole_m["clip_fraction"] < 1


@pytest.mark.parametrize("algorithm", ["gspo", "gspo_token"])
@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_sum"])
def test_gspo_refuses_length_weighted_aggregation(algorithm, loss_agg):
    lp, old, mask = make_batch([[0.0, 0.1]])
    with pytest.raises(ValueError, match=f"loss_agg='{loss_agg}'.*{algorithm}"):
        policy_loss(lp, old, torch.ones(1), mask, resolve_objective(algorithm, loss_agg=loss_agg))


def test_defaults_per_algorithm():
    assert resolve_objective("gspo") == Objective("gspo", 3e-4, 4e-4, "seq_mean_token_mean")
    assert resolve_objective("gspo_token") == Objective("gspo_token", 3e-4, 4e-4, "seq_mean_token_mean")
    assert resolve_objective("grpo") == Objective("grpo", 0.2, 0.2, "token_mean")
    dapo = resolve_objective("grpo", 0.2, 0.28, "seq_mean_token_mean")
    assert dapo == Objective("grpo", 0.2, 0.28, "seq_mean_token_mean")
    assert (dapo.low, dapo.high, dapo.sequence_level) == (0.8, 1.28, False)


def test_bad_inputs_raise_clear_errors():
    lp, old, mask = make_batch([[0.0, 0.1], [0.2]])
    adv = torch.ones(2)
    with pytest.raises(ValueError, match="algorithm='reinforce'"):
        policy_loss(lp, old, adv, mask, resolve_objective("reinforce"))
    with pytest.raises(ValueError, match="loss_agg='sum'"):
        policy_loss(lp, old, adv, mask, resolve_objective("grpo", loss_agg="sum"))
    with pytest.raises(ValueError, match="clip_low=-0.1"):
        policy_loss(lp, old, adv, mask, resolve_objective("grpo", clip_low=-0.1))
    with pytest.raises(ValueError, match="old_log_probs shape"):
        policy_loss(lp, old[:, :1], adv, mask, resolve_objective("gspo"))
    with pytest.raises(ValueError, match="one advantage per sequence"):
        policy_loss(lp, old, torch.ones(2, 2), mask, resolve_objective("gspo"))
    with pytest.raises(ValueError, match="advantages shape"):
        policy_loss(lp, old, torch.ones(3), mask, resolve_objective("grpo"))
    with pytest.raises(ValueError, match="num_sequences=1"):
        policy_loss(lp, old, adv, mask, resolve_objective("gspo"), num_sequences=1)
    with pytest.raises(ValueError, match="num_tokens=2"):
        policy_loss(lp, old, adv, mask, resolve_objective("grpo"), num_tokens=2)
    with pytest.raises(ValueError, match="estimator='k4'"):
        kl_penalty(lp, old, mask, "k4")


def test_kl_estimators_hand_values():
    # one token with pi = 0.5, pi_ref = 0.25: log r = log(pi_ref / pi) = -log 2
    lp = torch.tensor([[math.log(0.5)]], dtype=torch.float64)
    ref = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    l2 = math.log(2)
    assert kl_penalty(lp, ref, mask, "k1").item() == pytest.approx(l2, rel=1e-12)
    assert kl_penalty(lp, ref, mask, "k2").item() == pytest.approx(0.5 * l2 ** 2, rel=1e-12)
    assert kl_penalty(lp, ref, mask, "k3").item() == pytest.approx(0.5 - 1 + l2, rel=1e-12)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_kl_aggregation_padding_and_micro_batches(estimator, loss_agg):
    diffs = [[0.1, -0.2, 0.3], [0.5], [], [-0.05, 0.0]]  # log pi - log pi_ref per token
    f = {"k1": lambda d: d, "k2": lambda d: 0.5 * d * d, "k3": lambda d: math.exp(-d) - 1 + d}[estimator]
    vals = [[f(d) for d in row] for row in diffs]
    if loss_agg == "token_mean":
        expected = sum(map(sum, vals)) / 6
    elif loss_agg == "seq_mean_token_mean":
        expected = sum(sum(v) / len(v) for v in vals if v) / 3
    else:
        expected = sum(map(sum, vals)) / 3
    lp, ref, mask = make_batch(diffs, T=4, dtype=torch.float64, pad=NAN)
    ref[0, 3] = INF
    out = kl_penalty(lp, ref, mask, estimator, loss_agg=loss_agg)
    assert out.item() == pytest.approx(expected, rel=1e-12)
    halves = [kl_penalty(lp[i : i + 2], ref[i : i + 2], mask[i : i + 2], estimator, loss_agg=loss_agg,
                         num_sequences=3, num_tokens=6) for i in (0, 2)]
    assert (halves[0] + halves[1]).item() == pytest.approx(expected, rel=1e-12)


def test_kl_k3_zero_for_identical_and_nonnegative():
    g = torch.Generator().manual_seed(12)
    lp = -torch.rand(4, 6, generator=g, dtype=torch.float64)
    mask = torch.ones(4, 6, dtype=torch.bool)
    assert kl_penalty(lp, lp.clone(), mask, "k3").item() == 0.0
    ref = lp + torch.randn(4, 6, generator=g, dtype=torch.float64)
    lp_g = lp.clone().requires_grad_(True)
    out = kl_penalty(lp_g, ref, mask, "k3", loss_agg="token_mean")
    out.backward()
    assert out.item() > 0
    # d k3 / d log pi = 1 - pi_ref / pi
    torch.testing.assert_close(lp_g.grad, (1 - torch.exp(ref - lp)) / 24, rtol=1e-12, atol=1e-15)
