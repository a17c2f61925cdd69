"""Training-vs-inference mismatch: its metrics and the corrections beside GSPO (pure torch).

The rollout engine and the learner compute the behaviour policy's log-probs with different kernels (and, on
MoE models, possibly different experts), so ``pi_engine != pi_train(theta_old)``. With the token log-ratio
``d_t = log pi_train(theta_old)[t] - log pi_engine[t]`` (``pi_train(theta_old)``: the learner's pre-update
pass; ``pi_engine``: the rollout log-probs), the corrections are (as verl exposes them,
``verl/trainer/ppo/rollout_corr_helper.py``, commit 0b4e2a8, ``compute_rollout_rejection_mask``: token, sequence
and geometric rejection of ``log(pi_train / pi_rollout)`` outside ``[lower, upper]``; Yao et al., "Your efficient RL framework secretly brings you
off-policy RL training", 2025, for truncated IS):

- ``token_tis``: per-token weight ``w_t = min(exp(d_t), C)``, ``C = learner.rollout_correction_high``
  (truncated importance sampling), multiplying each token's clipped surrogate;
- ``token_mis``: tokens with ``exp(d_t)`` outside ``[lo, hi]`` are dropped (masked importance sampling);
- ``seq_mis``: whole sequences with ``exp(sum_t d_t)`` outside ``[lo, hi]`` are dropped;
- ``seq_geo_rs``: whole sequences with the length-normalised geometric mean ``exp(mean_t d_t)`` (GSPO's own
  statistic, Eq. 7, applied to the mismatch) outside ``[lo, hi]`` are dropped (rejection).

A dropped token or sequence contributes 0 to the loss; the loss's normalisers are left as they are (the
minibatch's totals), so dropping never rescales the rest. Per-token weights and token drops change how a
GSPO sequence's tokens enter ``s_i``: ``learner.rollout_correction`` refuses them with gspo / gspo_token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner.objective_names import CORRECTIONS, TOKEN_CORRECTIONS

_CLAMP = 20.0

__all__ = ["CORRECTIONS", "TOKEN_CORRECTIONS", "rollout_correction", "mismatch_sums", "mismatch_metrics"]


def rollout_correction(train_lp: Tensor, engine_lp: Tensor, mask: Tensor, mode: str, low: float,
                       high: float) -> tuple[Tensor | None, Tensor, Tensor]:
    """Weights and kept mask of one micro-batch.

    Args:
        train_lp: float ``[B, T]``, ``log pi_train(theta_old)`` (the pre-update pass), 0 off the mask.
        engine_lp: float ``[B, T]``, the rollout engine's log-probs, 0 off the mask.
        mask: bool ``[B, T]`` response mask.
        mode: one of ``CORRECTIONS``.
        low, high: the band ``[lo, hi]`` on the ratio (``token_tis``: ``high`` is the cap ``C``).

    Returns:
        ``(weights, kept, dropped)``: ``weights`` float32 ``[B, T]`` (detached; None unless ``token_tis``),
        ``kept`` bool ``[B, T]`` (``mask`` minus dropped tokens), ``dropped`` bool ``[B, T]`` (response tokens
        dropped).

    Raises:
        ValueError: unknown ``mode`` or ``low > high``.
    """
    if mode not in CORRECTIONS:
        raise ValueError(f"rollout correction {mode!r} is not one of {CORRECTIONS}")
    if low > high:
        raise ValueError(f"rollout correction band [{low}, {high}] is empty")
    mask = mask.bool()
    d = torch.where(mask, (train_lp.double() - engine_lp.double()).clamp(-_CLAMP, _CLAMP), 0.0).detach()
    none = torch.zeros_like(mask)
    if mode == "off":
        return None, mask, none
    if mode == "token_tis":
        return torch.exp(d).clamp(max=high).float(), mask, none
    if mode == "token_mis":
        r = torch.exp(d)
        drop = mask & ((r < low) | (r > high))
        return None, mask & ~drop, drop
    lengths = mask.sum(-1).clamp(min=1).double()
    stat = d.sum(-1) if mode == "seq_mis" else d.sum(-1) / lengths
    r = torch.exp(stat.clamp(-_CLAMP, _CLAMP))
    drop = mask & ((r < low) | (r > high))[:, None]
    return None, mask & ~drop, drop


def mismatch_sums(train_lp: Tensor, engine_lp: Tensor, mask: Tensor, dropped: Tensor) -> list[float]:
    """Sums for the mismatch metrics of one micro-batch, to all-reduce and finish with ``mismatch_metrics``.

    Returns:
        ``[sum_t d_t, number of tokens, max_t |d_t|, max_i |mean_t d_t|, dropped tokens, sequences,
        sequences with a dropped token]`` over response tokens (``d_t`` as in the module docstring; the max
        entries are 0 for an empty mask).
    """
    mask = mask.bool()
    d = torch.where(mask, train_lp.double() - engine_lp.double(), 0.0)
    lengths = mask.sum(-1)
    has = lengths > 0
    seq = (d.sum(-1) / lengths.clamp(min=1))[has]
    return [float(d.sum()), float(mask.sum()), float(d.abs().max()) if mask.any() else 0.0,
            float(seq.abs().max()) if has.any() else 0.0, float(dropped.sum()), float(has.sum()),
            float(dropped.any(-1).sum())]


def mismatch_metrics(sums: list[float], maxima: list[float]) -> dict[str, float]:
    """``mismatch/*`` metrics from all-reduced ``mismatch_sums`` (summed entries) and ``maxima`` (the two max
    entries, all-reduced with max).

    ``mismatch/log_ratio_mean``: mean over response tokens of ``d_t``; ``mismatch/log_ratio_abs_max``:
    largest ``|d_t|``; ``mismatch/seq_log_ratio_abs_max``: largest ``|mean_t d_t|`` over sequences (log of the
    geometric-mean ratio); ``mismatch/masked_token_share`` and ``mismatch/masked_seq_share``: share of
    response tokens / sequences the correction dropped (0 when it is off or only weights).
    """
    d_sum, n_tok, _, _, dropped, n_seq, seq_dropped = sums
    return {
        "mismatch/log_ratio_mean": d_sum / n_tok if n_tok else 0.0,
        "mismatch/log_ratio_abs_max": maxima[0],
        "mismatch/seq_log_ratio_abs_max": maxima[1],
        "mismatch/masked_token_share": dropped / n_tok if n_tok else 0.0,
        "mismatch/masked_seq_share": seq_dropped / n_seq if n_seq else 0.0,
    }
