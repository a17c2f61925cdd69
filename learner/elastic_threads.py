"""Elastic torch threads for a learner rank on the CPU: use the cores a colocated service leaves idle.

On a CPU machine the rollout engines and the learner share the cores. In the overlapped step
(``trainer.max_staleness >= 1``) the engine generates the next batch while the learner trains, and when the
engine's generation ends first its cores sit idle for the rest of the learner's update. ``ElasticThreads`` lets
a rank take them: a watcher thread measures, every ``period`` seconds, how many of the cores in its affinity
mask other processes kept busy over that last window (``/proc/stat`` busy time of those cores minus this
process's own CPU time, ``os.times``), and before each micro-batch's forward and before its backward the rank
sets ``torch.set_num_threads`` to the idle cores of the latest window, between ``learner.threads_per_rank`` and
``learner.max_threads_per_rank``; ``attach_layer_hooks`` decides again before every decoder layer's forward
and backward, so the rank takes a core freed in the middle of a micro-batch (on the small workload a backward
lasts over a second) within one layer. A short recent window, not the whole interval since the last decision: a
micro-batch lasts seconds on the CPU, and an interval in which the engine was busy for most of the time would
keep the rank at one thread long after the engine finished. When the engine starts generating again, the next
window sees its core busy and the rank drops back. Never more threads than idle cores: two thread
pools on one core make torch's OpenMP barriers spin (../shared/docs/cpu-stack.md: 10-100x slower).

Linux only (``/proc/stat``); on GPUs the knob is refused by the config. Pure standard library and torch.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

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
    """The thread count of one learner rank, re-decided before every micro-batch's forward and backward (see the
    module docstring).

    Args:
        low: ``learner.threads_per_rank`` (the count at the start of every update, and the floor).
        high: ``learner.max_threads_per_rank`` (the ceiling), >= ``low``.
        period: seconds of a measurement window (at least 0.05: shorter ones hold too few clock ticks).
        watch: run the watcher thread (a daemon, started by the first ``start``); False = the caller closes
            the windows with ``tick`` itself (tests).

    Raises:
        ValueError: not ``1 <= low <= high``.
    """

    def __init__(self, low: int, high: int, period: float = 0.2, watch: bool = True):
        if not 1 <= low <= high:
            raise ValueError(f"threads: need 1 <= threads_per_rank ({low}) <= max_threads_per_rank ({high})")
        self.low, self.high, self.period, self.watch = low, high, max(period, 0.05), watch
        self.cores = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        self.threads = low
        self.changes = 0
        self._since = self._last = time.monotonic()  # the update's start; the last change of the thread count
        self._thread_seconds = 0.0  # threads x seconds since the update's start, up to the last change
        self.recent_idle: float | None = None  # idle cores over the latest complete window
        self._mark: tuple[float, float, float] | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """At the start of an update: back to ``low`` threads (a colocated engine may have started generating
        since the last update) and a fresh window (no decision until it is complete)."""
        self._set(self.low)
        self._since = self._last = time.monotonic()
        self._thread_seconds = 0.0
        with self._lock:
            self._mark, self.recent_idle = self._sample(), None
        if self.watch and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="elastic-threads", daemon=True)
            self._thread.start()

    def tick(self) -> None:
        """Close the current window when it is at least 0.05 s long: record its idle cores, open the next."""
        with self._lock:
            now = self._sample()
            if self._mark is None:
                self._mark = now
                return
            wall = now[0] - self._mark[0]
            if wall >= 0.05:  # shorter intervals hold too few clock ticks to mean anything
                others = (now[1] - self._mark[1]) - (now[2] - self._mark[2])
                self.recent_idle = len(self.cores) - max(others, 0.0) / wall
                self._mark = now

    def adjust(self) -> int:
        """Before a forward or a backward: the thread count for the latest window's idle cores (unchanged
        while no window is complete). Returns it."""
        if self.recent_idle is not None:
            self._set(threads_for(self.recent_idle, self.low, self.high))
        return self.threads

    def _watch(self) -> None:
        while True:
            time.sleep(self.period)
            try:
                self.tick()
            except OSError:  # /proc/stat unreadable: keep the last decision
                pass

    def _sample(self) -> tuple[float, float, float]:
        return time.monotonic(), busy_seconds(self.cores), own_seconds()

    def mean_threads(self) -> float:
        """Torch threads over the time since ``start``, weighted by how long each count held
        (``perf/learner_threads_mean``); the current count when no time has passed."""
        now = time.monotonic()
        if now <= self._since:
            return float(self.threads)
        return (self._thread_seconds + self.threads * (now - self._last)) / (now - self._since)

    def _set(self, n: int) -> None:
        if n != self.threads:
            now = time.monotonic()
            self._thread_seconds += self.threads * (now - self._last)
            self._last = now
            torch.set_num_threads(n)
            self.threads = n
            self.changes += 1


def attach_layer_hooks(model: torch.nn.Module, elastic: ElasticThreads) -> list[Any]:
    """Hooks that call ``elastic.adjust()`` before each decoder layer's forward and before its backward.

    The decoder layers are the modules whose class name ends in ``DecoderLayer`` (transformers' naming). The
    backward's decision is a gradient hook on the layer's output hidden states (the first tensor it returns),
    registered by a forward hook when that output requires grad: it fires when the layer's backward is about
    to run. No change to the autograd graph or to the layers' outputs.

    Args:
        model: the rank's model (a transformers model or a module holding one).
        elastic: the rank's ``ElasticThreads``.

    Returns:
        The hook handles (``handle.remove()`` detaches them); empty when ``model`` has no decoder layers.
    """

    def before_forward(_module, _args) -> None:
        elastic.adjust()

    def before_backward(_grad: torch.Tensor) -> None:  # returns None: the gradient stays as it is
        elastic.adjust()

    def on_output(_module, _args, output) -> None:
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        hidden = next((o for o in outputs if isinstance(o, torch.Tensor)), None)
        if hidden is not None and hidden.requires_grad:
            hidden.register_hook(before_backward)

    handles = []
    for module in model.modules():
        if type(module).__name__.endswith("DecoderLayer"):
            handles.append(module.register_forward_pre_hook(before_forward))
            handles.append(module.register_forward_hook(on_output))
    return handles
