"""Group-relative advantages (GSPO paper Eq. 6, as in GRPO). Pure torch."""

from __future__ import annotations

import torch
from torch import Tensor


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
    out_dtype = torch.promote_types(rewards.dtype, torch.float32)

    r = rewards.to(torch.float64).view(-1, group_size)
    valid = ~torch.isnan(r)
    count = valid.sum(-1, keepdim=True)
    r0 = torch.where(valid, r, 0.0)
    mean = r0.sum(-1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(valid, r - mean, 0.0)
    adv = centred
    if normalize_std:
        std = (centred.square().sum(-1, keepdim=True) / count.clamp(min=1)).sqrt()
        adv = centred / (std + eps)
    # Exact zeros: all valid rewards equal (r - mean may be a rounding error), or at most one valid sample.
    r_max = torch.where(valid, r, -torch.inf).amax(-1, keepdim=True)
    r_min = torch.where(valid, r, torch.inf).amin(-1, keepdim=True)
    degenerate = (count <= 1) | (r_max == r_min)
    adv = torch.where(valid & ~degenerate, adv, 0.0)
    return adv.reshape(n).to(out_dtype)
