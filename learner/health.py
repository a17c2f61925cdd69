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


class GuardDecision:
    """The health guard's decision on one rollout batch, in one place.

    The learner step consults it three times: before any optimizer step (``refuse_before_update``), after
    each optimizer step (``stop_after_optimizer_step``) and at the end (``verdict``). Every decision is taken
    from all-reduced values (``all_reduce(values, op)`` sums / maxes float lists over the ranks), so all
    ranks skip or apply a step together. With ``guard=None`` the guard is off and every method says "go on".

    Args:
        guard: a guard dict (see the module docstring) or None.

    Raises:
        ValueError: an invalid guard (see ``validate_guard``).
    """

    def __init__(self, guard: Mapping[str, float] | None):
        self.guard = validate_guard(guard)
        self.failures: list[tuple[str, str]] = []

    @property
    def on(self) -> bool:
        return self.guard is not None

    def refuse_before_update(self, metrics: Mapping[str, object], nonfinite: float) -> bool:
        """Record the pre-update failures (``nonfinite``: non-finite log-probs on response tokens, all ranks)
        and return True when the step must not update at all."""
        if self.guard is None:
            return False
        if nonfinite:
            self.failures.append(("nonfinite_log_probs", f"{int(nonfinite)} non-finite log-probs on response tokens"))
        # A NaN metric caused by those non-finite log-probs is not reported a second time.
        self.failures += [f for f in failed_checks(self.guard, metrics, "pre")
                          if not (nonfinite and not math.isfinite(float(metrics[GUARD_CHECKS[f[0]][0]])))]
        return bool(self.failures)

    def stop_after_optimizer_step(self, bad_loss: bool, grad_norm: float, all_reduce) -> bool:
        """True when training must stop at this optimizer step (a non-finite loss or gradient norm, or a norm
        over ``max_grad_norm``, on any rank). Collective when the guard is on."""
        if self.guard is None:
            return False
        limit = self.guard.get("max_grad_norm", math.inf)
        local = [1.0 if bad_loss else 0.0, 0.0 if math.isfinite(grad_norm) else 1.0, 0.0 if grad_norm <= limit else 1.0]
        flags = all_reduce(local, "max")
        if flags[0]:
            self.failures.append(("nonfinite_loss", "a micro-batch loss is NaN or inf"))
        return any(flags)

    def verdict(self, metrics: dict[str, object], grad_norms: list[float], updated: bool,
                all_reduce) -> tuple[bool, dict[str, object]]:
        """The final decision: ``(skip, health metrics)``. ``updated``: optimizer steps ran (the post-update
        checks apply). Collective when the guard is on; ``(False, {})`` when it is off.

        Health metrics: ``health/skipped`` (0.0 or 1.0), ``health/failed_checks`` (comma-joined names),
        ``health/reasons`` (``"; "``-joined ``name: metric=value > limit``); the caller adds the counts."""
        if self.guard is None:
            return False, {}
        if updated:
            loss = float(metrics["loss/policy"])  # the all-reduced loss sum / steps: finite exactly when the sum is
            if not math.isfinite(loss) and not any(n == "nonfinite_loss" for n, _ in self.failures):
                self.failures.append(("nonfinite_loss", f"loss/policy={loss}"))
            if any(not math.isfinite(g) for g in grad_norms):
                self.failures.append(("nonfinite_grad_norm", f"actor/grad_norm_max={max(grad_norms)}"))
            self.failures += [f for f in failed_checks(self.guard, metrics, "post")
                              if not (f[0] == "max_grad_norm" and not math.isfinite(float(metrics["actor/grad_norm_max"])))]
        # Every rank reaches the same verdict from the same all-reduced values; the extra all-reduce makes the
        # decision collective even if a value differed in the last bit between ranks.
        skip = all_reduce([1.0 if self.failures else 0.0], "max")[0] > 0
        return skip, {
            "health/skipped": 1.0 if skip else 0.0,
            "health/failed_checks": ",".join(n for n, _ in self.failures),
            "health/reasons": "; ".join(f"{n}: {r}" for n, r in self.failures),
        }
