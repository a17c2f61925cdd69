"""``trained_prompts.jsonl`` in the run folder: which prompts each RL step trained on, one line per step.

A line: ``{"step": k, "uids": [...], "stream_start": a, "stream_end": b, "skipped": false}``: the uids of the
groups step ``k`` trained on (in batch order), the training prompt stream's position before and after the
collection of that step's rollout (the prompts ``[a, b)`` of the stream were handed out for it; with dynamic
sampling some of them were dropped, with partial rollouts some are trained by a later step), and whether the
learner refused the update (the health guard) or had nothing to train. A run resumed from the step-``s``
checkpoint drops the lines after step ``s`` (written after that checkpoint, so trained again), as
``metrics.jsonl`` does: the file then holds each step once, across kills and resumes. A health-guard rollback
(``health/rollbacks`` in ``metrics.jsonl``) undoes the updates of the steps since its checkpoint but keeps
their lines.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FILE = "trained_prompts.jsonl"


def read(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``run_dir``'s file, in file order (a line cut short by a kill is skipped); [] without it."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class TrainedPromptLog:
    """Appends one line per RL step to ``run_dir/trained_prompts.jsonl`` (module docstring).

    Args:
        run_dir: the run folder.
        resume_from_step: when resuming, the checkpoint's step: lines of later steps are dropped. None: a fresh
            run, the file is started anew.
    """

    def __init__(self, run_dir: Path, resume_from_step: int | None = None):
        self.path = Path(run_dir) / FILE
        if resume_from_step is not None:
            kept = [r for r in read(run_dir) if int(r.get("step", 0)) <= resume_from_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        elif self.path.exists():
            self.path.unlink()

    def log(self, step: int, uids: list[str], stream_start: int, stream_end: int, skipped: bool) -> None:
        """Append step ``step``'s line (one write, so a kill leaves a whole line or a cut one that ``read`` skips)."""
        rec = {"step": int(step), "uids": list(uids), "stream_start": int(stream_start),
               "stream_end": int(stream_end), "skipped": bool(skipped)}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
