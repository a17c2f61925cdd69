"""Elastic torch threads for a learner rank on the CPU: use the cores a colocated service leaves idle.

On a CPU machine the rollout engines and the learner share the cores. In the overlapped step
(``trainer.max_staleness >= 1``) the engine generates the next batch while the learner trains, and when the
engine's generation ends first its cores sit idle for the rest of the learner's update. ``ElasticThreads`` lets
a rank take them: before each micro-batch it measures, over the interval since its last measurement, how many
of the cores in its affinity mask other processes kept busy (``/proc/stat`` busy time of those cores minus this
process's own CPU time, ``os.times``), and sets ``torch.set_num_threads`` to the idle cores it sees, between
``learner.threads_per_rank`` and ``learner.max_threads_per_rank``. When the engine starts generating again, the
next measurement sees its core busy and the rank drops back. Never more threads than idle cores: two thread
pools on one core make torch's OpenMP barriers spin (../shared/docs/cpu-stack.md: 10-100x slower).

Linux only (``/proc/stat``); on GPUs the knob is refused by the config. Pure standard library and torch.
"""

from __future__ import annotations

import os
import time

import torch

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def busy_seconds(cores: set[int], path: str = "/proc/stat") -> float:
    """CPU seconds the ``cores`` have spent busy since boot (every field of their ``cpuN`` lines in
    ``/proc/stat`` but idle and iowait).

    Raises:
        OSError: ``path`` cannot be read (not Linux).
    """
    total = 0
    with open(path) as f:
        for line in f:
            name, *fields = line.split()
            if not name.startswith("cpu") or name == "cpu":
                continue
            if int(name[3:]) in cores:
                ticks = [int(x) for x in fields[:8]]
                total += sum(ticks) - ticks[3] - ticks[4]
    return total / _TICKS


def own_seconds() -> float:
    """CPU seconds (user + system) this process has used, all its threads."""
    t = os.times()
    return t.user + t.system


def threads_for(idle_cores: float, low: int, high: int) -> int:
    """Threads for ``idle_cores`` cores found idle (this rank's own included): the whole idle cores, a core
    counted when at least 75% of it was idle, clamped to ``[low, high]``."""
    return max(low, min(high, int(idle_cores + 0.25)))


class ElasticThreads:
    """The thread count of one learner rank, re-decided before every micro-batch (see the module docstring).

    Args:
        low: ``learner.threads_per_rank`` (the count at the start of every update, and the floor).
        high: ``learner.max_threads_per_rank`` (the ceiling), >= ``low``.
    """

    def __init__(self, low: int, high: int):
        if not 1 <= low <= high:
            raise ValueError(f"threads: need 1 <= threads_per_rank ({low}) <= max_threads_per_rank ({high})")
        self.low, self.high = low, high
        self.cores = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        self.threads = low
        self.changes = 0
        self._mark: tuple[float, float, float] | None = None

    def start(self) -> None:
        """At the start of an update: back to ``low`` threads (a colocated engine may have started generating
        since the last update) and a fresh measurement interval."""
        self._set(self.low)
        self._mark = self._sample()

    def adjust(self) -> int:
        """Before a micro-batch: measure the interval since the last call and set the thread count. Returns it."""
        now = self._sample()
        if self._mark is not None:
            wall = now[0] - self._mark[0]
            if wall >= 0.05:  # shorter intervals hold too few clock ticks to mean anything
                others = (now[1] - self._mark[1]) - (now[2] - self._mark[2])
                idle = len(self.cores) - max(others, 0.0) / wall
                self._set(threads_for(idle, self.low, self.high))
                self._mark = now
        else:
            self._mark = now
        return self.threads

    def _sample(self) -> tuple[float, float, float]:
        return time.monotonic(), busy_seconds(self.cores), own_seconds()

    def _set(self, n: int) -> None:
        if n != self.threads:
            torch.set_num_threads(n)
            self.threads = n
            self.changes += 1
