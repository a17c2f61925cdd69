"""Saving RL steps for the offline ratio audit (``python -m learner.audit RUN_DIR --step N``).

Called by the driver for every step in ``trainer.audit_steps``: ``save_inputs`` before the learner trains on
the step's rollout batch (the behaviour weights are still loaded), ``save_outputs`` after.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def save_inputs(trainer: Any, step: int, batch: Any, plans: list[Any]) -> Path:
    """Save what the step trains on and the weights that generated it; returns the step's audit folder."""
    raise NotImplementedError


def save_outputs(trainer: Any, audit_dir: Path, metrics: dict[str, Any]) -> None:
    """Save what training logged for the step (metrics of the learner)."""
    raise NotImplementedError
