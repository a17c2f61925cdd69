"""The env workers of multi-turn episodes (``reward.env_worker.EnvWorker`` actors) as one pool: started in
their placement groups, replaced when their process dies or holds too many abandoned tool threads, resized
between steps (``control.yaml``). The agent loop (``cluster/driver/agent_loop.py``) plays its episodes on them.
"""

from __future__ import annotations

import logging

import ray

from cluster.config import Config
from cluster.runtime import deadlines

log = logging.getLogger("cluster.train")


class EnvPool:
    """``env.num_workers`` env workers (``reward.env_worker.EnvWorker`` actors) in their placement groups; a
    worker whose process died, or that holds more than ``env.max_abandoned_threads`` abandoned tool threads
    (``maintain``, between rounds), is replaced in a fresh group (``replace``); ``resize`` follows
    ``control.yaml``'s ``env.num_workers`` between steps."""

    def __init__(self, cfg: Config, scheduling_strategy_factory):
        self.cfg, self.factory = cfg, scheduling_strategy_factory
        self.workers = [self._start(i) for i in range(cfg.env.num_workers)]
        self._started(self.workers)  # an env class that does not import fails here
        self.restarts = 0  # workers replaced since the start

    def _start(self, slot: int):
        from reward.env_worker import EnvWorker

        ec = self.cfg.env
        cls = deadlines.hang_hook(EnvWorker, ("start", "step"), "env", self.cfg.deadlines)  # debug_hang=env only
        return ray.remote(cls).options(num_cpus=ec.num_cpus_per_worker, max_concurrency=64,
                                             scheduling_strategy=self.factory(slot)).remote(ec, self.cfg.reward)

    def _started(self, workers: list) -> None:
        """Wait for ``workers`` to answer (started) within ``deadlines.start_s``.

        Raises:
            cluster.runtime.deadlines.PhaseTimeout: one did not answer in time.
        """
        deadlines.get([w.pid.remote() for w in workers], workers, "start", self.cfg.deadlines.start_s,
                      "deadlines.start_s")

    def replace(self, slot: int) -> None:
        """End the worker in ``slot`` (its open episodes are lost) and start a new one there."""
        try:
            ray.kill(self.workers[slot], no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.workers[slot] = self._start(slot)
        self._started([self.workers[slot]])
        self.restarts += 1

    def maintain(self) -> int:
        """Between rounds (no episode open): replace every worker holding more than ``env.max_abandoned_threads``
        abandoned threads (tool calls past their deadline that never returned); returns how many."""
        limit, replaced = self.cfg.env.max_abandoned_threads, 0
        held_by = deadlines.get([w.abandoned_threads.remote() for w in self.workers], list(self.workers), "env",
                                self.cfg.deadlines.env_s, "deadlines.env_s")
        for slot, held in enumerate(held_by):
            if held > limit:
                log.warning("env worker %d holds %d abandoned tool threads (> env.max_abandoned_threads=%d): "
                            "replaced", slot, held, limit)
                self.replace(slot)
                replaced += 1
        return replaced

    def resize(self, n: int) -> None:
        """Grow or shrink to ``n`` workers between steps (no episode open; new ones are ready when this returns).

        Raises:
            ValueError: ``n < 1``.
        """
        if n < 1:
            raise ValueError(f"env.num_workers must be >= 1, got {n}")
        while len(self.workers) > n:
            ray.kill(self.workers.pop(), no_restart=True)
            if hasattr(self.factory, "remove"):
                self.factory.remove(len(self.workers))
        new = [self._start(slot) for slot in range(len(self.workers), n)]
        self._started(new)
        self.workers += new

    def take_metrics(self) -> dict[str, float]:
        """The workers' ``env/*`` counters since the last call, summed over workers (``EnvWorker.metrics``:
        episodes by how they ended, turns, seconds, tool errors, OpenEnv server restarts, ...;
        ``env/abandoned_threads``, a gauge, summed too). A worker that does not answer is left out."""
        out: dict[str, float] = {}
        for ref in [w.metrics.remote() for w in self.workers]:
            try:
                counters = ray.get(ref, timeout=30)
            except Exception:  # noqa: BLE001 - a dead worker's counters are lost with it
                continue
            for k, v in counters.items():
                out[k] = out.get(k, 0.0) + float(v)
        return out

    def __len__(self) -> int:
        return len(self.workers)

    def shutdown(self) -> None:
        """Close every open episode and end the workers."""
        for w in self.workers:
            try:
                ray.get(w.close.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - a dead worker has nothing left to close
                pass
            ray.kill(w)
        self.workers = []
