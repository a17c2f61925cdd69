"""An environment that leaves a trace on disk of the episodes under way, for tests that kill a run mid-rollout.

``TracedSlowTool`` is ``reward.envs.slow_tool:SlowTool`` (3-4 slow turns, reward 0) that appends ``start <uid>``
when an episode's environment is built and ``close <uid>`` when it is closed to the file named by the
environment variable ``GSPO_EPISODE_TRACE`` (nothing without it). Env workers inherit the variable from the
driver process that started the local Ray. Each line is one ``os.write`` on an ``O_APPEND`` descriptor, so
lines of concurrent episodes do not interleave and a kill leaves whole lines.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from reward.envs.slow_tool import SlowTool

TRACE_ENV = "GSPO_EPISODE_TRACE"


def _trace(event: str, uid: str) -> None:
    path = os.environ.get(TRACE_ENV)
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{event} {uid}\n".encode())
    finally:
        os.close(fd)


class TracedSlowTool(SlowTool):
    """``SlowTool`` whose episodes are traced (module docstring)."""

    def __init__(self, row: dict, seed: int):
        super().__init__(row, seed)
        self.uid = str(self.row["uid"])
        _trace("start", self.uid)

    def close(self) -> None:
        _trace("close", self.uid)


def open_episodes(path: Path) -> Counter:
    """Episodes started and not closed, counted by row uid (an episode is one of a group's G), from the trace."""
    started, closed = Counter(), Counter()
    if not Path(path).is_file():
        return started
    for line in Path(path).read_text().splitlines():
        event, _, uid = line.partition(" ")
        (started if event == "start" else closed)[uid] += 1
    return +(started - closed)


def started(path: Path) -> Counter:
    """Episodes the trace saw start, counted by row uid."""
    if not Path(path).is_file():
        return Counter()
    return Counter(line.partition(" ")[2] for line in Path(path).read_text().splitlines() if line.startswith("start "))
