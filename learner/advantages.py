"""Group-relative advantages (GSPO paper Eq. 6, as in GRPO), per sequence and, for multi-turn episodes with
per-turn rewards, per turn (``gspo_token``). Pure torch."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def _check_group_args(rewards: Tensor, group_size: int, eps: float) -> int:
    """``group_advantages``' argument checks; returns ``group_size`` as an int."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if not rewards.dtype.is_floating_point:
        raise ValueError(f"rewards must be a float tensor (NaN marks invalid samples), got dtype {rewards.dtype}")
    if isinstance(group_size, bool) or int(group_size) != group_size or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be a positive integer")
    group_size = int(group_size)
    n = rewards.shape[0]
    if n % group_size:
        raise ValueError(f"rewards has N={n} entries, not a multiple of group_size={group_size}")
    if not eps >= 0:
        raise ValueError(f"eps={eps!r} must be >= 0")
    if torch.isinf(rewards).any():
        bad = torch.nonzero(torch.isinf(rewards)).flatten()[:5].tolist()
        raise ValueError(f"rewards must be finite or NaN (invalid); got inf at index {bad}")
    return group_size


def _group_stats(r: Tensor, normalize_std: bool) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """Of float64 ``[groups, G]`` rewards (NaN = invalid): ``(mean, std or None, valid, degenerate)``, mean and
    std ``[groups, 1]`` over each group's valid entries (population std), ``valid`` ``[groups, G]``,
    ``degenerate`` ``[groups, 1]``: at most one valid entry, or all valid entries equal."""
    valid = ~torch.isnan(r)
    count = valid.sum(-1, keepdim=True)
    r0 = torch.where(valid, r, 0.0)
    mean = r0.sum(-1, keepdim=True) / count.clamp(min=1)
    std = None
    if normalize_std:
        centred = torch.where(valid, r - mean, 0.0)
        std = (centred.square().sum(-1, keepdim=True) / count.clamp(min=1)).sqrt()
    r_max = torch.where(valid, r, -torch.inf).amax(-1, keepdim=True)
    r_min = torch.where(valid, r, torch.inf).amin(-1, keepdim=True)
    return mean, std, valid, (count <= 1) | (r_max == r_min)


def group_advantages(rewards: Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Advantage of each completion relative to the other completions of its prompt.

    ``A_i = (r_i - mean_group(r)) / (std_group(r) + eps)`` (GSPO paper Eq. 6); with ``normalize_std=False``
    ``A_i = r_i - mean_group(r)`` (Dr. GRPO's mean-only form, Liu et al., arXiv 2503.20783).

    The std is the **population** std of the group's valid rewards (divide by ``n``, not ``n - 1``): then the
    advantages of every group have mean 0 and mean square ``std^2 / (std + eps)^2 ~= 1``, whatever the number
    of valid samples in the group, so a group with invalid samples is not weighted differently; Eq. 6 writes
    ``std`` of the set of rewards without Bessel's correction. (Libraries that call ``torch.std`` use the
    sample std, smaller advantages by ``sqrt((n-1)/n)``, 0.935 for 8 samples.)

    Rules: NaN rewards mark invalid samples: they get advantage 0 and are left out of their group's mean and
    std. A group whose valid rewards are all equal, or that has at most one valid reward, gets exactly 0.
    Mean and std are computed in float64.

    Args:
        rewards: float ``[N]``, laid out as ``N / group_size`` consecutive groups of ``group_size``
            completions of one prompt each; NaN = invalid sample.
        group_size: completions per prompt (G), >= 1.
        normalize_std: divide by the group std (True, Eq. 6) or only subtract the group mean (False).
        eps: added to the std, >= 0.

    Returns:
        float32 ``[N]`` advantages (float64 for float64 rewards), finite.

    Raises:
        ValueError: ``rewards`` not 1-D or not floating point, ``group_size < 1``, ``N`` not a multiple of
            ``group_size``, an infinite reward, or ``eps < 0``.
    """
    group_size = _check_group_args(rewards, group_size, eps)
    n = rewards.shape[0]
    out_dtype = torch.promote_types(rewards.dtype, torch.float32)
    r = rewards.to(torch.float64).view(-1, group_size)
    mean, std, valid, degenerate = _group_stats(r, normalize_std)
    adv = torch.where(valid, r - mean, 0.0)
    if std is not None:
        adv = adv / (std + eps)
    # Exact zeros: all valid rewards equal (r - mean may be a rounding error), or at most one valid sample.
    adv = torch.where(valid & ~degenerate, adv, 0.0)
    return adv.reshape(n).to(out_dtype)


def turn_returns(rewards: Tensor, turn_rewards: Tensor) -> Tensor:
    """Per-turn returns of multi-turn episodes: ``G_i,k = R_i + sum_{j >= k} r_i,j`` (undiscounted reward-to-go).

    Args:
        rewards: float ``[N]``, each episode's reward ``R_i`` (NaN = invalid sample).
        turn_rewards: float ``[N, K]``, ``r_i,k``: the environment's reward after turn ``k`` (0 where it gave
            none, and past an episode's last turn); finite.

    Returns:
        float64 ``[N, K]``; column 0 is the episode's full return ``R_i + sum_k r_i,k`` (what sequence-level
        losses train on when the environment gives per-turn rewards). NaN rows where ``R_i`` is NaN.

    Raises:
        ValueError: shapes that are not ``[N]`` and ``[N, K]`` with ``K >= 1``, or a non-finite turn reward.
    """
    if rewards.dim() != 1 or turn_rewards.dim() != 2 or turn_rewards.shape[0] != rewards.shape[0] \
            or turn_rewards.shape[1] < 1:
        raise ValueError(f"rewards must be [N] and turn_rewards [N, K>=1], got {tuple(rewards.shape)} and "
                         f"{tuple(turn_rewards.shape)}")
    if not bool(torch.isfinite(turn_rewards).all()):
        bad = torch.nonzero(~torch.isfinite(turn_rewards))[:5].tolist()
        raise ValueError(f"turn_rewards must be finite (0.0 where the environment gave none); got {bad}")
    to_go = turn_rewards.to(torch.float64).flip(-1).cumsum(-1).flip(-1)
    return rewards.to(torch.float64)[:, None] + to_go


def turn_advantages(rewards: Tensor, turn_rewards: Tensor, group_size: int, *, normalize_std: bool = True,
                    eps: float = 1e-6) -> Tensor:
    """Per-turn group-relative advantages of multi-turn episodes (our multi-turn extension of GSPO-token).

    GSPO-token (Zheng et al., arXiv 2507.18071, section 4.3, Eq. 13-14) lets every token ``t`` of a sequence
    carry its own advantage ``A_i,t``, with the sequence's ratio ``s_i`` as its importance ratio; the paper sets
    all ``A_i,t = A_i`` (then it equals GSPO) and gives no rule for per-turn rewards. **Our choice** for
    episodes whose environment rewards single turns: turn ``k`` of episode ``i`` is credited with its
    reward-to-go, ``G_i,k = R_i + sum_{j >= k} r_i,j`` (:func:`turn_returns`), baselined and scaled by the
    statistics of the group's full returns ``G_i,1`` (so that one scale serves every turn of the group)::

        A_i,k = (G_i,k - mean_i(G_i,1)) / (std_i(G_i,1) + eps)     (normalize_std=True, Eq. 6's z-score)
        A_i,k =  G_i,k - mean_i(G_i,1)                             (normalize_std=False, Dr. GRPO)

    with exactly :func:`group_advantages`' conventions (the same float64 code): population std over the
    group's valid samples; an episode with a NaN reward ``R_i`` is invalid (left out of the mean and std,
    advantage 0 on every turn); a group whose valid full returns are all equal, or that has at most one valid
    episode, gets exactly 0 on every turn (its per-turn differences have no group scale to be measured by).
    Without per-turn rewards (all ``r_i,k = 0``) every ``A_i,k`` equals :func:`group_advantages` of ``R``
    bit for bit.

    Args:
        rewards: float ``[N]``, episode rewards ``R_i`` in ``N / group_size`` consecutive groups; NaN = invalid.
        turn_rewards: float ``[N, K]``, ``r_i,k`` (0 where none and past an episode's last turn; finite).
        group_size: episodes per prompt (G), >= 1.
        normalize_std: divide by the group std of the full returns (True) or only subtract their mean.
        eps: added to the std, >= 0.

    Returns:
        ``[N, K]`` advantages in ``rewards``' promoted dtype (float32 for float32 rewards), finite. Columns past
        an episode's last turn hold its ``A_i,1``-style value for ``G = R_i`` and are not used.

    Raises:
        ValueError: as :func:`group_advantages` and :func:`turn_returns`.
    """
    group_size = _check_group_args(rewards, group_size, eps)
    n, k = rewards.shape[0], turn_rewards.shape[-1] if turn_rewards.dim() == 2 else 0
    out_dtype = torch.promote_types(rewards.dtype, torch.float32)
    g = turn_returns(rewards, turn_rewards).view(-1, group_size, k)
    mean, std, valid, degenerate = _group_stats(g[..., 0], normalize_std)
    adv = torch.where(valid[..., None], g - mean[..., None], 0.0)
    if std is not None:
        adv = adv / (std[..., None] + eps)
    adv = torch.where((valid & ~degenerate)[..., None], adv, 0.0)
    return adv.reshape(n, k).to(out_dtype)


def turn_token_advantages(rewards: Tensor, turn_rewards: Sequence[Sequence[float] | None],
                          turn_starts: Sequence[Sequence[int] | None], response_lengths: Sequence[int],
                          group_size: int, *, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Per-token advantages of multi-turn episodes for ``gspo_token``: :func:`turn_advantages` spread over each
    episode's response tokens (its docstring gives the formula, a choice of ours beyond the GSPO paper).

    Turn ``k`` of episode ``i`` owns response tokens ``turn_starts[i][k] .. turn_starts[i][k+1] - 1`` (the last
    turn: to the end): its sampled tokens and the environment's reply after them; all carry ``A_i,k``. The
    environment's tokens are masked out of the loss anyway. An episode without turn data (None) is one turn
    from token 0 with no per-turn reward.

    Args:
        rewards: float ``[N]``, episode rewards ``R_i`` (NaN = invalid), groups of ``group_size`` consecutive.
        turn_rewards: per episode, ``r_i,k`` for each turn (finite; 0.0 where the environment gave none), or None.
        turn_starts: per episode, the index in its response where each turn starts (ascending, first 0, same
            length as its ``turn_rewards``), or None (both None or neither).
        response_lengths: per episode, its response length ``R_i`` (tokens).
        group_size: episodes per prompt (G), >= 1.
        normalize_std, eps: as :func:`turn_advantages`.

    Returns:
        float32 ``[N, max(response_lengths)]`` (float64 for float64 rewards): entry ``[i, j]`` is the advantage of
        response token ``j`` of episode ``i``; 0 past its response.

    Raises:
        ValueError: lists of different lengths, turn data that disagree (see above) or that do not fit the
            response, and the errors of :func:`turn_advantages`.
    """
    n = rewards.shape[0] if rewards.dim() == 1 else -1
    if not len(turn_rewards) == len(turn_starts) == len(response_lengths) == n:
        raise ValueError(f"rewards {tuple(rewards.shape)}, {len(turn_rewards)} turn_rewards, {len(turn_starts)} "
                         f"turn_starts and {len(response_lengths)} response lengths must agree")
    starts = [[0] if s is None else list(s) for s in turn_starts]
    for i, (s, r, length) in enumerate(zip(starts, turn_rewards, response_lengths)):
        if (r is None) != (turn_starts[i] is None) or (r is not None and len(r) != len(s)):
            raise ValueError(f"episode {i}: turn_starts {turn_starts[i]!r} and turn_rewards {r!r} disagree")
        if not s or s[0] != 0 or any(b < a for a, b in zip(s, s[1:])) or s[-1] > max(length, 0):
            raise ValueError(f"episode {i}: turn_starts {s!r} must ascend from 0 within its {length} tokens")
    k = max(len(s) for s in starts) if starts else 1
    table = torch.zeros((n, k), dtype=torch.float64)
    for i, r in enumerate(turn_rewards):
        if r is not None and len(r):
            table[i, : len(r)] = torch.tensor([float(x) for x in r], dtype=torch.float64)
    adv = turn_advantages(rewards, table, group_size, normalize_std=normalize_std, eps=eps)
    out = torch.zeros((n, max(response_lengths, default=0)), dtype=adv.dtype)
    for i, (s, length) in enumerate(zip(starts, response_lengths)):
        for t, lo in enumerate(s):
            out[i, lo : s[t + 1] if t + 1 < len(s) else length] = adv[i, t]
    return out
