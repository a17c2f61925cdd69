"""The driver's side of the health guard: what happens after the learner refuses a step.

The learner ranks decide whether a step is refused (``learner.health``: the checks of ``health.*``, the step
undone exactly). The driver counts refusals in a row, rolls back to the latest checkpoint after
``health.rollback_after`` of them, and stops the run (``HealthStop``, with ``health_report.json``) after
``health.max_rollbacks`` rollbacks with no good step between them, or when there is no checkpoint to go back to.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster.config import Config
from cluster.driver import checkpoint

if TYPE_CHECKING:
    from learner.contracts import RolloutTrainResult

log = logging.getLogger("cluster.train")


class HealthStop(RuntimeError):
    """The health guard's checks kept failing after rolling back; the message names them."""


class GuardPolicy:
    """Counts refused steps and decides rollbacks and the stop (see the module docstring).

    Args:
        cfg: the run config (its ``health`` section).
        run_dir: the run folder (checkpoints; ``health_report.json`` is written there on a stop).
    """

    def __init__(self, cfg: Config, run_dir: Path):
        self.hc = cfg.health
        self.run_dir = run_dir
        self.failures = 0  # refused steps in a row
        self.rollbacks = 0
        self.rollbacks_in_a_row = 0  # rollbacks with no good step between them
        self.log: list[dict[str, Any]] = []

    def good_step(self) -> None:
        """A step the guard let through: the counts in a row start again."""
        self.failures = 0
        self.rollbacks_in_a_row = 0

    def refused(self, step: int, result: RolloutTrainResult, m: dict[str, Any]) -> Path | None:
        """Count refused ``step`` (1-based), the learner's ``result`` naming the failed checks and their reasons;
        the step's metrics ``m`` get ``health/consecutive_failures`` (updated in place).

        Returns:
            the checkpoint to roll back to now, or None (not yet).

        Raises:
            HealthStop: a rollback is due but none is left (``health.max_rollbacks``) or no checkpoint exists.
        """
        self.failures += 1
        self.log.append({"step": step, "checks": ",".join(result.failed_checks), "reasons": result.reasons})
        log.warning("health guard refused step %d (%s); %d in a row", step, result.reasons, self.failures)
        m["health/consecutive_failures"] = float(self.failures)
        if self.failures < self.hc.rollback_after:
            return None
        ck = checkpoint.latest_checkpoint(self.run_dir)
        if ck is None or self.rollbacks_in_a_row >= self.hc.max_rollbacks:
            self.stop(step, ck)
        return ck

    def rolled_back(self, ck: Path, m: dict[str, Any]) -> None:
        """The run went back to checkpoint ``ck``: count it (``health/rollbacks`` in ``m``)."""
        self.rollbacks += 1
        self.rollbacks_in_a_row += 1
        self.failures = 0
        m["health/rollbacks"] = float(self.rollbacks)
        log.warning("health guard: rolled back to %s (rollback %d)", ck, self.rollbacks)

    def stop(self, step: int, ck: Path | None) -> None:
        """Write ``health_report.json`` and stop the run.

        Raises:
            HealthStop: always; the message names the failing checks and the report.
        """
        checks = sorted({c for e in self.log[-self.hc.rollback_after:] for c in e["checks"].split(",") if c})
        report = {"stopped_at_step": step, "failed_checks": checks, "rollbacks": self.rollbacks,
                  "last_checkpoint": str(ck) if ck else None, "recent_failures": self.log[-10:]}
        (self.run_dir / "health_report.json").write_text(json.dumps(report, indent=2))
        raise HealthStop(
            f"health guard: the run stops at step {step}: check(s) {', '.join(checks) or '?'} kept failing"
            + (f" after {self.rollbacks} rollback(s) to {ck}" if ck else " and there is no checkpoint to roll back to")
            + f"; report: {self.run_dir / 'health_report.json'}"
        )
