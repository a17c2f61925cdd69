"""Every wait of the driver on an actor has a deadline: this module is the one place that waits with one, names
what is stuck and dumps its stacks.

``get(refs, actors, phase, ...)`` is ``ray.get`` of several calls with a deadline, failing fast on the first
error (a dead learner rank stops the driver at once, not after its peers' collective timeout). Past the
deadline it raises ``PhaseTimeout``, the one error of a stuck wait: it names the actor (class and pid), its
node (IP and node id), the phase, the RL step (``set_step``) and the config key of the deadline. Callers that
replace a stuck actor instead (rollout engines, reward workers) build the same error with ``stuck`` and log it.

Before the error is raised the stuck processes' Python stacks go to the run's log: py-spy (installed with Ray,
which uses it for ``ray stack``) reads a process from outside, so it needs nothing from the stuck process (a
faulthandler signal needs a handler installed in every actor at start, and writes into the actor's own stderr
rather than the driver's log). It runs on the actor's node as a zero-CPU Ray task pinned there, so it works on
a multi-node cluster too; when it cannot run (no py-spy, no permission to ptrace), the log says why.

The config is the ``deadlines`` section (``cluster.config_sections.DeadlinesConfig``); its ``debug_hang`` makes the
first call of one phase hang (``hang_hook``), the test hook that shows each deadline working.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

log = logging.getLogger(__name__)

STACK_DUMP_WAIT_S = 30.0  # how long the driver waits for one node's py-spy dump
_state: dict[str, Any] = {"step": None, "stacks": True}


class PhaseTimeout(RuntimeError):
    """An actor did not answer a call of a phase within its deadline.

    Attributes:
        phase: the phase (``cluster.config_sections.DEADLINE_PHASES``, or a learner method's name).
        actor: the actor's class name and pid, e.g. ``"LearnerRank pid 4242"``.
        node: the actor's node, ``"<ip> (node <node id>)"``.
        step: the RL step the driver was in (the step being made, 1-based), or None before the first.
        timeout_s: the deadline, seconds.
        key: the config key that set it.
    """

    def __init__(self, phase: str, actor: str, node: str, step: int | None, timeout_s: float, key: str,
                 detail: str = ""):
        self.phase, self.actor, self.node, self.step, self.timeout_s, self.key = phase, actor, node, step, timeout_s, key
        self.detail = detail
        at = f"at RL step {step}" if step is not None else "before the first RL step"
        super().__init__(f"{actor} on {node} did not finish phase '{phase}' within {timeout_s:g}s ({key}) {at}"
                         + (f": {detail}" if detail else "") + "; its Python stacks are in the run's log")

    def __reduce__(self):  # pickles through Ray with its fields
        return (PhaseTimeout, (self.phase, self.actor, self.node, self.step, self.timeout_s, self.key, self.detail))


def set_step(step: int | None) -> None:
    """The RL step the driver is making (1-based), named by every ``PhaseTimeout`` raised until the next call."""
    _state["step"] = step


def set_stacks(enabled: bool) -> None:
    """Whether ``stuck`` dumps stacks (``deadlines.stacks``)."""
    _state["stacks"] = bool(enabled)


@dataclass(frozen=True)
class Where:
    """Where an actor runs: its class name, process id and node (from Ray's actor table; None when unknown)."""

    name: str
    pid: int | None
    ip: str | None
    node_id: str | None

    @property
    def actor(self) -> str:
        return f"{self.name} pid {self.pid}" if self.pid else self.name

    @property
    def node(self) -> str:
        return f"{self.ip or '?'} (node {(self.node_id or '?')[:12]})"


def where(actor: Any) -> Where:
    """The class, pid and node of ``actor`` (a Ray actor handle), read from the GCS actor table: a stuck actor
    cannot answer a call, and the state API needs the dashboard, which a local run does not start. A string (a
    Ray task's description, e.g. ``"file check on node <id>"``) is named as it is."""
    if isinstance(actor, str):
        return Where(actor, None, None, None)
    try:
        row = ray._private.state.state.actor_table(actor._actor_id.hex())  # noqa: SLF001 - no public equivalent
        addr = row.get("Address") or {}
        return Where(row.get("ActorClassName") or "actor", row.get("Pid") or None, addr.get("IPAddress"),
                     addr.get("NodeID"))
    except Exception:  # noqa: BLE001 - a description must never hide the timeout itself
        return Where(type(actor).__name__, None, None, None)


def _py_spy_dump(pid: int) -> str:
    """``py-spy dump`` of ``pid`` on this node (runs inside a Ray task on the actor's node)."""
    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(exe):
        return "py-spy is not installed on this node"
    try:
        done = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "py-spy dump did not finish within 20s"
    return (done.stdout + done.stderr).strip()


def dump_stacks(actors: list[Any]) -> dict[str, str]:
    """The Python stacks of ``actors`` (Ray actor handles), each read by py-spy on its own node, and logged at
    ERROR level (the run's log). Returns ``{"<class> pid <pid> on <node>": stacks or why none}``."""
    out: dict[str, str] = {}
    jobs = []
    for actor in actors:
        w = where(actor)
        label = f"{w.actor} on {w.node}"
        if w.pid is None or w.node_id is None:
            out[label] = "no pid or node in Ray's actor table (a task, or an actor not started)"
            continue
        task = ray.remote(_py_spy_dump).options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(w.node_id, soft=False))
        jobs.append((label, task.remote(w.pid)))
    for label, ref in jobs:
        try:
            out[label] = ray.get(ref, timeout=STACK_DUMP_WAIT_S)
        except Exception as err:  # noqa: BLE001 - the node may be the stuck part
            out[label] = f"no stacks: {type(err).__name__}: {err}"[:500]
    for label, text in out.items():
        log.error("Python stacks of %s:\n%s", label, text)
    return out


def stuck(phase: str, actor: Any, timeout_s: float, key: str, detail: str = "") -> PhaseTimeout:
    """The ``PhaseTimeout`` of ``actor`` stuck in ``phase`` (logged, with its stacks unless ``set_stacks(False)``);
    returned, not raised: a caller that replaces the actor logs it and goes on."""
    w = where(actor)
    err = PhaseTimeout(phase, w.actor, w.node, _state["step"], timeout_s, key, detail)
    log.error("%s", err)
    if _state["stacks"]:
        dump_stacks([actor])
    return err


def _is_collective_timeout(err: BaseException) -> bool:
    """Whether a rank's error is its collective timing out (torch's gloo/NCCL watchdog: the peer it waited for is
    the stuck one)."""
    text = str(err)
    return "DistBackendError" in text or ("timed out" in text.lower() and "collective" in text.lower()) \
        or "Timed out waiting" in text


def get(refs: list[Any], actors: list[Any], phase: str, timeout_s: float, key: str) -> list[Any]:
    """``ray.get(refs)`` within ``timeout_s`` seconds in all; ``actors[i]`` is the actor that answers ``refs[i]``
    (or, for a Ray task, a string naming it: its stacks are not dumped).

    Fails fast: the first error raises at once. A rank's collective timeout while a peer is still busy raises
    ``PhaseTimeout`` naming that peer (the one its collective waited for).

    Returns:
        the results, in the order of ``refs``.

    Raises:
        PhaseTimeout: a ref not ready within ``timeout_s``, naming the first such actor (all their stacks logged).
        ray.exceptions.RayError: an actor's call failed or the actor died.
    """
    if len(refs) != len(actors):
        raise ValueError(f"{len(refs)} refs for {len(actors)} actors")
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        try:
            ray.get(ready)
        except ray.exceptions.RayTaskError as err:
            if pending and _is_collective_timeout(err):
                raise _stuck_of(refs, actors, pending, phase, timeout_s, key,
                                f"a peer's collective timed out waiting for it ({type(err).__name__})") from err
            raise
    if pending:
        raise _stuck_of(refs, actors, pending, phase, timeout_s, key, f"{len(pending)} of {len(refs)} calls unanswered")
    return ray.get(refs)


def _stuck_of(refs: list[Any], actors: list[Any], pending: list[Any], phase: str, timeout_s: float, key: str,
              detail: str) -> PhaseTimeout:
    late = [actors[i] for i, r in enumerate(refs) if r in pending]
    err = stuck(phase, late[0], timeout_s, key, detail)
    if _state["stacks"] and len(late) > 1:
        dump_stacks(late[1:])
    return err


def reward_pool_options(settings: Any) -> dict[str, Any]:
    """The ``reward.pool.RewardPool`` keyword arguments of the run's ``deadlines`` section ``settings``: its score
    calls' deadline (``reward_s``), the ``PhaseTimeout`` logged with the stacks of a worker past it, and the worker
    class (hooked when ``debug_hang`` is ``reward``)."""
    from reward.worker import RewardWorker

    def on_stuck(actor: Any, slot: int) -> None:
        stuck("reward", actor, settings.reward_s, "deadlines.reward_s", f"reward worker {slot}; replacing it")

    return {"call_timeout_s": settings.reward_s, "on_stuck": on_stuck,
            "worker_cls": hang_hook(RewardWorker, ("score",), "reward", settings)}


_markers: dict[tuple[int, str], tuple[Any, str]] = {}  # (id of a run's deadlines section, phase) -> (it, marker)


def hang_hook(cls: type, methods: tuple[str, ...], phase: str, settings: Any) -> type:
    """``cls``, or when ``settings.debug_hang == phase`` (``settings``: the run's ``deadlines`` section) a subclass
    of it whose ``methods`` sleep ``settings.debug_hang_s`` seconds in the first call of the run before they run:
    the first call, across all the actors of every class hooked for this run, to create a marker file (one per
    run and phase, so a replacement does not hang again). The debug hook behind ``deadlines.debug_hang``: no
    production code path sleeps. ``settings`` None (an actor started outside a run, as tests do) hooks nothing."""
    if settings is None or settings.debug_hang != phase or not methods:
        return cls
    key = (id(settings), phase)
    if key not in _markers:  # the section is kept with its marker, so its id is not reused by another run's
        _markers[key] = (settings, os.path.join(tempfile.mkdtemp(prefix=f"gspo-hang-{phase}-"), "hung"))
    marker, hang_s = _markers[key][1], settings.debug_hang_s

    def hanging(name: str):
        inner = getattr(cls, name)

        @functools.wraps(inner)
        def method(self, *args, **kwargs):
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
                time.sleep(hang_s)
            except FileExistsError:
                pass
            return inner(self, *args, **kwargs)

        return method

    return type(cls.__name__, (cls,), {"__module__": cls.__module__, **{m: hanging(m) for m in methods}})
