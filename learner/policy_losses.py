"""The losses that came after GSPO, as registry entries: CISPO, SAPO and GMPO (Dr. GRPO, which is GRPO's token
clipping with another normaliser, sits beside GRPO in ``learner/objectives.py``).

Each is a function of the registry's one signature (``learner/loss_registry.py``): sanitised inputs and its
typed settings (``learner/loss_settings.py``, the paper's defaults) in, the loss and its ratio units out.
``learner.objectives.policy_loss`` turns the units into the usual metrics, so every loss reports
``clip_fraction`` (or its analogue, said in each docstring) under the same names. Shapes: ``[B, T]`` inputs, 0
outside the response mask; ``r_i,t = pi_theta(y_i,t) / pi_old(y_i,t)`` with its log clamped to
``+-LOG_RATIO_CLAMP`` before ``exp``; ``A`` the advantage (``[B, T]``, one value per sequence broadcast).
Forms checked against verl's ``verl/trainer/ppo/core_algos.py`` (commit b178a3cd5: ``compute_policy_loss_cispo``,
``_sapo``, ``_geo_mean``) and TRL's ``trl/trainer/grpo_trainer.py`` (commit f2cd57710, ``loss_type`` ``cispo``,
``sapo``); our own code. Pure torch.
"""

from __future__ import annotations

from typing import Any

import torch

from learner.loss_registry import LOG_RATIO_CLAMP, LossInputs, LossTerms, RatioUnits, register_policy_loss


def _token_ratio(x: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(r, log r)`` per token, ``r`` from the clamped log-ratio; ``log r`` unclamped (for the metrics)."""
    log_ratio = x.lp - x.old
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)), log_ratio


def _weighted(values: torch.Tensor, x: LossInputs) -> torch.Tensor:
    return values if x.weights is None else values * x.weights


@register_policy_loss("cispo")
def cispo_loss(x: LossInputs, settings: Any) -> LossTerms:
    """CISPO (MiniMax-M1, arXiv 2506.13585: its objective J_CISPO and clipped IS weight r^, below): a clipped,
    stop-gradient IS weight on a REINFORCE token term, so no token's gradient is dropped (PPO's clip zeroes it):

        r^_i,t = clip(r_i,t, 1 - eps_low, 1 + eps_high)                                          (r^)
        loss   = -(1/N) sum_i sum_t sg[r^_i,t] A_i,t log pi_theta(y_i,t | x, y_i,<t)         (-J_CISPO)

    aggregated by ``settings.loss_agg`` (default ``token_mean``, the paper's ``1 / sum_i |o_i|``). Defaults
    (``CispoSettings``): no lower bound (``clip_low = 1``, the paper's "large eps_low"), ``clip_high = 4`` (an IS
    weight of at most 5, ScaleRL's eps_max and TRL's recommended value; the sources read give no value of
    MiniMax's own). Gradient w.r.t. a token's log-prob:
    ``-sg[r^] A / N`` (the loss's value carries ``log pi``, as in verl and TRL; only its gradient matters).
    Clip fraction: the share of tokens whose weight was truncated (low: ``r < 1 - eps_low``, high:
    ``r > 1 + eps_high``, whatever the advantage's sign; verl's ``pg_clipfrac``).
    """
    ratio, log_ratio = _token_ratio(x)
    low, high = 1.0 - settings.clip_low, 1.0 + settings.clip_high
    weight = ratio.clamp(low, high).detach()
    loss = -x.aggregate(_weighted(weight * x.adv * x.lp, x), settings.loss_agg)
    dtype = x.lp.dtype
    units = RatioUnits(x.mask, ratio, log_ratio.abs(), ((ratio < low) & x.mask).to(dtype),
                       ((ratio > high) & x.mask).to(dtype))
    return LossTerms(loss, units)


# SAPO's soft "clip fraction": a token counts when its gate passes less than half the unclipped gradient.
SAPO_SOFT_CLIP_WEIGHT = 0.5


@register_policy_loss("sapo")
def sapo_loss(x: LossInputs, settings: Any) -> LossTerms:
    """SAPO ("Soft Adaptive Policy Optimization", Qwen team, arXiv 2511.20347: its objective, below):
    a smooth temperature-controlled gate instead of the hard clip,

        f_i,t(r) = sigmoid(tau_i,t (r - 1)) * 4 / tau_i,t,    tau_i,t = tau_pos if A_i,t > 0 else tau_neg
        loss     = -(1/S) sum_i (1/|y_i|) sum_t f_i,t(r_i,t) A_i,t

    aggregated by ``settings.loss_agg`` (default ``seq_mean_token_mean``, the paper's and verl's). Defaults
    (``SapoSettings``): ``tau_pos = 1.0``, ``tau_neg = 1.05`` (negative tokens' gates decay faster).
    Gradient w.r.t. a token's log-prob: ``-A r w / (S |y_i|)`` with ``w = 4 sigmoid(z) (1 - sigmoid(z))``,
    ``z = tau (r - 1)``: ``w = 1`` on-policy (the plain policy gradient) and decays smoothly off-policy.
    Clip fraction (its analogue; verl logs 0): the share of tokens whose gate weight ``w`` is below
    ``SAPO_SOFT_CLIP_WEIGHT`` (0.5), high when ``r > 1``, low when ``r < 1``.
    """
    ratio, log_ratio = _token_ratio(x)
    pos, neg = (torch.tensor(float(t), dtype=x.lp.dtype, device=x.lp.device)
                for t in (settings.tau_pos, settings.tau_neg))
    tau = torch.where(x.adv > 0, pos, neg)
    z = tau * (ratio - 1.0)
    gate = torch.sigmoid(z) * (4.0 / tau)
    loss = -x.aggregate(_weighted(gate * x.adv, x), settings.loss_agg)
    with torch.no_grad():
        sig = torch.sigmoid(z)
        soft = (4.0 * sig * (1.0 - sig) < SAPO_SOFT_CLIP_WEIGHT) & x.mask
        dtype = x.lp.dtype
        units = RatioUnits(x.mask, ratio, log_ratio.abs(), (soft & (ratio < 1)).to(dtype),
                           (soft & (ratio > 1)).to(dtype))
    return LossTerms(loss, units)


@register_policy_loss("gmpo")
def gmpo_loss(x: LossInputs, settings: Any) -> LossTerms:
    """GMPO ("Geometric-Mean Policy Optimization", arXiv 2507.20673: its objective J_GMPO, below):
    the geometric mean of the token terms instead of their arithmetic mean, clipped per token in log space,

        l_i,t  = sgn(A_i) * min(sgn(A_i) log r_i,t, sgn(A_i) clip(log r_i,t, -eps_low, eps_high))
        loss   = -(1/S) sum_i A_i exp((1/|y_i|) sum_t l_i,t)

    (``A_i``: the mean of the sequence's token advantages, as verl's ``geo_mean``; with one advantage per
    sequence, the paper's). Sequence-mean loss only. Defaults (``GmpoSettings``): ``eps_low = eps_high = 0.4``,
    the paper's ratio range ``(e^-0.4, e^0.4)``. Gradient w.r.t. a token's log-prob: ``-A_i s_i / (S |y_i|)``
    (``s_i`` the clipped geometric mean) where the token is unclipped, 0 where it is clipped. Clip fraction:
    the share of tokens clipped (high: ``A > 0`` and ``log r > eps_high``; low: ``A < 0`` and
    ``log r < -eps_low``), tokens as the unit, as verl counts.
    """
    ratio, log_ratio = _token_ratio(x)
    lr = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    sign = torch.sign(x.adv)
    term = sign * torch.minimum(sign * lr, sign * lr.clamp(-settings.clip_low, settings.clip_high))
    length = x.lengths.clamp(min=1).to(x.lp.dtype)
    seq_ratio = torch.exp(term.masked_fill(~x.mask, 0.0).sum(-1) / length)
    seq_adv = x.adv.masked_fill(~x.mask, 0.0).sum(-1) / length
    loss = -(seq_adv * seq_ratio).masked_fill(x.lengths == 0, 0.0).sum() / x.seq_den
    dtype = x.lp.dtype
    units = RatioUnits(x.mask, ratio, log_ratio.abs(), ((x.adv < 0) & (lr < -settings.clip_low) & x.mask).to(dtype),
                       ((x.adv > 0) & (lr > settings.clip_high) & x.mask).to(dtype))
    return LossTerms(loss, units)
