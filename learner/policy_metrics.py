"""The training metrics of :func:`learner.objectives.policy_loss`: the importance ratios' statistics and clip
fractions of one call, and their exact combination across micro-batches and data-parallel ranks.

Pure torch (no Ray, vLLM, DeepSpeed or config imports): ratio units in, a dict of Python floats out. A "unit"
is what a loss takes one ratio over (a sequence for GSPO / GSPO-token, a token for GRPO; see
``learner/loss_registry.py``'s ``RatioUnits``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

# Metric keys that are sums over units (exact to add across micro-batches and ranks).
COUNT_METRICS = (
    "num_sequences",
    "num_tokens",
    "num_ratios",
    "num_clipped",
    "num_clipped_low",
    "num_clipped_high",
    "ratio_sum",
)


@torch.no_grad()
def _ratio_metrics(unit_mask: Tensor, ratio: Tensor, abs_lr: Tensor, clip_lo: Tensor, clip_hi: Tensor) -> dict[str, float]:
    inf = torch.tensor(math.inf, dtype=ratio.dtype, device=ratio.device)
    n = unit_mask.sum().to(ratio.dtype)
    stats = torch.stack(
        [
            n,
            torch.where(unit_mask, ratio, 0.0).sum(),
            torch.where(unit_mask, ratio, inf).min() if ratio.numel() else inf,
            torch.where(unit_mask, ratio, -inf).max() if ratio.numel() else -inf,
            torch.where(unit_mask, abs_lr, 0.0).max() if ratio.numel() else torch.zeros_like(n),
            torch.where(unit_mask, clip_lo, 0.0).sum(),
            torch.where(unit_mask, clip_hi, 0.0).sum(),
        ]
    ).tolist()
    num, ratio_sum, rmin, rmax, lrmax, n_lo, n_hi = stats
    out = {
        "num_ratios": num,
        "ratio_sum": ratio_sum,
        "num_clipped_low": n_lo,
        "num_clipped_high": n_hi,
        "num_clipped": n_lo + n_hi,
        "log_ratio_abs_max": lrmax,
    }
    return _finish_metrics(out, rmin, rmax)


def _finish_metrics(out: dict[str, float], rmin: float, rmax: float) -> dict[str, float]:
    num = out["num_ratios"]
    if num > 0:
        out.update(
            clip_fraction=out["num_clipped"] / num,
            clip_fraction_low=out["num_clipped_low"] / num,
            clip_fraction_high=out["num_clipped_high"] / num,
            ratio_mean=out["ratio_sum"] / num,
            ratio_min=rmin,
            ratio_max=rmax,
        )
    else:
        out.update(clip_fraction=0.0, clip_fraction_low=0.0, clip_fraction_high=0.0, ratio_mean=1.0,
                   ratio_min=1.0, ratio_max=1.0, log_ratio_abs_max=0.0)
    return out


def combine_policy_metrics(parts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Combine :func:`policy_loss` metrics of several micro-batches (or ranks) exactly.

    Sums the ``COUNT_METRICS``, recomputes the fractions and ``ratio_mean`` from the sums, takes the min /
    max of ``ratio_min`` / ``ratio_max`` / ``log_ratio_abs_max`` over the parts that have a unit. The result
    equals the metrics of one :func:`policy_loss` call on all the parts together (up to float rounding of
    ``ratio_sum``). Across ranks, all-reduce the sums (SUM) and the extremes (MIN / MAX) the same way.

    Args:
        parts: metrics dicts returned by :func:`policy_loss` (extra keys are ignored).

    Returns:
        A metrics dict with the same keys as :func:`policy_loss`'s.

    Raises:
        ValueError: ``parts`` is empty or a part lacks one of the keys.
    """
    parts = list(parts)
    if not parts:
        raise ValueError("parts is empty: nothing to combine")
    needed = COUNT_METRICS + ("ratio_min", "ratio_max", "log_ratio_abs_max")
    for i, p in enumerate(parts):
        missing = [k for k in needed if k not in p]
        if missing:
            raise ValueError(f"parts[{i}] lacks metric keys {missing}")
    out = {k: float(sum(p[k] for p in parts)) for k in COUNT_METRICS}
    full = [p for p in parts if p["num_ratios"] > 0]
    rmin = min((p["ratio_min"] for p in full), default=1.0)
    rmax = max((p["ratio_max"] for p in full), default=1.0)
    out["log_ratio_abs_max"] = max((p["log_ratio_abs_max"] for p in full), default=0.0)
    return _finish_metrics(out, rmin, rmax)
