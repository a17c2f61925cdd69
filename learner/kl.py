"""The KL penalty to the reference policy: ``KL(pi_theta || pi_ref)`` estimated per token (k1, k2, k3) and
aggregated like the policy loss (:func:`learner.objectives.policy_loss`), with the same masks and normalisers.

Pure torch (no Ray, vLLM, DeepSpeed or config imports): tensors and plain arguments in, a loss tensor out.
References: Schulman, "Approximating KL divergence" (2020). The conventions for ``[B, T]`` inputs and
micro-batching are ``learner/objectives.py``'s.
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner.loss_registry import LOG_RATIO_CLAMP
from learner.objective_names import KL_ESTIMATORS, LOSS_AGGS
from learner.objectives import _aggregate, _mask_and_dtype, _normaliser, loss_normalisers


def kl_penalty(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    response_mask: Tensor,
    estimator: str,
    *,
    loss_agg: str = "seq_mean_token_mean",
    num_sequences: float | None = None,
    num_tokens: float | None = None,
) -> Tensor:
    """KL(pi_theta || pi_ref) estimated per token from samples of the policy, aggregated like the loss.

    With ``log r = log pi_ref - log pi_theta`` per response token (Schulman, "Approximating KL divergence",
    2020): ``k1 = -log r`` (unbiased, high variance, can be negative), ``k2 = (log r)^2 / 2`` (biased, low
    variance), ``k3 = (r - 1) - log r`` (unbiased, low variance, >= 0; ``log r`` is clamped to
    ``+-LOG_RATIO_CLAMP`` before ``exp``). The per-token values are aggregated with ``loss_agg`` and the
    normalisers exactly as in :func:`policy_loss`; the learner adds ``kl_coef * kl_penalty(...)`` to the loss
    (GSPO uses ``kl_coef = 0``).

    Args:
        log_probs: float ``[B, T]``, current-policy log-probs (differentiable).
        ref_log_probs: float ``[B, T]``, reference-policy log-probs.
        response_mask: bool or 0/1 ``[B, T]``.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
        loss_agg: one of ``LOSS_AGGS`` (pass the policy loss's resolved value).
        num_sequences, num_tokens: global normalisers, as for :func:`policy_loss`.

    Returns:
        0-dim tensor (float32, float64 for float64 inputs), 0 when there is no response token.

    Raises:
        ValueError: unknown estimator or loss_agg, mismatched shapes, a normaliser below the local count.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator={estimator!r} is not one of {KL_ESTIMATORS}")
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg={loss_agg!r} is not one of {LOSS_AGGS}")
    mask, dtype = _mask_and_dtype(log_probs, ref_log_probs, response_mask, ("log_probs", "ref_log_probs"))
    n_seq, n_tok = loss_normalisers(mask)
    seq_den = _normaliser(num_sequences, n_seq, "num_sequences")
    tok_den = _normaliser(num_tokens, n_tok, "num_tokens")
    log_r = torch.where(mask, ref_log_probs.to(dtype) - log_probs.to(dtype), 0.0)
    if estimator == "k1":
        kl = -log_r
    elif estimator == "k2":
        kl = 0.5 * log_r.square()
    else:
        log_r = log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl = torch.exp(log_r) - 1.0 - log_r
    return _aggregate(torch.where(mask, kl, 0.0), mask, loss_agg, seq_den, tok_den)
