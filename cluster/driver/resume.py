"""The driver's state in a checkpoint, and a run resumed from it.

A checkpoint folder (``cluster.driver.checkpoint``: written atomically) holds the learner's own checkpoint
(``learner/``), ``trainer_state.json`` (the ``DriverState`` below, the config and the data fingerprint) and, in
the overlapped mode (``trainer.max_staleness=1``), the rollout collected ahead of the learner
(``pending_rollout.pkl``: sampled with weights no checkpoint holds, so it is kept rather than regenerated; it is
the driver's own object written by this code and read back only from the run's own folder).
"""

from __future__ import annotations

import logging
import pickle
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.config import Config
from cluster.driver import checkpoint
from cluster.driver.collect import Collected

log = logging.getLogger("cluster.train")

PENDING_FILE = "pending_rollout.pkl"  # in a checkpoint: the rollout collected ahead of the learner (max_staleness=1)
PARTIAL_FILE = "partial_rollouts.pkl"  # in a checkpoint: partial rollouts' in-flight samples (PartialBuffer)
TOKENS_FILE = "token_records.pkl"  # in a checkpoint: the engines' turn records not yet checked (TokenCheck)


@dataclass
class DriverState:
    """What the driver needs besides the learner's checkpoint to continue a run exactly."""

    step: int = 0  # RL steps done
    weight_version: int = 0  # the engines' (and learner's) weight version
    warm_start_done: bool = False
    stream_position: int = 0  # prompts taken from the training stream
    sft_rng: Any = None  # ``random.Random.getstate()`` of the warm start's row sampler (None: not started)
    # learner.old_logprob_source=auto (cluster.driver.behaviour): the RL step whose check switched to the
    # learner's recomputed log-probs and the gap it measured (nats per token); None while it has not
    recompute_since: int | None = None
    recompute_gap: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The state as ``trainer_state.json`` keys."""
        return {"step": self.step, "weight_version": self.weight_version, "warm_start_done": self.warm_start_done,
                "stream_position": self.stream_position, "sft_rng": self.sft_rng,
                "recompute_since": self.recompute_since, "recompute_gap": self.recompute_gap}

    @classmethod
    def from_json(cls, state: dict[str, Any]) -> DriverState:
        """The state read back from ``trainer_state.json`` (JSON lists of the RNG state back to tuples; a
        checkpoint written before ``recompute_since`` existed reads as not switched).

        Raises:
            KeyError: a key missing from ``state``.
        """
        since, gap = state.get("recompute_since"), state.get("recompute_gap")
        return cls(int(state["step"]), int(state["weight_version"]), bool(state["warm_start_done"]),
                   int(state["stream_position"]), _as_tuples(state["sft_rng"]),
                   None if since is None else int(since), None if gap is None else float(gap))

    def restore_rng(self, rng: random.Random) -> None:
        """Put the warm start's sampler back where the checkpoint left it."""
        if self.sft_rng is not None:
            rng.setstate(self.sft_rng)


def _as_tuples(state: Any) -> Any:
    """random.Random state from JSON (lists back to tuples)."""
    if isinstance(state, list):
        return tuple(_as_tuples(x) for x in state)
    return state


@dataclass
class ResumePoint:
    """A checkpoint a run continues from: its folder, the driver's state and the rollout collected ahead."""

    path: Path
    state: DriverState
    pending: Collected | None
    partial: Any = None  # the PartialBuffer in flight at the checkpoint (trainer.partial_rollouts), or None
    token_records: Any = None  # the token check's pool at the checkpoint (TokenCheck.state), or None


def find_resume_point(cfg: Config, run_dir: Path, fingerprint: dict[str, Any]) -> ResumePoint | None:
    """The latest complete checkpoint of ``run_dir`` when ``trainer.resume`` is on, checked against ``cfg``
    before any actor starts; None when there is none (a fresh run).

    Raises:
        ConfigError: the config or the data cannot continue this run (``checkpoint.check_resume`` names it).
    """
    path = checkpoint.latest_checkpoint(run_dir) if cfg.trainer.resume else None
    if path is None:
        return None
    saved = checkpoint.read_state(path)
    checkpoint.check_resume(saved, cfg, fingerprint, checkpoint.read_learner_state(path))
    pending_file = path / PENDING_FILE
    pending = pickle.loads(pending_file.read_bytes()) if pending_file.is_file() else None
    partial_file = path / PARTIAL_FILE
    partial = pickle.loads(partial_file.read_bytes()) if partial_file.is_file() else None
    tokens_file = path / TOKENS_FILE
    tokens = pickle.loads(tokens_file.read_bytes()) if tokens_file.is_file() else None
    return ResumePoint(path, DriverState.from_json(saved), pending, partial, tokens)


def save_checkpoint(run_dir: Path, cfg: Config, learners: Any, state: DriverState, pending: Collected | None,
                    fingerprint: dict[str, Any], partial: Any = None, token_records: Any = None) -> Path:
    """Write a checkpoint of the learner (``learners``: ``LearnerGroup``) and the driver's state, atomically
    renamed when complete, keeping ``trainer.keep_checkpoints``; ``partial``: partial rollouts' in-flight
    ``PartialBuffer`` (kept with its token versions, so a resumed run continues them); ``token_records``: the token
    check's pool (``TokenCheck.state``: the rollout collected ahead is checked after a resume). Returns the final
    folder."""
    tmp = checkpoint.temp_dir_for(run_dir, state.step)
    learners.save_checkpoint(str(tmp / "learner"))
    if pending is not None:  # sampled with weights no checkpoint holds: kept, not regenerated
        (tmp / PENDING_FILE).write_bytes(pickle.dumps(pending))
    if partial is not None:
        (tmp / PARTIAL_FILE).write_bytes(pickle.dumps(partial))
    if token_records is not None:
        (tmp / TOKENS_FILE).write_bytes(pickle.dumps(token_records))
    saved = {**state.to_json(), "config": cfg.model_dump(mode="json"), "data_fingerprint": fingerprint}
    final = checkpoint.finalize(run_dir, tmp, state.step, saved, cfg.trainer.keep_checkpoints)
    log.info("checkpoint written: %s", final)
    return final
