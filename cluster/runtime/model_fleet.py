"""The engines of a fixed model: a model the run serves but never trains (the LLM judge's, ``reward.judge``;
on-policy distillation's teacher, ``distill``), in vLLM engines of its own.

``ModelFleet`` starts ``num_engines`` engine actors, each in a placement group of its own
(``cluster.runtime.services.start_engine``, as the rollout fleet's), cuts a batch of work into contiguous shares,
one batched call per engine (``dispatch``), and gathers the answers within the section's ``timeout_s``
(``PendingCalls.wait``): the share of an engine that raised, died or did not answer in time comes back as a
``CallFailure`` (its samples become invalid where the caller uses them), and an engine that died or timed out is
replaced. Nothing here raises for a failing engine after the fleet has started.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group

from cluster.config_sections import DeadlinesConfig
from cluster.runtime import deadlines
from cluster.runtime.services import start_engine
from reward.config import ServedModelConfig
from rollout.config import RolloutConfig

log = logging.getLogger(__name__)
HANG_METHODS = {"judge": ("judge",), "teacher": ("sequences_logprobs",)}  # what deadlines.debug_hang hangs, by role


def served_rollout_config(sm: ServedModelConfig, *, max_tokens: int, seed: int = 0) -> RolloutConfig:
    """The ``rollout`` settings an engine of the fixed model ``sm`` runs with: its engine keys, ``max_tokens``
    generated tokens at most, eager and in-process (a fixed model's engine never loads new weights).

    Raises:
        pydantic.ValidationError: ``sm.max_model_len`` unset (``distill`` before the config resolved it).
    """
    return RolloutConfig(num_engines=sm.num_engines, num_cpus_per_engine=sm.num_cpus_per_engine,
                         node_resources=dict(sm.node_resources), threads_per_engine=sm.threads_per_engine,
                         dtype=sm.dtype, max_model_len=sm.max_model_len, kv_cache_gb=sm.kv_cache_gb, seed=seed,
                         max_response_tokens=max_tokens, enforce_eager=True, in_process=True)


@dataclass(frozen=True)
class CallFailure:
    """An engine's share that got no answer: ``status`` ``"timeout"`` (past ``timeout_s``) or ``"error"`` (the
    engine raised or died); ``error`` the exception's name, ``message`` its text (at most 300 characters)."""

    status: str
    error: str
    message: str


class ModelFleet:
    """Engines of one fixed model (see the module docstring).

    Args:
        settings: the model's section (``reward.judge``, ``distill``): engine keys and ``timeout_s``.
        model_path: the model's folder (``cluster.models.resolve.ensure_model`` of ``settings.model_path``).
        cache_dir: where each engine's vLLM caches go (``<cache_dir>/<role><i>``).
        placement_timeout_s: ``cluster.placement_timeout_s``.
        engine_cls: the engine class (``rollout.engine.RolloutEngine`` or a subclass).
        role: names the engines in logs and cache folders (``"judge"``, ``"teacher"``).
        max_tokens: tokens an engine call generates at most (``max_response_tokens`` of its settings).
        seed: the engines' sampler seed.
        wait: wait here until every engine has loaded the model; False: the caller calls ``wait_ready`` (the
            engines load meanwhile, beside the run's other services).
        run_deadlines: the run's ``deadlines`` section: the engines' ``start_s`` and the test hook ``debug_hang``
            (``judge``, ``teacher``); None: the defaults, no hook.

    Raises:
        PlacementTimeout, or the engine's own error: an engine that cannot start stops the run here (the engines
            started are shut down first).
    """

    def __init__(self, settings: ServedModelConfig, model_path: str, cache_dir: Path, placement_timeout_s: float,
                 *, engine_cls: type, role: str, max_tokens: int, seed: int = 0, wait: bool = True,
                 run_deadlines: Any = None):
        self.settings = settings
        self.model_path = str(model_path)
        self.cache_dir = Path(cache_dir)
        self.placement_timeout_s = placement_timeout_s
        self.engine_cls = engine_cls
        self.role = role
        self.rollout_config = served_rollout_config(settings, max_tokens=max_tokens, seed=seed)
        self.engines: list[Any] = []
        self.groups: list[Any] = []
        self._next_index = 0
        self.replaced = 0  # engines replaced after a timeout or death
        self.deadlines = run_deadlines  # the run's deadlines section: start_s, debug_hang (None: defaults, no hook)
        try:
            for _ in range(settings.num_engines):
                actor, pg = self._start_one()
                self.engines.append(actor)
                self.groups.append(pg)
        except BaseException:
            self.shutdown()
            raise
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until every engine has loaded the model.

        Raises:
            the engine's error (``ray.exceptions.RayActorError``), or ``PhaseTimeout`` past ``deadlines.start_s``:
                an engine that cannot start stops the run here, after every engine of the fleet was shut down.
        """
        limit = self.deadlines.start_s if self.deadlines is not None else DeadlinesConfig().start_s
        try:
            deadlines.get([e.pid.remote() for e in self.engines], list(self.engines), "start", limit,
                          "deadlines.start_s")
        except BaseException:
            self.shutdown()
            raise

    def _start_one(self) -> tuple[Any, Any]:
        index, self._next_index = self._next_index, self._next_index + 1
        engine_cls = deadlines.hang_hook(self.engine_cls, HANG_METHODS.get(self.role, ()), self.role, self.deadlines)
        return start_engine(engine_cls, self.model_path, self.rollout_config, index=index,
                            cache_dir=self.cache_dir / f"{self.role}{index}", what=f"{self.role} engine",
                            placement_timeout_s=self.placement_timeout_s)

    def _replace(self, slot: int) -> None:
        try:
            ray.kill(self.engines[slot])
            remove_placement_group(self.groups[slot])
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.engines[slot], self.groups[slot] = self._start_one()
        self.replaced += 1

    def dispatch(self, method: str, items: list[Any], *args: Any) -> "PendingCalls":
        """Call ``method(share, *args)`` on every engine, ``share`` a contiguous slice of ``items`` (engine ``k``
        of ``n`` takes ``items[len * k // n : len * (k + 1) // n]``; an empty share makes no call); gather with
        ``PendingCalls.wait``. The call must return one answer per item of its share, in order."""
        n = len(self.engines)
        calls: dict[Any, tuple[int, range]] = {}
        for slot in range(n):
            share = range(len(items) * slot // n, len(items) * (slot + 1) // n)
            if len(share):
                ref = getattr(self.engines[slot], method).remote([items[i] for i in share], *args)
                calls[ref] = (slot, share)
        return PendingCalls(self, len(items), calls, time.monotonic())

    def shutdown(self) -> None:
        """Stop every engine and remove its placement group. Idempotent."""
        for actor, pg in zip(self.engines, self.groups):
            try:
                ray.get(actor.shutdown.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - dead or hung: killed below
                pass
            ray.kill(actor)
            remove_placement_group(pg)
        self.engines, self.groups = [], []


class PendingCalls:
    """Engine calls under way (``ModelFleet.dispatch``): ``wait`` gathers them within the settings' ``timeout_s``
    of their start."""

    def __init__(self, fleet: ModelFleet, count: int, calls: dict[Any, tuple[int, range]], started: float):
        self.fleet, self.count, self.calls, self.started = fleet, count, calls, started

    def wait(self) -> list[Any]:
        """One entry per item, in order: the engine's answer, or a ``CallFailure`` for the shares of engines that
        raised or died (``"error"``) or were past the deadline (``"timeout"``); the engines that timed out or died
        are replaced (one that cannot be replaced now is logged and tried again at its next failure)."""
        fleet = self.fleet
        out: list[Any] = [CallFailure("error", "NoEngine", f"no {fleet.role} engine took it")] * self.count
        deadline = self.started + fleet.settings.timeout_s
        pending, broken = dict(self.calls), set()
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            slot, share = pending.pop(ready[0])
            try:
                answers = ray.get(ready[0])
                if len(answers) != len(share):
                    raise RuntimeError(f"{len(answers)} answers for {len(share)} items")
                for i, answer in zip(share, answers):
                    out[i] = answer
            except Exception as err:  # noqa: BLE001 - a failed engine is its share's failure, never a crash
                if isinstance(err, ray.exceptions.RayActorError):
                    broken.add(slot)
                failure = CallFailure("error", type(err).__name__, str(err)[:300])
                for i in share:
                    out[i] = failure
        for ref, (slot, share) in pending.items():  # past the deadline: logged with the engine's stacks
            deadlines.stuck(fleet.role, fleet.engines[slot], fleet.settings.timeout_s,
                            f"{fleet.settings.SECTION}.timeout_s", f"{fleet.role} engine {slot}; replacing it")
            try:
                ray.cancel(ref)  # the engine is replaced below in any case
            except Exception:  # noqa: BLE001
                pass
            broken.add(slot)
            failure = CallFailure("timeout", f"{fleet.role.capitalize()}Timeout",
                                  f"no answer within {fleet.settings.SECTION}.timeout_s={fleet.settings.timeout_s}")
            for i in share:
                out[i] = failure
        for slot in sorted(broken):
            log.warning("%s engine %d timed out or died; replacing it", fleet.role, slot)
            try:
                fleet._replace(slot)
            except Exception as err:  # noqa: BLE001 - no room now: the next call fails on the old one and retries
                log.error("%s engine %d could not be replaced (%s); its next share fails and it is tried again",
                          fleet.role, slot, err)
        return out
