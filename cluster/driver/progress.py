"""The step loop's progress (a rich bar on a terminal, a log line per step otherwise) and the run's summary."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from cluster.driver.tracking import progress_line

log = logging.getLogger("cluster.train")


def run_with_progress(done: int, total: int, step: Callable[[], dict[str, Any]]) -> None:
    """Call ``step`` (one RL step, evaluation and logging; returns the step's metrics) until ``total`` steps
    are done, starting from ``done``, showing each step's line. ``GSPO_PROGRESS=0`` off a terminal: no bar."""
    with Progress(
        TextColumn("[bold]step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("{task.fields[line]}"),
        TimeElapsedColumn(),
        disable=not sys.stderr.isatty() and os.environ.get("GSPO_PROGRESS", "1") == "0",
    ) as progress:
        task = progress.add_task("rl", total=total, completed=done, line="")
        while done < total:
            m = step()
            done = int(m["step"])
            progress.update(task, completed=done, line=progress_line(m))
            if not sys.stderr.isatty():
                log.info("step %d/%d | %s", done, total, progress_line(m))


def summarize(history: list[dict[str, Any]], summary: dict[str, Any]) -> dict[str, Any]:
    """Add the held-out figures of a run's metrics ``history`` to ``summary`` (in place; returned):
    ``eval/accuracy_start|final|best`` and, with sampled evaluation, each ``eval/pass@k`` / ``eval/mean@k``'s
    start and final."""
    evals = [r["eval/accuracy"] for r in history if r.get("eval/accuracy") is not None]
    if evals:
        summary.setdefault("eval/accuracy_start", evals[0])
        summary["eval/accuracy_final"] = evals[-1]
        summary["eval/accuracy_best"] = max(evals)
    sampled = [r for r in history if any(k.startswith("eval/pass@") for k in r)]
    for key in [k for k in (sampled[-1] if sampled else {}) if k.startswith(("eval/pass@", "eval/mean@"))]:
        summary.setdefault(f"{key}_start", sampled[0].get(key))
        summary[f"{key}_final"] = sampled[-1][key]
    return summary
