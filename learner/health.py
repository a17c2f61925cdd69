"""Health-guard checks of one learner step: which thresholds a step's metrics break.

Pure Python (no torch, Ray or DeepSpeed). The learner service (``LearnerRank.train_rollout_batch(...,
guard=...)``) evaluates these on values that are already identical on every rank (all-reduced), so every rank
takes the same decision, and skips the step's update when any check fails.

Guard dict (all keys optional; an empty dict still enables the non-finite checks):

=========================  ===================================================  ================================
key                        fails when                                           metric checked
=========================  ===================================================  ================================
``max_grad_norm``          any optimizer step's pre-clip global grad norm >     ``actor/grad_norm_max``
``max_clip_fraction``      the step's clip fraction >                           ``actor/clip_fraction``
``max_logprob_diff``       mean abs(learner - rollout log-prob) pre-update >    ``actor/train_rollout_logprob_diff``
``min_entropy``            mean token entropy of the pre-update policy <        ``actor/entropy``
``max_load_imbalance``     MoE only: the worst layer's max/mean expert load >   ``moe/load_imbalance_max``
=========================  ===================================================  ================================

Always checked when a guard is given (check names): ``nonfinite_log_probs`` (a NaN/inf learner or rollout
log-prob on a response token, pre-update), ``nonfinite_loss`` (a micro-batch loss), ``nonfinite_grad_norm``.
A threshold check on a NaN value fails too (comparisons are written so that NaN never passes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

# key -> (metric checked, "max" | "min", phase): "pre" checks run before any optimizer step, "post" after.
GUARD_CHECKS: dict[str, tuple[str, str, str]] = {
    "max_logprob_diff": ("actor/train_rollout_logprob_diff", "max", "pre"),
    "min_entropy": ("actor/entropy", "min", "pre"),
    "max_load_imbalance": ("moe/load_imbalance_max", "max", "pre"),
    "max_grad_norm": ("actor/grad_norm_max", "max", "post"),
    "max_clip_fraction": ("actor/clip_fraction", "max", "post"),
}
NONFINITE_CHECKS = ("nonfinite_log_probs", "nonfinite_loss", "nonfinite_grad_norm")


def validate_guard(guard: Mapping[str, float] | None) -> dict[str, float] | None:
    """Check a guard dict and return it with float values (None stays None: no guard).

    Raises:
        ValueError: an unknown key (naming it and the known ones), or a threshold that is not a finite number
            (``max_*`` must also be >= 0).
    """
    if guard is None:
        return None
    out: dict[str, float] = {}
    for key, value in dict(guard).items():
        if key not in GUARD_CHECKS:
            raise ValueError(f"guard key {key!r} is unknown; known keys: {sorted(GUARD_CHECKS)}")
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"guard[{key!r}]={value!r} must be a number") from None
        if not math.isfinite(v) or (key.startswith("max_") and v < 0):
            raise ValueError(f"guard[{key!r}]={value!r} must be a finite number" + (" >= 0" if key.startswith("max_") else ""))
        out[key] = v
    return out


def failed_checks(guard: Mapping[str, float], metrics: Mapping[str, object], phase: str) -> list[tuple[str, str]]:
    """The threshold checks of ``phase`` that ``metrics`` fail.

    Args:
        guard: a validated guard dict.
        metrics: the step's metrics (keys as in ``GUARD_CHECKS``); a check whose metric is absent (e.g. the
            load imbalance of a dense model) is not evaluated.
        phase: ``"pre"`` or ``"post"``.

    Returns:
        ``[(check name, human-readable reason), ...]`` in ``GUARD_CHECKS`` order, e.g.
        ``("max_grad_norm", "actor/grad_norm_max=1.2e+05 > 100")``.
    """
    failed = []
    for key, (metric, kind, when) in GUARD_CHECKS.items():
        if when != phase or key not in guard or metric not in metrics:
            continue
        value, limit = float(metrics[metric]), float(guard[key])
        ok = value <= limit if kind == "max" else value >= limit  # NaN fails both
        if not ok:
            failed.append((key, f"{metric}={value:.6g} {'>' if kind == 'max' else '<'} {limit:.6g}"))
    return failed
