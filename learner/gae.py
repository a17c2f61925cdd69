"""PPO's critic math: the terminal reward as token rewards, GAE, advantage whitening and the clipped value loss.

Pure torch (tensors and plain arguments in, tensors and Python floats out), like ``learner/objectives.py``.
Sources: GAE is Schulman et al., "High-Dimensional Continuous Control Using Generalized Advantage Estimation"
(arXiv 1506.02438), Eq. 16; the clipped value loss is the one of the PPO2 baselines (Schulman et al., arXiv
1707.06347, with the value clipping of OpenAI baselines) as LLM trainers use it: verl's
``verl/trainer/ppo/core_algos.py`` (``compute_gae_advantage_return``, ``compute_value_loss``) and OpenRLHF's
``ValueLoss`` were read; this is our own code. Positions follow ``learner.contracts.TrainBatch``: position ``t``
of a ``[B, T]`` tensor is the action ``input_ids[:, t + 1]``, taken in the state ``input_ids[:, : t + 1]``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def terminal_rewards(rewards: Tensor, response_mask: Tensor) -> Tensor:
    """The verifier's one reward per sequence as token rewards: all of it on each row's last response token.

    Args:
        rewards: float ``[B]``; must be finite where a row has response tokens (give NaN rows an all-False mask).
        response_mask: bool or 0/1 ``[B, T]``.

    Returns:
        float32 ``[B, T]`` (float64 for float64 rewards): ``rewards[b]`` at the last True of row ``b``, 0
        elsewhere (an all-False row is all 0).

    Raises:
        ValueError: shapes that do not match, or a non-finite reward on a row with response tokens.
    """
    mask = response_mask.bool()
    if rewards.dim() != 1 or mask.dim() != 2 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(f"rewards {tuple(rewards.shape)} must be [B] and response_mask {tuple(mask.shape)} [B, T]")
    has = mask.any(-1)
    if not bool(torch.isfinite(rewards[has]).all()):
        raise ValueError("rewards must be finite on rows with response tokens (mask out invalid samples)")
    dtype = rewards.dtype if rewards.dtype == torch.float64 else torch.float32
    t = mask.shape[1]
    last = (t - 1) - torch.flip(mask, dims=[1]).int().argmax(-1)  # index of each row's last True
    out = torch.zeros(mask.shape, dtype=dtype, device=rewards.device)
    rows = torch.nonzero(has).squeeze(-1)
    out[rows, last[rows]] = rewards[rows].to(dtype)
    return out


@torch.no_grad()
def gae(token_rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over the response tokens (GAE paper Eq. 16), with the returns.

    Over the response positions ``t_1 < t_2 < ... < t_n`` of a row (positions outside the mask are skipped,
    as verl skips them: they carry no reward, value or advantage, and the next response token's value is the
    bootstrap), with ``V(t_{n+1}) = 0`` (the episode ends after the last response token):

        delta_j = r_{t_j} + gamma V(t_{j+1}) - V(t_j)
        A_{t_j} = delta_j + gamma lam A_{t_{j+1}}          (A_{t_{n+1}} = 0)
        R_{t_j} = A_{t_j} + V(t_j)                          (the value target, TD(lambda) return)

    With ``gamma = lam = 1`` (verl's and OpenRLHF's defaults for LLM RL) and the reward on the last token,
    ``A_t = r - V(t)`` and ``R_t = r`` at every response token.

    Args:
        token_rewards: float ``[B, T]`` (``terminal_rewards``), 0 outside the mask.
        values: float ``[B, T]``, the critic's ``V(t)`` (no gradient used).
        response_mask: bool or 0/1 ``[B, T]``.
        gamma: discount in ``[0, 1]``; lam: GAE's lambda in ``[0, 1]``.

    Returns:
        ``(advantages, returns)``, float ``[B, T]`` in the dtype of ``values``, 0 outside the mask.

    Raises:
        ValueError: shapes that differ, or ``gamma`` / ``lam`` outside ``[0, 1]``.
    """
    mask = response_mask.bool()
    if token_rewards.shape != values.shape or values.shape != mask.shape or values.dim() != 2:
        raise ValueError(f"token_rewards {tuple(token_rewards.shape)}, values {tuple(values.shape)} and "
                         f"response_mask {tuple(mask.shape)} must be the same [B, T]")
    for name, x in (("gamma", gamma), ("lam", lam)):
        if not (math.isfinite(x) and 0.0 <= x <= 1.0):
            raise ValueError(f"{name}={x!r} must be in [0, 1]")
    v = torch.where(mask, values, 0.0)
    r = torch.where(mask, token_rewards.to(v.dtype), 0.0)
    adv = torch.zeros_like(v)
    next_value = torch.zeros_like(v[:, 0])
    running = torch.zeros_like(v[:, 0])
    for t in range(v.shape[1] - 1, -1, -1):
        m = mask[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        candidate = delta + gamma * lam * running
        running = torch.where(m, candidate, running)
        next_value = torch.where(m, v[:, t], next_value)
        adv[:, t] = torch.where(m, running, 0.0)
    return adv, torch.where(mask, adv + v, 0.0)


def whiten_sums(x: Tensor, response_mask: Tensor) -> list[float]:
    """This part's ``[sum, sum of squares, count]`` of ``x`` over the mask (float64 sums), to add across
    micro-batches and ranks before ``whiten_stats``."""
    mask = response_mask.bool()
    xm = torch.where(mask, x.double(), 0.0)
    return [float(xm.sum()), float((xm * xm).sum()), float(mask.sum())]


def whiten_stats(total: float, total_sq: float, count: float) -> tuple[float, float]:
    """Mean and unbiased variance (divide by ``count - 1``, as verl's ``masked_var``) from ``whiten_sums``
    added over all parts; ``(0, 0)`` with no element, variance 0 with one."""
    if count <= 0:
        return 0.0, 0.0
    mean = total / count
    if count < 2:
        return mean, 0.0
    return mean, max(total_sq - count * mean * mean, 0.0) / (count - 1)


def whiten(x: Tensor, response_mask: Tensor, mean: float, var: float, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` on the mask, 0 outside it (verl's ``masked_whiten``, with the batch's
    statistics given: ``whiten_stats`` over every rank's part)."""
    return torch.where(response_mask.bool(), (x - mean) / math.sqrt(var + eps), 0.0)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, response_mask: Tensor, clip: float | None,
               num_tokens: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped value loss, token mean (verl's ``compute_value_loss`` with ``loss_agg_mode="token-mean"``):

        V_clip = old + clamp(V - old, -clip, clip)
        loss   = (1/2) (1/N) sum_{b,t in mask} max( (V - R)^2, (V_clip - R)^2 )

    ``clip=None`` drops the clipped term: ``(1/2) (1/N) sum (V - R)^2``.

    Args:
        values: float ``[B, T]``, the critic's current ``V`` (the tensor gradients flow to).
        old_values: float ``[B, T]``, ``V`` before this rollout batch's updates; returns: float ``[B, T]``.
        response_mask: bool or 0/1 ``[B, T]``.
        clip: the value clip range (> 0), or None.
        num_tokens: ``N``, the minibatch's masked tokens over all micro-batches and ranks (>= this call's own
            count); None: this call's count. The parts' losses then sum to the minibatch's.

    Returns:
        ``(loss, metrics)``: a 0-dim loss (float32, float64 for float64 values) and Python-float sums to add
        over parts: ``num_tokens``, ``num_clipped`` (tokens whose clipped term is the larger, verl's
        ``vf_clipfrac`` numerator), ``sq_error_sum`` (``sum (V - R)^2``), ``value_sum``.

    Raises:
        ValueError: shapes that differ, ``clip <= 0``, a ``num_tokens`` below this call's count.
    """
    mask = response_mask.bool()
    if not (values.shape == old_values.shape == returns.shape == mask.shape):
        raise ValueError(f"values {tuple(values.shape)}, old_values {tuple(old_values.shape)}, returns "
                         f"{tuple(returns.shape)} and response_mask {tuple(mask.shape)} must be the same shape")
    if clip is not None and not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"clip={clip!r} must be a finite number > 0 (or None)")
    n = float(mask.sum())
    if num_tokens is not None and num_tokens < n:
        raise ValueError(f"num_tokens={num_tokens!r} is smaller than this call's own count ({int(n)})")
    den = max(float(num_tokens) if num_tokens is not None else n, 1.0)
    dtype = torch.float64 if values.dtype == torch.float64 else torch.float32
    v = torch.where(mask, values.to(dtype), 0.0)
    old = torch.where(mask, old_values.to(dtype), 0.0)
    ret = torch.where(mask, returns.to(dtype), 0.0)
    unclipped = (v - ret) ** 2
    if clip is None:
        per_token, clipped = unclipped, torch.zeros_like(mask)
    else:
        v_clip = old + (v - old).clamp(-clip, clip)
        clipped_sq = (v_clip - ret) ** 2
        per_token, clipped = torch.maximum(unclipped, clipped_sq), clipped_sq > unclipped
    loss = 0.5 * torch.where(mask, per_token, 0.0).sum() / den
    metrics = {"num_tokens": n, "num_clipped": float((clipped & mask).sum()),
               "sq_error_sum": float(unclipped.detach()[mask].sum()), "value_sum": float(v.detach()[mask].sum())}
    return loss, metrics
