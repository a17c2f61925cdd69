"""The driver's side of ``learner.old_logprob_source``: each RL step's behaviour log-probs' source, and auto's
switch to the learner's recomputed log-probs, kept in the ``DriverState`` (so in every checkpoint).

The rule is ``learner.old_logprobs``'s; here it is applied by the global RL step, the same for every rank (each
gets the step's source as an argument), and the switch is recorded once, from the step's all-reduced metrics.
A resumed run reads the switch back from ``trainer_state.json`` and continues with the sources the uninterrupted
run would have used.
"""

from __future__ import annotations

from typing import Any

from learner.old_logprobs import CHECK, step_source, switch_message


def source_for_step(learner_cfg: Any, state: Any, step: int) -> str:
    """The source of RL step ``step`` (1-based): ``rollout``, ``recompute`` or ``check``
    (``learner.old_logprobs.step_source``) from ``learner_cfg`` (``LearnerConfig``) and ``state.recompute_since``
    (``DriverState``)."""
    return step_source(learner_cfg.old_logprob_source, state.recompute_since, learner_cfg.gap_check_at(step - 1))


def record_step(learner_cfg: Any, state: Any, step: int, source: str, metrics: dict[str, Any]) -> str | None:
    """After RL step ``step`` trained with ``source``: when it was a check that took the recomputed log-probs
    (``actor/old_logprob_recomputed`` 1 in the learner's ``metrics``), set ``state.recompute_since`` and
    ``state.recompute_gap`` and return the line to log (``switch_message``: the gap, the bound, the step); else
    None. A check the health guard then refused still switches: the gap was measured before any update."""
    if source != CHECK or not metrics.get("actor/old_logprob_recomputed"):
        return None
    gap = float(metrics.get("actor/old_logprob_gap", float("nan")))
    state.recompute_since, state.recompute_gap = step, gap
    return switch_message(step, gap, learner_cfg.max_rollout_logprob_gap)


def unchecked_warning(learner_cfg: Any) -> str | None:
    """The start-of-run warning when ``old_logprob_source='auto'`` can never check (no monitored step:
    ``mismatch_monitor_every=0`` or ``pre_update_pass='never'``), so the engine's log-probs are used unchecked;
    else None."""
    if learner_cfg.old_logprob_source != "auto" or learner_cfg.gap_check_at(0):
        return None
    return ("learner.old_logprob_source=auto with no monitored step (learner.mismatch_monitor_every="
            f"{learner_cfg.mismatch_monitor_every}, learner.pre_update_pass={learner_cfg.pre_update_pass}): the "
            "engine's log-probs are the behaviour log-probs, unchecked; set learner.old_logprob_source=rollout "
            "to say so, or mismatch_monitor_every >= 1 to have them checked")
