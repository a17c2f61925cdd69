"""The registry's new losses (CISPO, SAPO, GMPO, Dr. GRPO) against hand-computed values and gradients, their
edge cases, and the registry itself (one signature, typed settings, a user's own loss).

The expected numbers are worked out by hand from each paper's formula (written next to each case) and
evaluated with plain Python floats; they share no code with ``learner.policy_losses``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import pytest
import torch

from learner.loss_registry import LossInputs, LossTerms, RatioUnits, get_policy_loss, register_policy_loss
from learner.loss_settings import BUILTIN_LOSSES, build_settings
from learner.objective_names import ALGORITHMS
from learner.objectives import loss_normalisers, policy_loss, resolve_objective
from learner.policy_metrics import combine_policy_metrics

NEW = ("cispo", "sapo", "gmpo", "dr_grpo")
OPTIONS = {"dr_grpo": {"norm_length": 4}}


def batch(log_probs, log_ratios):
    """``lp``, ``old`` (``lp - log ratio``) and the mask from ragged per-sequence lists, float64."""
    t = max(len(r) for r in log_probs)
    lp = torch.zeros(len(log_probs), t, dtype=torch.float64)
    old = torch.zeros_like(lp)
    mask = torch.zeros(len(log_probs), t, dtype=torch.bool)
    for i, (row, ratios) in enumerate(zip(log_probs, log_ratios)):
        for j, (p, r) in enumerate(zip(row, ratios)):
            lp[i, j], old[i, j], mask[i, j] = p, p - r, True
    return lp.requires_grad_(True), old, mask


def run(algorithm, lp, old, adv, mask, **kw):
    opts = kw.pop("options", OPTIONS.get(algorithm))
    result = policy_loss(lp, old, adv, mask, resolve_objective(algorithm, options=opts, **kw))
    (grad,) = torch.autograd.grad(result.loss, lp)
    return float(result.loss.detach()), grad, result.metrics


def sigmoid(z):
    return 1.0 / (1.0 + math.exp(-z))


# ------------------------------------------------------------------------------------------ hand values


def test_cispo_hand_values_and_gradient():
    # seq 0: ratios 2 and 0.5, A = +1; seq 1: ratio 7 (weight capped at 1 + 4 = 5), A = -2. No lower bound.
    lp, old, mask = batch([[-1.0, -2.0], [-0.5]], [[math.log(2), math.log(0.5)], [math.log(7)]])
    loss, grad, m = run("cispo", lp, old, torch.tensor([1.0, -2.0], dtype=torch.float64), mask)
    # loss = -(1/N) sum sg[w] A log pi, N = 3: -(2*1*-1 + 0.5*1*-2 + 5*-2*-0.5) / 3 = -2/3
    assert loss == pytest.approx(-2 / 3, rel=1e-12)
    # d/d log pi = -w A / N: no token's gradient is zero, the capped one keeps 5 instead of 7
    assert grad[0].tolist() == pytest.approx([-2 / 3, -0.5 / 3], rel=1e-12)
    assert grad[1, 0].item() == pytest.approx(10 / 3, rel=1e-12)
    assert (m["clip_fraction"], m["clip_fraction_high"], m["clip_fraction_low"]) == pytest.approx((1 / 3, 1 / 3, 0))
    # with a lower bound 1 - 0.2: the 0.5 weight becomes 0.8 and counts as clipped low
    loss, grad, m = run("cispo", lp, old, torch.tensor([1.0, -2.0], dtype=torch.float64), mask, clip_low=0.2)
    assert loss == pytest.approx(-(-2 - 1.6 + 5) / 3, rel=1e-12)
    assert grad[0, 1].item() == pytest.approx(-0.8 / 3, rel=1e-12)
    assert m["clip_fraction_low"] == pytest.approx(1 / 3)


def test_sapo_hand_values_and_gradient():
    # seq 0: ratios 1 and e, A = +1 (tau_pos = 1); seq 1: ratio 1/2, A = -1 (tau_neg = 1.05).
    lp, old, mask = batch([[-1.0, -1.0], [-1.0]], [[0.0, 1.0], [math.log(0.5)]])
    loss, grad, m = run("sapo", lp, old, torch.tensor([1.0, -1.0], dtype=torch.float64), mask)
    e, tn = math.e, 1.05
    f = lambda r, tau: sigmoid(tau * (r - 1)) * 4 / tau  # noqa: E731  the gate
    # seq-mean of token means: -( (f(1,1) + f(e,1)) / 2 * 1 + f(0.5,1.05) * -1 ) / 2
    want = -((f(1, 1) + f(e, 1)) / 2 - f(0.5, tn)) / 2
    assert loss == pytest.approx(want, rel=1e-12)
    # d f / d log pi = 4 s (1 - s) r with s = sigmoid(tau (r - 1)); on-policy it is exactly 1
    w = lambda r, tau: 4 * sigmoid(tau * (r - 1)) * (1 - sigmoid(tau * (r - 1))) * r  # noqa: E731
    assert w(1, 1) == 1.0
    assert grad[0].tolist() == pytest.approx([-1 / 4, -w(e, 1) / 4], rel=1e-12)  # -A w / (S |y|), S=2, |y|=2
    assert grad[1, 0].item() == pytest.approx(w(0.5, tn) / 2, rel=1e-12)
    # soft clip fraction: gate weight 4 s (1 - s) below 0.5; none of these (|tau (r - 1)| <= 1.72)
    assert m["clip_fraction"] == 0.0 and m["ratio_max"] == pytest.approx(e)


def test_sapo_soft_clip_counts_far_off_policy_tokens():
    # tau (r - 1) = 3 > 2.63 (where 4 s (1 - s) = 0.5): weight ~0.18, counted high; r = 0.05 with tau_neg 1.05:
    # z = -0.9975, weight ~0.79, not counted
    lp, old, mask = batch([[-1.0], [-1.0]], [[math.log(4.0)], [math.log(0.05)]])
    _, grad, m = run("sapo", lp, old, torch.tensor([1.0, -1.0], dtype=torch.float64), mask)
    s = sigmoid(3.0)
    assert grad[0, 0].item() == pytest.approx(-4 * s * (1 - s) * 4.0 / 2, rel=1e-12)
    assert (m["clip_fraction_high"], m["clip_fraction_low"]) == (0.5, 0.0)


def test_gmpo_hand_values_and_gradient():
    # seq 0, A = +1: log ratios 0.1 and 0.6 -> 0.6 clipped to 0.4 -> s_0 = exp((0.1 + 0.4) / 2) = e^0.25
    # seq 1, A = -1: -0.6 clipped up to -0.4 (A < 0 takes the max), 0.2 kept -> s_1 = exp(-0.1)
    lp, old, mask = batch([[-1.0, -2.0], [-1.5, -0.5]], [[0.1, 0.6], [-0.6, 0.2]])
    loss, grad, m = run("gmpo", lp, old, torch.tensor([1.0, -1.0], dtype=torch.float64), mask)
    assert loss == pytest.approx((-math.exp(0.25) + math.exp(-0.1)) / 2, rel=1e-12)
    # d/d log pi_t = -A s / (S |y|) for an unclipped token, 0 for a clipped one
    assert grad[0].tolist() == pytest.approx([-math.exp(0.25) / 4, 0.0], rel=1e-12, abs=0)
    assert grad[1].tolist() == pytest.approx([0.0, math.exp(-0.1) / 4], rel=1e-12, abs=0)
    assert (m["clip_fraction"], m["clip_fraction_high"], m["clip_fraction_low"]) == (0.5, 0.25, 0.25)


def test_gmpo_unclipped_is_gspo_without_clip():
    """Inside the clip range the geometric mean of token ratios is GSPO's sequence ratio (Eq. 7)."""
    lp, old, mask = batch([[-1.0, -2.0, -0.3], [-1.5]], [[0.01, -0.02, 0.03], [-0.01]])
    adv = torch.tensor([0.7, -1.3], dtype=torch.float64)
    g_loss, g_grad, _ = run("gmpo", lp, old, adv, mask)
    s_loss, s_grad, _ = run("gspo", lp, old, adv, mask, clip_low=1.0, clip_high=1.0)
    assert g_loss == pytest.approx(s_loss, rel=1e-12)
    torch.testing.assert_close(g_grad, s_grad, rtol=1e-12, atol=0)


def test_dr_grpo_hand_values_gradient_and_advantages():
    # ratios 1.1 and 1.5 (clipped to 1.2, A > 0) for seq 0, A = +1; 0.9 for seq 1, A = -1; L = 4, S = 2
    lp, old, mask = batch([[-1.0, -2.0], [-0.5]], [[math.log(1.1), math.log(1.5)], [math.log(0.9)]])
    loss, grad, m = run("dr_grpo", lp, old, torch.tensor([1.0, -1.0], dtype=torch.float64), mask)
    assert loss == pytest.approx(-(1.1 + 1.2 - 0.9) / (2 * 4), rel=1e-12)
    assert grad[0].tolist() == pytest.approx([-1.1 / 8, 0.0], rel=1e-12)
    assert grad[1, 0].item() == pytest.approx(0.9 / 8, rel=1e-12)
    assert m["clip_fraction_high"] == pytest.approx(1 / 3)
    # no length normalisation: a sequence's tokens weigh 1/L whatever its length (GRPO's seq-mean: 1/|y_i|)
    assert resolve_objective("dr_grpo", options={"norm_length": 4}).loss_agg == "seq_mean_token_sum"
    # no std normalisation of the advantages by default
    from learner.config import LearnerConfig

    assert LearnerConfig(algorithm="dr_grpo").advantage_std() is False
    assert LearnerConfig(algorithm="grpo").advantage_std() is True
    assert LearnerConfig(algorithm="dr_grpo", normalize_adv_std=True).advantage_std() is True


# ------------------------------------------------------------------------------------------ edge cases


@pytest.mark.parametrize("algorithm", NEW)
def test_empty_mask_gives_zero_loss_gradient_and_finite_metrics(algorithm):
    lp = torch.full((2, 3), float("nan"), dtype=torch.float64, requires_grad=True)
    old = torch.full((2, 3), float("inf"), dtype=torch.float64)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    loss, grad, m = run(algorithm, lp, old, torch.ones(2, dtype=torch.float64), mask)
    assert loss == 0.0 and torch.equal(grad, torch.zeros_like(grad))
    assert m["num_ratios"] == 0 and m["clip_fraction"] == 0.0 and all(math.isfinite(v) for v in m.values())


@pytest.mark.parametrize("algorithm", NEW)
def test_extreme_ratios_stay_finite(algorithm):
    # log-ratios of +-1e4 (exp overflows without the clamp) and NaN in padding
    lp, old, mask = batch([[-1.0, -2.0, -3.0], [-1.0]], [[1e4, -1e4, 0.0], [5e3]])
    old = torch.where(mask, old, torch.tensor(float("nan"), dtype=torch.float64))
    loss, grad, m = run(algorithm, lp, old, torch.tensor([1.0, -1.0], dtype=torch.float64), mask)
    assert math.isfinite(loss) and torch.isfinite(grad).all()
    assert m["log_ratio_abs_max"] == pytest.approx(1e4)
    assert grad[~mask].abs().sum() == 0


@pytest.mark.parametrize("algorithm", NEW)
def test_all_zero_advantages_give_no_gradient(algorithm):
    lp, old, mask = batch([[-1.0, -2.0], [-0.5]], [[0.3, -0.2], [0.1]])
    loss, grad, _ = run(algorithm, lp, old, torch.zeros(2, dtype=torch.float64), mask)
    assert loss == 0.0 and torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_micro_batches_sum_to_the_whole(algorithm):
    """Every entry divides by the global normalisers: parts' losses and gradients sum to the whole's, and
    their metrics combine exactly."""
    torch.manual_seed(0)
    lp = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    old = lp.detach() + 0.3 * torch.randn(6, 5, dtype=torch.float64)
    mask = torch.rand(6, 5) > 0.3
    mask[2] = False
    adv = torch.randn(6, dtype=torch.float64)
    obj = resolve_objective(algorithm, options=OPTIONS.get(algorithm))
    whole = policy_loss(lp, old, adv, mask, obj)
    (g_whole,) = torch.autograd.grad(whole.loss, lp)
    s, n = loss_normalisers(mask)
    parts = [policy_loss(lp[a:b], old[a:b], adv[a:b], mask[a:b], obj, num_sequences=s, num_tokens=n)
             for a, b in ((0, 2), (2, 5), (5, 6))]
    (g_parts,) = torch.autograd.grad(sum(p.loss for p in parts), lp)
    assert float(sum(p.loss for p in parts)) == pytest.approx(float(whole.loss), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(g_parts, g_whole, rtol=1e-10, atol=1e-15)
    combined = combine_policy_metrics([p.metrics for p in parts])
    for key in ("clip_fraction", "ratio_mean", "ratio_max", "num_ratios", "num_tokens"):
        assert combined[key] == pytest.approx(whole.metrics[key], rel=1e-12), key


def test_token_weights_only_where_the_loss_takes_them():
    lp, old, mask = batch([[-1.0, -2.0]], [[0.1, 0.2]])
    w = torch.tensor([[0.5, 2.0]], dtype=torch.float64)
    for algorithm in ("gspo", "gspo_token", "gmpo"):
        with pytest.raises(ValueError, match=f"token_weights with algorithm='{algorithm}'"):
            policy_loss(lp, old, torch.ones(1), mask, resolve_objective(algorithm), token_weights=w)
    # CISPO: each token's term times its weight
    r = policy_loss(lp, old, torch.ones(1, dtype=torch.float64), mask, resolve_objective("cispo"), token_weights=w)
    want = -(math.exp(0.1) * 0.5 * -1.0 + math.exp(0.2) * 2.0 * -2.0) / 2
    assert float(r.loss.detach()) == pytest.approx(want, rel=1e-12)


# ------------------------------------------------------------------------------------------ settings


def test_settings_are_typed_and_checked():
    assert resolve_objective("sapo", options={"tau_pos": 2}).settings.tau_pos == 2.0
    assert resolve_objective("cispo").settings.clip_high == 4.0
    assert (resolve_objective("gmpo").clip_low, resolve_objective("gmpo").clip_high) == (0.4, 0.4)
    with pytest.raises(ValueError, match="clip_low=0.1 is not a setting of algorithm='sapo'"):
        resolve_objective("sapo", clip_low=0.1)
    with pytest.raises(ValueError, match="loss_options.tau=1 is not a setting"):
        resolve_objective("sapo", options={"tau": 1})
    with pytest.raises(ValueError, match="tau_neg=-1.0 must be a finite number > 0"):
        resolve_objective("sapo", options={"tau_neg": -1})
    with pytest.raises(ValueError, match="tau_pos='x' is not a float"):
        resolve_objective("sapo", options={"tau_pos": "x"})
    with pytest.raises(ValueError, match="needs loss_options.norm_length"):
        resolve_objective("dr_grpo")
    with pytest.raises(ValueError, match="loss_options.clip_low: set clip_low instead"):
        resolve_objective("grpo", options={"clip_low": 0.1})
    assert set(BUILTIN_LOSSES) == set(ALGORITHMS)


def test_run_config_sets_dr_grpo_norm_length_from_the_rollout_limit():
    from cluster.config import load_config
    from tests.helpers import REPO_ROOT

    cfg = load_config(str(REPO_ROOT / "configs" / "tiny_moe.yaml"), ["learner.algorithm=dr_grpo"])
    assert cfg.learner.loss_options == {"norm_length": cfg.rollout.max_response_tokens}


# ------------------------------------------------------------------------------------------ user losses


@dataclass(frozen=True)
class _ScaleSettings:
    scale: float = 1.0
    loss_agg: str = "token_mean"


@register_policy_loss(settings=_ScaleSettings)
def scaled_reinforce(x: LossInputs, s: _ScaleSettings) -> LossTerms:
    """A user loss for the tests: ``-scale * A * log pi`` token-mean, nothing clipped."""
    ratio = torch.exp(x.lp - x.old)
    zero = torch.zeros_like(ratio)
    return LossTerms(-s.scale * x.aggregate(x.adv * x.lp, s.loss_agg),
                     RatioUnits(x.mask, ratio, (x.lp - x.old).abs(), zero, zero))


def test_a_user_loss_by_module_and_name():
    name = f"{__name__}:scaled_reinforce"
    assert get_policy_loss(name) is scaled_reinforce
    lp, old, mask = batch([[-1.0, -2.0], [-0.5]], [[0.0, 0.0], [0.0]])
    obj = resolve_objective(name, loss_agg="seq_mean_token_mean", options={"scale": 3})
    assert obj.settings == _ScaleSettings(3.0, "seq_mean_token_mean")
    r = policy_loss(lp, old, torch.tensor([1.0, -1.0], dtype=torch.float64), mask, obj)
    assert float(r.loss.detach()) == pytest.approx(-3 * ((-1 - 2) / 2 + 0.5) / 2, rel=1e-12)
    assert r.metrics["clip_fraction"] == 0.0 and r.metrics["num_ratios"] == 3
    with pytest.raises(ValueError, match="clip_low=0.2 is not a setting"):
        resolve_objective(name, clip_low=0.2)


def test_registry_errors_name_the_loss(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="'gspo' is already registered"):
        register_policy_loss("gspo")(scaled_reinforce.fn)
    with pytest.raises(ValueError, match="algorithm='nope' is not one of"):
        get_policy_loss("nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod_xyz'"):
        get_policy_loss("no_such_mod_xyz:f")
    (tmp_path / "userloss_plain.py").write_text("X = 1\n\ndef loss(x, s):\n    raise AssertionError\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(ValueError, match="has no callable 'X'"):
            get_policy_loss("userloss_plain:X")
        spec = get_policy_loss("userloss_plain:loss")  # a plain function: a loss without settings
        assert spec.name == "userloss_plain:loss" and build_settings(spec.name, spec.info) is not None
    finally:
        sys.modules.pop("userloss_plain", None)
