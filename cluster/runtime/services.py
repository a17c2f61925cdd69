"""Starting the services as Ray actors in placement groups, and the calls that fan work out to them.

This module (with ``cluster.runtime.learner_group`` for the learner's ranks) is where Ray placement is decided. Each learner rank, rollout engine and
reward worker is one actor (one process). The learner's ranks get one placement group per node on GPUs and one
for all ranks on the CPU (``cluster.runtime.learner_group``); every rollout engine and every reward worker has a group
of its own (``EngineFleet``, ``RewardGroups``), so engines and workers can be added, removed and replaced while
the run goes on.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.runtime import console, deadlines
from cluster.common import REPO_ROOT
from cluster.config import Config
from cluster.runtime.weight_sync import WeightSync
from learner.contracts import PendingLoad, SyncReport
from learner.weight_sync import error_text, wait_calls
from rollout.config import RolloutConfig
from rollout.contracts import Completion, PromptRow

log = logging.getLogger(__name__)

# Ray's job manager hands a submitted job's config (its runtime env among it) to the driver in this variable
# (``ray._private.runtime_env.constants.RAY_JOB_CONFIG_JSON_ENV_VAR``; ``ray.init`` merges it with its own
# runtime env and refuses a key that both set).
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def user_pythonpath() -> list[str]:
    """The services' ``PYTHONPATH``: the repository first, then the entries of the user's own ``PYTHONPATH``
    (the folders a user verifier may import its helpers from, on this node)."""
    entries = [str(REPO_ROOT)]
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry and entry not in entries:
            entries.append(entry)
    return entries


#: Settings of the CPU stack alone, copied from the driver's environment into CPU actors only.
CPU_ONLY_ENV = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")


def actor_env(threads: int, device: str | None = None) -> dict[str, str]:
    """Environment of a service process: one thread pool of ``threads`` threads, offline hubs, the repository
    and the user's ``PYTHONPATH``; ``device`` (from the config: ``"cpu"`` or ``"cuda"``) adds the device's
    settings: DeepSpeed's accelerator (``DS_ACCELERATOR``) and, on the CPU, ``CPU_ONLY_ENV``. A GPU actor gets
    ``DS_ACCELERATOR=cuda`` explicitly, since Ray's workers inherit the environment the cluster was started
    with (a ``DS_ACCELERATOR=cpu`` exported there would otherwise reach it). None: no device settings (the
    job-wide environment of ``init_ray``).

    Raises:
        ValueError: ``device`` is not None, ``"cpu"`` or ``"cuda"``.
    """
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"device={device!r} must be 'cpu', 'cuda' or None")
    env = {
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(user_pythonpath()),
        "WANDB_SILENT": "true",
    }
    copied = ("RAY_DEDUP_LOGS", *CPU_ONLY_ENV) if device == "cpu" else ("RAY_DEDUP_LOGS",)
    env.update({key: os.environ[key] for key in copied if key in os.environ})
    if device is not None:
        env["DS_ACCELERATOR"] = device
    return env


def resource_demand(cfg: Config) -> float:
    """Logical CPUs the run's actors reserve in total."""
    return (
        cfg.learner.world_size * cfg.learner.num_cpus_per_rank
        + cfg.rollout.num_engines * cfg.rollout.num_cpus_per_engine
        + cfg.reward.num_workers * cfg.reward.num_cpus_per_worker
        + (cfg.reward.judge.num_engines * cfg.reward.judge.num_cpus_per_engine if cfg.reward.judge.enabled else 0.0)
        + (cfg.distill.num_engines * cfg.distill.num_cpus_per_engine if cfg.distill.enabled else 0.0)
    )


def init_ray(cfg: Config, run_dir: Path, py_modules: list[str] | None = None, verbose: bool = True) -> None:
    """Connect to a cluster (``trainer.ray_address``, or ``RAY_ADDRESS`` inside a job) or start a local one
    with no dashboard, its node address set to ``trainer.bind_host``. Ray 2.60 still opens its GCS and raylet
    ports on all interfaces (it protects them with token authentication, on by default): see docs/cluster.md
    before running on a machine reachable from a network. A local cluster gets as many logical CPUs as the
    actors reserve (at least the machine's cores): phases run one after another, so they share the cores.

    ``py_modules``: the user modules every worker must import (``cluster.runtime.user_code``), shipped with Ray's
    runtime env to every node; inside a Ray job they come with the job's runtime env instead
    (``cluster.submit``), which a driver's own ``py_modules`` would conflict with. ``verbose=False``: the
    actors' output goes to ``console.worker_log_dir(run_dir)`` (a worker setup hook), not to this terminal.
    """
    if ray.is_initialized():
        return
    runtime_env: dict[str, Any] = {}
    in_job = JOB_CONFIG_ENV in os.environ  # set by Ray's job manager for a submitted job's driver
    if py_modules and not in_job:
        runtime_env["py_modules"] = list(py_modules)
    if not verbose:
        console.through_root("ray")
        runtime_env["worker_process_setup_hook"] = console.WORKER_SETUP_HOOK
        runtime_env["env_vars"] = {console.LOG_DIR_ENV: str(console.worker_log_dir(run_dir))}
    address = cfg.trainer.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=verbose, runtime_env=runtime_env or None)
        return
    runtime_env["env_vars"] = {**actor_env(1), **runtime_env.get("env_vars", {})}
    num_cpus = max(os.cpu_count() or 1, int(resource_demand(cfg) + 0.999))
    ray.init(
        address="local",  # a new local Ray, never a cluster some other job started on this machine
        num_cpus=num_cpus,
        num_gpus=0 if cfg.learner.num_gpus_per_rank == 0 and cfg.rollout.num_gpus_per_engine == 0 else None,
        include_dashboard=False,
        _node_ip_address=cfg.trainer.bind_host,
        runtime_env=runtime_env,
        _temp_dir=None,
        log_to_driver=verbose,
        # Quiet: Ray's own records go through the root logger (its warnings to the run's driver.log, its
        # errors to the terminal too: cluster.runtime.console); verbose: Ray's handler prints its warnings as before.
        configure_logging=verbose,
        logging_level=logging.WARNING,
    )


class PlacementTimeout(RuntimeError):
    """An actor's placement group found no node with room within ``cluster.placement_timeout_s``."""


def wait_ready(pg, what: str, bundles: list[dict[str, float]], timeout_s: float = 120.0) -> None:
    """Wait until ``pg`` is placed; after a second without room, log what it waits for (its custom resources
    name the nodes it needs: ``*.node_resources``) and wait up to ``timeout_s`` in all.

    Raises:
        PlacementTimeout: not placed within ``timeout_s`` (``cluster.placement_timeout_s``); names the bundle.
    """
    ready, _ = ray.wait([pg.ready()], timeout=min(1.0, timeout_s))
    custom = sorted({k for b in bundles for k in b if k not in ("CPU", "GPU")})
    if not ready:
        log.warning("%s waits up to %.0fs for a node with room for %s%s", what, timeout_s, bundles,
                    f" (a node offering {', '.join(custom)})" if custom else "")
        ready, _ = ray.wait([pg.ready()], timeout=max(0.0, timeout_s - 1.0))
    if not ready:
        remove_placement_group(pg)
        need = f"a live node offering {', '.join(custom)} with the CPUs" if custom else "more CPUs/GPUs"
        raise PlacementTimeout(
            f"placement group for {what} ({bundles}) was not scheduled within {timeout_s:.0f}s "
            f"(cluster.placement_timeout_s): it needs {need}; cluster resources now: {ray.available_resources()}. "
            "Add nodes, or lower the per-actor CPU/GPU settings or the counts."
        )


def engine_env(rc: RolloutConfig) -> dict[str, str]:
    """Environment of a vLLM engine actor with the settings ``rc``: ``actor_env`` for its device and threads,
    vLLM's log level WARNING unless the driver's environment sets one (not INFO per sync), and on the CPU in eager
    mode ``TORCH_COMPILE_DISABLE=1``: vLLM's sampler still torch.compiles a small log-prob rank kernel, on the CPU
    a g++ build at every engine start (tens of seconds, again for every replacement engine)."""
    on_gpu = rc.num_gpus_per_engine > 0
    env = actor_env(rc.threads_per_engine, "cuda" if on_gpu else "cpu")
    env.setdefault("VLLM_LOGGING_LEVEL", os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"))
    if rc.enforce_eager and not on_gpu:
        env["TORCH_COMPILE_DISABLE"] = "1"
    return env


def start_engine(engine_cls: type, model_path: str, rc: RolloutConfig, *, index: int, cache_dir: Path, what: str,
                 placement_timeout_s: float) -> tuple[Any, Any]:
    """One vLLM engine actor (``engine_cls``: ``rollout.engine.RolloutEngine`` or a subclass) in a placement group
    of its own: the rollout fleet's engines and the fixed models' (the LLM judge's, the distillation teacher's;
    ``cluster.runtime.model_fleet``) all start here.

    The bundle holds ``rc.num_cpus_per_engine`` CPUs, ``rc.node_resources`` and, on GPUs,
    ``num_gpus_per_engine x tensor_parallel_size`` GPUs; the actor gets ``engine_env(rc)`` and
    ``engine_cls(model_path, rc, engine_index=index, cache_dir=cache_dir)``.

    Returns:
        ``(actor, placement group)``; the actor may still be loading (call one of its methods to wait).

    Raises:
        PlacementTimeout: no node had room within ``placement_timeout_s`` (names ``what`` and the bundle).
    """
    bundle = {"CPU": rc.num_cpus_per_engine, **rc.node_resources}
    if rc.num_gpus_per_engine:
        bundle["GPU"] = rc.num_gpus_per_engine * rc.tensor_parallel_size
    pg = placement_group([bundle], strategy="STRICT_PACK")
    wait_ready(pg, what, [bundle], placement_timeout_s)
    actor = ray.remote(engine_cls).options(
        num_cpus=rc.num_cpus_per_engine,
        num_gpus=bundle.get("GPU", 0),
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
        runtime_env={"env_vars": engine_env(rc)},
    ).remote(model_path, rc, engine_index=index, cache_dir=str(cache_dir))
    return actor, pg


class EngineFleet:
    """The rollout engines: one actor and one placement group each. Spreads prompts over the engines,
    syncs weights to all of them at once, and can grow or shrink between steps."""

    def __init__(self, cfg: Config, model_path: str, cache_dir: Path, weight_sync: WeightSync):
        self.cfg = cfg
        self.weight_sync = weight_sync  # every sync, and the current weights for new engines, go through it
        self.model_path = model_path
        self.cache_dir = cache_dir
        self.engines: list[Any] = []
        self.groups: list[Any] = []
        self._next_index = 0
        self.weight_version = 0
        self.max_retries = 3
        self.restarts = 0  # engines replaced after dying (for fault/rollout_restarts)
        self._pending: PendingLoad | None = None  # the engines' side of a sync the learner did not wait for
        self._settle_lock = threading.RLock()  # the rollout thread and the driver's thread may both settle
        self.settled: dict[str, float] = {}  # sums since take_settled(): engine load seconds, seconds waited

    def _start_one(self) -> tuple[Any, Any]:
        from rollout.engine import RolloutEngine

        index = self._next_index
        self._next_index += 1
        engine_cls = deadlines.hang_hook(RolloutEngine, ("generate", "generate_greedy"), "generation",
                                         self.cfg.deadlines)
        actor, pg = start_engine(engine_cls, self.model_path, self.cfg.rollout, index=index,
                                 cache_dir=self.cache_dir / f"engine{index}", what="rollout engine",
                                 placement_timeout_s=self.cfg.cluster.placement_timeout_s)
        if self.cfg.sync.in_flight != "off":  # queued behind the constructor (the config check rules out refusals)
            actor.set_in_flight.remote(self.cfg.sync.in_flight)
        return actor, pg

    def _load_current(self, engines: list[Any]) -> None:
        """Give new engines the current weights (they start with the model folder's, version 0), labelled by
        the learner when its sync runs (``LearnerRank.current_version``): a replacement started while the
        learner trains (the overlapped rollout) queues behind that step and so loads its result, one version
        past ``weight_version``.

        Raises:
            RuntimeError: an engine failed to load them.
        """
        if self.weight_version == 0 or not engines:
            return
        report = self.weight_sync.push(engines, None)
        if report.failed_engines:
            raise RuntimeError(f"new rollout engines could not load the learner's weights (version "
                               f"{report.version}): {report.failed_engines}")
        if report.version != self.weight_version:
            log.info("new rollout engines loaded weight version %d (the learner's step ran before their load; "
                     "the others hold %d until the next sync)", report.version, self.weight_version)

    def _start_loaded(self, count: int) -> list[tuple[Any, Any]]:
        """``count`` new engines holding the current weights (one sync for all), as (actor, placement group).
        A failure kills the ones started and removes their placement groups before it propagates.

        Raises:
            RuntimeError: the new engines could not load the current weights.
        """
        new: list[tuple[Any, Any]] = []
        try:
            for _ in range(count):
                new.append(self._start_one())
            deadlines.get([a.pid.remote() for a, _ in new], [a for a, _ in new], "start", self.cfg.deadlines.start_s,
                          "deadlines.start_s")
            self._load_current([a for a, _ in new])
        except BaseException:
            for actor, pg in new:
                ray.kill(actor)
                remove_placement_group(pg)
            raise
        return new

    def start(self, count: int) -> None:
        """Start ``count`` more engines; once weights were synced, new engines load the current ones."""
        self.settle()
        new = self._start_loaded(count)
        for a, pg in new:
            self.engines.append(a)
            self.groups.append(pg)

    def resize(self, count: int) -> None:
        """Grow or shrink to ``count`` engines (between steps)."""
        if count < 1:
            raise ValueError(f"rollout.num_engines={count} must be >= 1")
        if count > len(self.engines):
            self.start(count - len(self.engines))
        elif count < len(self.engines):
            self.stop(len(self.engines) - count)

    def replace(self, slot: int) -> None:
        """Replace the engine in ``slot`` (dead or hung) with a new one holding the current weights."""
        self.replace_many([slot])

    def replace_many(self, slots: list[int]) -> None:
        """Replace the engines in ``slots`` (dead or hung) with new ones; all of them load the current weights
        in ONE sync. A new engine that fails to start or load is killed and its placement group removed
        before the error propagates (nothing leaks).

        Raises:
            RuntimeError: the new engines could not load the current weights.
        """
        self.settle()
        for slot in slots:
            try:
                ray.kill(self.engines[slot])
            except Exception:
                pass
            remove_placement_group(self.groups[slot])
        new = self._start_loaded(len(slots))
        for slot, (actor, pg) in zip(slots, new):
            self.engines[slot], self.groups[slot] = actor, pg
            self.restarts += 1
            log.warning("rollout engine %d died and was replaced (weight version %d)", slot, self.weight_version)

    def pids(self) -> list[int]:
        self.settle()
        return deadlines.get([e.pid.remote() for e in self.engines], list(self.engines), "start",
                             self.cfg.deadlines.start_s, "deadlines.start_s")

    def stop(self, count: int) -> None:
        """Stop the last ``count`` engines (between steps, so no prompt is in flight)."""
        self.settle()
        for _ in range(min(count, len(self.engines))):
            actor, pg = self.engines.pop(), self.groups.pop()
            try:
                ray.get(actor.shutdown.remote(), timeout=30)
            except Exception:
                pass
            ray.kill(actor)
            remove_placement_group(pg)

    def shutdown(self) -> None:
        self._pending = None  # the engines go: nothing to wait for
        self.stop(len(self.engines))

    def __len__(self) -> int:
        return len(self.engines)

    @staticmethod
    def _chunks(items: list[PromptRow], k: int) -> list[list[PromptRow]]:
        base, extra = divmod(len(items), k)
        out, start = [], 0
        for i in range(k):
            size = base + (1 if i < extra else 0)
            out.append(items[start : start + size])
            start += size
        return out

    def generate(self, prompts: list[PromptRow], n: int, *, greedy: bool = False, seed: int | None = None) -> list[Completion]:
        """``n`` completions per prompt, prompts spread over the engines in contiguous chunks; results come
        back in prompt order (group i = completions ``i*n .. i*n+n-1``)."""
        out: list[Completion | None] = [None] * (len(prompts) * n)
        for lo, comps in self.generate_stream(prompts, n, greedy=greedy, seed=seed, pieces_per_engine=1):
            out[lo * n : lo * n + len(comps)] = comps
        return out  # type: ignore[return-value]

    def generate_stream(self, prompts: list[PromptRow], n: int, *, greedy: bool = False, seed: int | None = None,
                        pieces_per_engine: int = 1, max_tokens: int | None = None) -> Iterator[tuple[int, list[Completion]]]:
        """Like ``generate``, but yields ``(index of the piece's first prompt, its completions)`` as each piece
        finishes: every engine's contiguous share is cut into ``pieces_per_engine`` calls queued on it in order,
        so the caller can score one piece while the engines generate the next. The samples do not depend on
        the cut (``prompt_offset`` keeps each prompt's seed). A piece whose engine died is generated again on
        the engine that replaces it. ``max_tokens``: the response limit of sampled calls (None: the engine's
        ``rollout.max_response_tokens``). An engine that finishes no piece within ``deadlines.generation_s`` is
        stuck: its ``PhaseTimeout`` is logged with its stacks, and it is replaced as a dead one is.

        Raises:
            RuntimeError: an engine slot died or stalled more than ``max_retries`` times in one call.
        """
        self.settle()  # engines still loading the latest weights sample nothing before they are done
        tasks: dict[Any, tuple[int, int, int, list[PromptRow]]] = {}  # ref -> (slot, offset in share, global lo, rows)
        attempts: dict[int, int] = {}

        def submit(slot: int, offset: int, lo: int, rows: list[PromptRow]) -> None:
            engine = self.engines[slot]
            if greedy:
                ref = engine.generate_greedy.remote(rows)
            else:
                ref = engine.generate.remote(rows, n, seed=None if seed is None else seed + 7919 * slot,
                                             prompt_offset=offset, max_tokens=max_tokens)
            tasks[ref] = (slot, offset, lo, rows)

        start, err = 0, None
        for slot, share in enumerate(self._chunks(prompts, len(self.engines))):
            for offset, piece in zip(*self._pieces(share, pieces_per_engine)):
                submit(slot, offset, start + offset, piece)
            start += len(share)
        limit = self.cfg.deadlines.generation_s
        moved = {slot: time.monotonic() for slot in range(len(self.engines))}  # a slot's last finished piece
        while tasks:
            busy = {s for s, *_ in tasks.values()}
            due = min(moved[s] for s in busy) + limit
            ready, _ = ray.wait(list(tasks), num_returns=1, timeout=max(0.0, due - time.monotonic()))
            if not ready:  # past deadlines.generation_s: the stalled engine is replaced like a dead one
                slot = min(busy, key=lambda s: moved[s])
                err = deadlines.stuck("generation", self.engines[slot], limit, "deadlines.generation_s",
                                      f"rollout engine {slot}: no piece finished; replacing it")
                ready = [next(ref for ref, t in tasks.items() if t[0] == slot)]
            slot, offset, lo, rows = tasks.pop(ready[0])
            moved[slot] = time.monotonic()
            try:
                if err is not None:
                    raise err
                yield lo, ray.get(ready[0])
            except (ray.exceptions.RayActorError, deadlines.PhaseTimeout) as failure:
                # The engine process died or stalled: its pieces are generated again on a new engine.
                err = None
                attempts[slot] = attempts.get(slot, 0) + 1
                if attempts[slot] > self.max_retries:
                    raise RuntimeError(f"rollout engine {slot} died or stalled {attempts[slot]} times in one step"
                                       ) from failure
                lost = [(o, l, r) for ref, (s, o, l, r) in list(tasks.items()) if s == slot]
                for ref in [ref for ref, t in tasks.items() if t[0] == slot]:
                    del tasks[ref]
                self.replace(slot)
                for o, l, r in [(offset, lo, rows)] + lost:
                    submit(slot, o, l, r)
                moved[slot] = time.monotonic()  # the new engine's deadline starts when it has its pieces

    @staticmethod
    def _pieces(share: list[PromptRow], k: int) -> tuple[list[int], list[list[PromptRow]]]:
        """``share`` cut into at most ``k`` contiguous non-empty pieces: (offsets, pieces)."""
        size = max(1, -(-len(share) // max(1, k)))
        offsets = list(range(0, len(share), size))
        return offsets, [share[o : o + size] for o in offsets]

    def sync(self, version: int) -> SyncReport:
        """Stream the current weights (``weight_sync``) into every engine as ``version``; an engine that
        died or failed during the sync is replaced by one that loads the same version.

        Returns:
            the learner's ``SyncReport`` of the sync (the replacements' own sync not included).

        With ``sync.load_beside_learner`` it returns once the learner has put the weights: the engines' loads
        are waited for by the next use of the fleet (``settle``).

        Raises:
            RuntimeError: an engine reports another version afterwards.
        """
        self.settle()
        sc = self.cfg.sync
        report = self.weight_sync.push(list(self.engines), version,
                                       defer=sc.load_beside_learner and sc.transport == "object_store")
        self.weight_version = version
        failed = report.failed_engines
        for slot, why in sorted(failed.items()):
            log.warning("rollout engine %d failed during weight sync (%s)", slot, why)
        if failed:
            self.replace_many(sorted(failed))  # one more sync of this version, for all of them
        if report.pending is not None:
            self._pending = report.pending  # waited for by the next use of the engines (settle)
            return report
        versions = deadlines.get([e.weight_version.remote() for e in self.engines], list(self.engines), "sync",
                                 self.cfg.deadlines.sync_s, "deadlines.sync_s")
        if any(v != version for v in versions):
            raise RuntimeError(f"weight sync failed: engines report versions {versions}, expected {version}")
        return report

    def settle(self) -> float:
        """Wait for the engines' side of the latest sync when the learner left it pending
        (``sync.load_beside_learner``): each engine's start, last loads and finish. An engine that failed one
        of them or did not answer within ``sync.engine_timeout_s`` is replaced (the new one loads the same
        version). Adds the loads' seconds and the wait to ``settled``. Returns the seconds waited (0 when
        nothing was pending).

        Raises:
            RuntimeError: a replacement engine could not load the current weights.
        """
        with self._settle_lock:
            pending, self._pending = self._pending, None
            if pending is None:
                return 0.0
            t = time.perf_counter()
            failed, load_s = wait_pending(pending, self.cfg.sync.engine_timeout_s)
            for slot, why in sorted(failed.items()):
                log.warning("rollout engine %d failed loading weight version %d (%s)", slot, self.weight_version, why)
            if failed:
                self.replace_many(sorted(failed))
            waited = time.perf_counter() - t
            for key, value in (("sync/engine_load_s", load_s), ("timing/wait_engine_load_s", waited)):
                self.settled[key] = self.settled.get(key, 0.0) + value
            return waited

    def take_settled(self) -> dict[str, float]:
        """The ``settled`` sums since the last call (empty when no sync was left pending), then reset."""
        with self._settle_lock:
            out, self.settled = self.settled, {}
            return out


def wait_pending(pending: PendingLoad, timeout_s: float | None) -> tuple[dict[int, str], float]:
    """Wait (up to ``timeout_s`` seconds in all) for every engine call of ``pending``.

    Returns:
        (engine index -> why it failed: an error, its death or no answer in time; for each bucket the seconds
        of the slowest engine that loaded it, summed).
    """
    calls = {(slot, k): ref for slot, refs in pending.calls.items() for k, ref in enumerate(refs)}
    done, errors = wait_calls(ray, calls, timeout_s)
    failed: dict[int, str] = {}
    for (slot, _), err in errors.items():  # an engine's first failed call, in call order
        failed.setdefault(slot, f"no answer within sync.engine_timeout_s={timeout_s}" if err is None
                          else error_text(err))
    slowest: dict[int, float] = {}  # bucket -> seconds
    for (slot, k), out in done.items():
        if slot in failed:  # replaced: its loads are not the sync's
            continue
        loads = pending.loads.get(slot, [])
        if k in loads:
            b = loads.index(k)
            slowest[b] = max(slowest.get(b, 0.0), float(out.seconds))
    return failed, sum(slowest.values())


class RewardGroups:
    """Scheduling strategy factory for the reward pool: one placement group per worker slot (a replaced
    worker gets a fresh group; the old one is removed)."""

    def __init__(self, num_cpus: float, node_resources: dict[str, float] | None = None, timeout_s: float = 120.0):
        self.num_cpus = num_cpus
        self.timeout_s = timeout_s  # cluster.placement_timeout_s
        self.node_resources = dict(node_resources or {})  # reward.node_resources: custom resources per bundle
        self.groups: dict[int, Any] = {}

    def __call__(self, slot: int) -> PlacementGroupSchedulingStrategy:
        old = self.groups.pop(slot, None)
        if old is not None:
            remove_placement_group(old)
        bundle = [{"CPU": self.num_cpus, **self.node_resources}]
        pg = placement_group(bundle, strategy="STRICT_PACK")
        wait_ready(pg, "reward worker", bundle, self.timeout_s)
        self.groups[slot] = pg
        return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)

    def remove(self, slot: int) -> None:
        """Remove the placement group of ``slot`` (its worker was ended: the pool shrank)."""
        if (pg := self.groups.pop(slot, None)) is not None:
            remove_placement_group(pg)

    def remove_all(self) -> None:
        for pg in self.groups.values():
            remove_placement_group(pg)
        self.groups.clear()

