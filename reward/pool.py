"""The pool of reward worker actors, used by the driver process.

``RewardPool`` starts ``cfg.num_workers`` Ray actors of ``RewardWorker`` (``cfg.num_cpus_per_worker`` CPUs
each, ``max_restarts`` so Ray restarts a worker process that dies), splits a step's requests into one
contiguous share per worker and gathers the results in request order.

Fault tolerance: a share whose call fails with ``ray.exceptions.RayActorError`` (the worker died mid-call)
is sent again, whole, to the restarted worker (or to a fresh actor in its slot when Ray gave up restarting
it); its results are taken only from the one call that succeeds, so no request is lost or scored twice. A
share that fails ``max_share_attempts`` times is lost to the infrastructure, not to the model: its results have
status ``error``, ``infra_failed="worker_lost"`` and the ``reward.on_infra_failure`` score (NaN by default, never a
silent 0 unless the config asks for it).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from reward.contracts import RewardRequest, RewardResult
from reward.config import RewardConfig
from reward.infra import DETAIL_KEY, Cause, infra_score
from reward.sandbox import warn_plain_once
from reward.worker import RewardWorker

MAX_SHARE_ATTEMPTS = 4
ACTOR_MAX_RESTARTS = 8
RESTART_WAIT_S = 120.0


class RewardPool:
    """Ray actors of ``RewardWorker`` behind one ``score`` call.

    With ``reward.sandbox.backend: plain`` it logs, here in the driver (once per process), what that backend
    does not stop; each worker logs it once more in its own log.

    Args:
        cfg: the ``reward`` config section.
        scheduling_strategy_factory: optional ``f(slot_index) -> scheduling strategy`` (for example a
            placement-group strategy from the driver); None = Ray's default placement.
        call_timeout_s: a worker's score call not done within this many seconds is stuck: ``on_stuck(actor,
            slot)`` is called, the worker replaced and its share sent again, as for a worker that died.
            None: no deadline.
        worker_cls: the worker class (``RewardWorker`` or a subclass of it).
    """

    def __init__(self, cfg: RewardConfig, scheduling_strategy_factory: Callable[[int], Any] | None = None,
                 call_timeout_s: float | None = None, on_stuck: Callable[[Any, int], None] | None = None,
                 worker_cls: type = RewardWorker):
        import ray

        if cfg.sandbox.backend == "plain":
            warn_plain_once()
        self._ray = ray
        self.cfg = cfg
        self._factory = scheduling_strategy_factory
        self._cls = ray.remote(worker_cls)
        self.call_timeout_s = call_timeout_s  # a score call's deadline (None: none); past it the worker is replaced
        self._on_stuck = on_stuck  # told (actor, slot) of a worker past call_timeout_s, before it is replaced
        self._actors: list[Any] = []
        self._counters = self._zero()
        self.resize(cfg.num_workers)

    @staticmethod
    def _zero() -> dict[str, float]:
        return {"reward/timeouts": 0.0, "reward/errors": 0.0, "reward/invalid": 0.0, "reward/time_s": 0.0,
                "fault/reward_restarts": 0.0}

    def _new_actor(self, slot: int):
        opts: dict[str, Any] = {"num_cpus": self.cfg.num_cpus_per_worker, "max_restarts": ACTOR_MAX_RESTARTS,
                                "max_task_retries": 0}
        if self._factory is not None:
            opts["scheduling_strategy"] = self._factory(slot)
        return self._cls.options(**opts).remote(self.cfg)

    @property
    def num_workers(self) -> int:
        return len(self._actors)

    def worker_pids(self) -> list[int]:
        """OS pids of the workers (for tests and fault injection)."""
        return self._ray.get([a.pid.remote() for a in self._actors])

    def resize(self, n: int) -> None:
        """Grow or shrink to ``n`` workers (new ones are ready when this returns).

        Raises:
            ValueError: ``n < 1``.
        """
        if n < 1:
            raise ValueError(f"reward.num_workers must be >= 1, got {n}")
        while len(self._actors) > n:
            self._ray.kill(self._actors.pop(), no_restart=True)
        new = [self._new_actor(slot) for slot in range(len(self._actors), n)]
        self._ray.get([a.pid.remote() for a in new])  # surfaces config errors here, not in the first step
        self._actors.extend(new)

    def _replace(self, slot: int) -> None:
        try:
            self._ray.kill(self._actors[slot], no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self._actors[slot] = self._new_actor(slot)

    def _ensure_alive(self, slot: int) -> None:
        """Wait for Ray to restart the worker in ``slot``; start a fresh actor there if it will not come back
        (restart budget spent) within ``RESTART_WAIT_S``."""
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            self._ray.get(self._actors[slot].pid.remote(), timeout=RESTART_WAIT_S)
        except (RayActorError, GetTimeoutError):
            self._replace(slot)

    def score(self, requests: list[RewardRequest]) -> list[RewardResult]:
        """Score ``requests`` on all workers; results in request order (one per request)."""
        from ray.exceptions import RayActorError

        start = time.monotonic()
        results: list[RewardResult | None] = [None] * len(requests)
        n = len(self._actors)
        bounds = [(len(requests) * k // n, len(requests) * (k + 1) // n) for k in range(n)]
        pending, sent = {}, {}
        for slot, (lo, hi) in enumerate(bounds):
            if hi > lo:
                pending[self._actors[slot].score.remote(requests[lo:hi])] = (slot, lo, hi, 1)
        while pending:
            sent.update({ref: time.monotonic() for ref in pending if ref not in sent})
            ready, stuck = self._wait(pending, sent)
            for ref in ready + stuck:
                slot, lo, hi, attempt = pending.pop(ref)
                try:
                    if ref in stuck:
                        self._stuck(slot)
                    share = self._ray.get(ref)
                except RayActorError as err:
                    self._counters["fault/reward_restarts"] += 1
                    if attempt >= MAX_SHARE_ATTEMPTS:
                        lost = Cause.WORKER_LOST.value
                        share = [RewardResult(infra_score(self.cfg.on_infra_failure), False, "error",
                                              {"error": "WorkerLost", "message": str(err)[:300], DETAIL_KEY: lost},
                                              infra_failed=lost)
                                 for _ in range(lo, hi)]
                    else:
                        if ref not in stuck:
                            self._ensure_alive(slot)
                        pending[self._actors[slot].score.remote(requests[lo:hi])] = (slot, lo, hi, attempt + 1)
                        continue
                results[lo:hi] = share
        for r in results:
            self._counters["reward/timeouts"] += r.status == "timeout"
            self._counters["reward/errors"] += r.status == "error"
            self._counters["reward/invalid"] += not r.valid
        self._counters["reward/time_s"] += time.monotonic() - start
        return results  # type: ignore[return-value]

    def metrics(self) -> dict[str, float]:
        """Counters since the last call (then reset): ``reward/timeouts``, ``reward/errors``,
        ``reward/invalid`` (NaN scores), ``reward/time_s`` (wall seconds in ``score``),
        ``fault/reward_restarts`` (worker deaths seen)."""
        out, self._counters = self._counters, self._zero()
        return out

    def shutdown(self) -> None:
        """Kill all workers (their verifier children die with them)."""
        for a in self._actors:
            try:
                self._ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self._actors = []

    def _wait(self, pending: dict[Any, Any], sent: dict[Any, float]) -> tuple[list[Any], list[Any]]:
        """The next finished share calls, or (when none finished by then) the calls past ``call_timeout_s``:
        ``(ready, stuck)``, one of them empty."""
        if self.call_timeout_s is None:
            return self._ray.wait(list(pending), num_returns=1)[0], []
        due = min(sent[ref] for ref in pending) + self.call_timeout_s
        ready, _ = self._ray.wait(list(pending), num_returns=1, timeout=max(0.0, due - time.monotonic()))
        return ready, ([] if ready else [ref for ref in pending if sent[ref] + self.call_timeout_s <= time.monotonic()])

    def _stuck(self, slot: int) -> None:
        """The worker in ``slot`` is past ``call_timeout_s``: reported (``on_stuck``), then replaced.

        Raises:
            ray.exceptions.RayActorError: always (the share is lost as if the worker had died).
        """
        from ray.exceptions import RayActorError

        if self._on_stuck is not None:
            self._on_stuck(self._actors[slot], slot)
        self._replace(slot)
        raise RayActorError(error_msg=f"reward worker {slot} past its score deadline ({self.call_timeout_s:g}s); "
                            "replaced")
