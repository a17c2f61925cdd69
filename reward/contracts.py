"""Contracts of the reward service: a completion to score and its verdict.

Plain dataclasses (see ``rollout.contracts`` for the flow of one step). ``RewardRequest.row`` is the
``rollout.contracts.PromptRow`` the completion answers; the reward service reads its ``uid``, ``answer``,
``verifier`` and ``meta`` only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # type only: the reward service imports no other service at run time
    from rollout.contracts import PromptRow


@dataclass
class RewardRequest:
    """One completion to score: the response text and the row it answers."""

    response: str
    row: PromptRow
    num_response_tokens: int = 0
    truncated: bool = False


@dataclass
class RewardResult:
    """The verdict on one completion.

    Attributes:
        score: the reward (float). NaN marks an invalid sample (verifier failure where training should not
            treat it as wrong); it gets advantage 0 and is left out of its group's statistics.
        correct: whether the primary verifier judged the answer right (for the accuracy metric).
        status: ``"ok"``, ``"timeout"`` or ``"error"``.
        detail: short reason for a non-ok status, or extra fields a verifier returned.
        elapsed_s: wall-clock seconds spent verifying.
        infra_failed: why the reward could not be computed when the model's output is not the reason (a
            ``reward.infra.Cause`` value: ``worker_lost``, ``service_timeout``, ...), else ``""``; such a sample is
            scored by ``reward.on_infra_failure`` (NaN by default) and counted in ``reward/infra_failed``.
    """

    score: float
    correct: bool = False
    status: str = "ok"
    detail: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0
    infra_failed: str = ""

    @property
    def valid(self) -> bool:
        """False when the score is NaN (an invalid sample)."""
        return not math.isnan(self.score)
