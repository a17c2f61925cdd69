"""On-policy distillation's per-token signal: the reverse KL from the student to a teacher on the student's own
samples, as a per-token advantage beside (or instead of) the group-relative reward advantage. Pure torch.

For response token ``t`` of sample ``i`` (sampled by the behaviour policy ``pi_old``, the engine that returned its
log-prob with the sample), the one-sample estimate of the reverse KL ``KL(pi_old || pi_teacher)`` at that position
is ``k_i,t = log pi_old(y_t) - log pi_teacher(y_t)``; its negative is the token's reward, with no discount and
no sum over later tokens, and the advantage is ``A_i,t = reward_weight * A_i - kl_coef * k_i,t``.

Sources: Gu et al., MiniLLM (arXiv 2306.08543): distillation by the reverse KL on the student's samples, trained
as a policy gradient; Agarwal et al., GKD (arXiv 2306.13649): on-policy distillation, the student's own samples
scored by the teacher; Lu and Thinking Machines Lab, "On-Policy Distillation" (2025, the Tinker cookbook): the
per-token reverse KL ``sampled log-prob - teacher log-prob`` as a per-token reward, advantage ``-kl_coef * k``,
no discount. Our own code.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check(name: str, x: Tensor, shape: tuple[int, ...]) -> None:
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {shape}")


def reverse_kl_tokens(behaviour_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token reverse-KL estimate ``k_i,t = log pi_old(y_t) - log pi_teacher(y_t)`` where ``mask``, 0 elsewhere.

    Args:
        behaviour_logprobs: float ``[N, R]``, the sampling engine's log-prob of each response token (nats).
        teacher_logprobs: float ``[N, R]``, the teacher's log-prob of the same token given the same prefix; NaN
            where the teacher gave none (a failed call: the sample is then invalid, see ``distill_advantages``).
        mask: bool ``[N, R]``, True on the tokens the student sampled (False on padding and, in an episode, on an
            environment's tokens).

    Returns:
        float32 ``[N, R]``: ``k`` on the mask (NaN where the teacher's value is NaN), 0 off it.

    Raises:
        ValueError: shapes that differ, a mask that is not bool, or log-probs that are not floating point.
    """
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool, got {mask.dtype}")
    _check("behaviour_logprobs", behaviour_logprobs, tuple(mask.shape))
    _check("teacher_logprobs", teacher_logprobs, tuple(mask.shape))
    if not (behaviour_logprobs.dtype.is_floating_point and teacher_logprobs.dtype.is_floating_point):
        raise ValueError("log-probs must be floating point")
    k = behaviour_logprobs.to(torch.float32) - teacher_logprobs.to(torch.float32)
    return torch.where(mask, k, torch.zeros((), dtype=torch.float32))


def usable_rows(k: Tensor, mask: Tensor, valid: Tensor) -> Tensor:
    """bool ``[N]``: the samples that train, valid (``valid[i]``: a finite reward and a teacher answer) and with a
    finite ``k`` on every masked token.

    Raises:
        ValueError: shapes that do not fit ``[N, R]`` / ``[N]``, or a ``valid`` that is not bool.
    """
    _check("k", k, tuple(mask.shape))
    _check("valid", valid, (mask.shape[0],))
    if valid.dtype != torch.bool:
        raise ValueError(f"valid must be bool, got {valid.dtype}")
    return valid & torch.where(mask, torch.isfinite(k), True).all(-1)


def distill_advantages(reward_advantages: Tensor, k: Tensor, mask: Tensor, valid: Tensor, *, kl_coef: float,
                       reward_weight: float) -> Tensor:
    """Per-token advantages of on-policy distillation: ``A_i,t = reward_weight * A_i(t) - kl_coef * k_i,t`` on the
    masked tokens of usable samples (``usable_rows``), 0 elsewhere (padding, an environment's tokens, invalid
    samples: a NaN reward or a failed teacher call). Sources: see the module docstring (Tinker's advantage
    ``-kl_coef * reverse_kl`` per token, no discount).

    Args:
        reward_advantages: float ``[N]`` (one group-relative advantage per sample, ``learner.advantages``) or
            ``[N, R]`` (per response token, e.g. per turn); finite.
        k: float ``[N, R]``, ``reverse_kl_tokens``.
        mask: bool ``[N, R]``, the sampled response tokens.
        valid: bool ``[N]``, False for invalid samples.
        kl_coef: weight of the reverse KL, > 0.
        reward_weight: weight of the reward advantage, >= 0 (0: distillation alone).

    Returns:
        float32 ``[N, R]``, finite.

    Raises:
        ValueError: shapes that do not fit, ``kl_coef <= 0``, ``reward_weight < 0`` or a non-finite weight, or a
            non-finite reward advantage on a usable sample's masked token.
    """
    if not (kl_coef > 0 and kl_coef != float("inf")):
        raise ValueError(f"kl_coef={kl_coef!r} must be a finite number > 0")
    if not (reward_weight >= 0 and reward_weight != float("inf")):
        raise ValueError(f"reward_weight={reward_weight!r} must be a finite number >= 0")
    n, r = mask.shape
    if tuple(reward_advantages.shape) == (n,):
        reward_advantages = reward_advantages[:, None].expand(n, r)
    _check("reward_advantages", reward_advantages, (n, r))
    keep = mask & usable_rows(k, mask, valid)[:, None]
    base = reward_advantages.to(torch.float32)
    if not torch.isfinite(torch.where(keep, base, 0.0)).all():
        raise ValueError("reward_advantages must be finite on the tokens that train")
    adv = reward_weight * base - kl_coef * k.to(torch.float32)
    return torch.where(keep, adv, torch.zeros((), dtype=torch.float32))


def reverse_kl_stats(k: Tensor, mask: Tensor, usable: Tensor) -> dict[str, float]:
    """The step's distillation metrics over the usable samples' masked tokens: ``distill/reverse_kl`` (mean
    ``k`` per token, nats) and ``distill/reverse_kl_seq`` (mean over samples of each sample's summed ``k``, nats;
    the one-sample estimate of the sequence-level reverse KL). NaN when no token counts.

    Raises:
        ValueError: shapes that do not fit (as ``usable_rows``).
    """
    _check("k", k, tuple(mask.shape))
    _check("usable", usable, (mask.shape[0],))
    keep = mask & usable[:, None]
    tokens = int(keep.sum())
    rows = int((keep.any(-1)).sum())
    kept = torch.where(keep, k.to(torch.float64), 0.0)
    return {"distill/reverse_kl": float(kept.sum() / tokens) if tokens else float("nan"),
            "distill/reverse_kl_seq": float(kept.sum(-1).sum() / rows) if rows else float("nan")}
