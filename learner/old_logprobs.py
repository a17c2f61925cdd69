"""Where a step's behaviour (old) log-probs come from: ``learner.old_logprob_source`` and the rule of its ``auto``.

``rollout`` takes the engine's log-probs as it sampled; ``recompute`` the learner's own forward at the weights
before the update (the pre-update pass). ``auto`` (the default) takes the engine's while they agree with the
learner's: on the mismatch monitor's steps (``LearnerConfig.gap_check_at``) the step is a *check*: the pass runs
over the whole batch before training, the gap (mean |learner - engine log-prob| per response token, nats) is
compared with ``learner.max_rollout_logprob_gap``, and above it the step trains on the log-probs it just
recomputed and every later step recomputes them (the switch is sticky: a gap from a bf16 side, another kernel or
a drifted engine is a property of the run, not of one batch, and a rule that switched back could flap between
objectives mid-run). The driver holds the switch (``cluster.driver.behaviour``), passes each step's source to
every rank and checkpoints it, so every rank takes the same decision and a resumed run the same as the
uninterrupted one.

Torch-free and pure: plain values in, plain values out.
"""

from __future__ import annotations

import math

ROLLOUT, RECOMPUTE, CHECK = "rollout", "recompute", "check"
#: a step's source as the driver passes it to the ranks: the engine's, the learner's, or measure and choose
STEP_SOURCES = (ROLLOUT, RECOMPUTE, CHECK)


def step_source(configured: str, recompute_since: int | None, check_due: bool) -> str:
    """The behaviour log-probs' source of one RL step.

    Args:
        configured: ``learner.old_logprob_source`` (``auto``, ``rollout`` or ``recompute``).
        recompute_since: ``auto`` only: the RL step (1-based) whose check switched to the learner's log-probs,
            None while it has not.
        check_due: ``auto`` only: whether this step is a check step (``LearnerConfig.gap_check_at``).

    Returns:
        ``rollout`` or ``recompute`` as configured; under ``auto``: ``recompute`` once switched, else ``check``
        on a check step, else ``rollout``.

    Raises:
        ValueError: ``configured`` is none of the three.
    """
    if configured in (ROLLOUT, RECOMPUTE):
        return configured
    if configured != "auto":
        raise ValueError(f"learner.old_logprob_source={configured!r} is not one of 'auto', 'rollout', 'recompute'")
    if recompute_since is not None:
        return RECOMPUTE
    return CHECK if check_due else ROLLOUT


def mean_gap(abs_sum: float, count: float) -> float:
    """The gap as a mean over response tokens: ``abs_sum`` (sum of |learner - engine log-prob|, nats) over
    ``count`` tokens; 0.0 when there are none (nothing measured reads as no disagreement)."""
    return abs_sum / count if count else 0.0


def gap_too_large(gap: float, bound: float) -> bool:
    """Whether a check step's measured ``gap`` (nats per token) calls for the learner's log-probs: above
    ``bound`` (``learner.max_rollout_logprob_gap``; equal is within), or not a number (NaN: a non-finite
    log-prob on either side is no evidence that they agree). +inf is above any bound."""
    return not gap <= bound


def switch_message(step: int, gap: float, bound: float) -> str:
    """The one log line of the switch: the step, the measured gap and the bound, and what follows."""
    shown = f"{gap:.3g}" if math.isfinite(gap) else str(gap)
    return (f"step {step}: engine/learner log-prob gap {shown} nats per token > learner.max_rollout_logprob_gap="
            f"{bound:.3g} (learner.old_logprob_source=auto): the behaviour log-probs are the learner's own "
            f"(recomputed by the pre-update pass) from this step on; a bf16 side, another kernel or a drifted "
            f"engine makes such a gap")
