"""The protected runner: every verifier call runs in a child process with its own wall-clock limit.

Calls go to a private fork server (``reward._forkserver``: a clean, single-threaded Python process started
with ``subprocess``, which imported the verifiers and warmed math-verify once), so that calls cost a fork,
not an interpreter start, and never fork the multi-threaded Ray worker itself. A child runs a chunk of up to
``calls_per_child`` calls in sequence (``1``: a fresh process per call) and reports each call as soon as it
is done. Each child leads its own session (its own process group), dies with the fork server
(PR_SET_PDEATHSIG) and optionally caps its address space. When the call a child is on runs out of time,
the child is killed with its whole process group and sandbox processes started on its behalf are reaped
(``reward.sandbox_procs.reap_owner``); that call alone is ``timeout``, and the rest of the chunk continues in a new
child. A child that dies mid-call costs that call alone. The fork server dies with this process.

Outcomes are never exceptions: ``ok`` (with the verifier's return value), ``timeout``, or ``error`` (the
verifier raised; or its process, or the fork server, died without answering: ``detail["error"]`` is then
``VerifierDied`` / ``RunnerLost``).
"""

from __future__ import annotations

import math
import os
import pickle
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from reward._forkserver import read_frame, write_frame

DEFAULT_PRELOAD = ("reward.verifiers", "reward.sandbox", "reward.judge", "reward._warm")
START_TIMEOUT_S = 300.0  # fork server start-up (imports, math-verify warm-up) on a busy machine


@dataclass
class CallOutcome:
    """One protected verifier call.

    Attributes:
        status: ``"ok"``, ``"timeout"`` or ``"error"``.
        value: what the verifier returned (float, or a dict of plain values) when ``status == "ok"``.
        detail: reason of a non-ok status (``error``, ``message``, ``signal`` ...).
        elapsed_s: wall-clock seconds from fork to result (or kill).
    """

    status: str
    value: Any = None
    detail: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0


class RunnerLost(RuntimeError):
    """The fork server died or stopped answering."""


class ProtectedRunner:
    """Runs verifier calls in killed-on-timeout child processes of a private fork server.

    Args:
        timeout_s: wall-clock limit of one call, seconds.
        memory_mb: RLIMIT_AS of a call's process, MiB (0 = no limit).
        preload: extra modules imported once into the fork server (user verifiers).
        parallel: child processes running calls at once.
        calls_per_child: calls one child runs in sequence (1 = a fresh process per call). Calls marked
            ``alone`` in ``run`` always get a child of their own.

    Raises:
        ValueError: a non-positive ``timeout_s``, ``parallel`` or ``calls_per_child``.
        RuntimeError: the fork server did not start (for example a preload module failed to import).
    """

    def __init__(self, timeout_s: float, memory_mb: int = 0, preload: tuple[str, ...] | list[str] = (),
                 parallel: int = 1, calls_per_child: int = 64):
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel!r}")
        if calls_per_child < 1:
            raise ValueError(f"calls_per_child must be >= 1, got {calls_per_child!r}")
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        self.parallel = int(parallel)
        self.calls_per_child = int(calls_per_child)
        self.preload = list(DEFAULT_PRELOAD) + [m for m in preload if m not in DEFAULT_PRELOAD]
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._start_server()

    def _start_server(self) -> None:
        proc = subprocess.Popen([sys.executable, "-m", "reward._forkserver"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, start_new_session=True, close_fds=True,
                                cwd=os.getcwd())
        self._proc = proc
        try:
            write_frame(proc.stdin.fileno(), {"sys_path": list(sys.path), "preload": self.preload,
                                              "memory_mb": self.memory_mb})
            if pickle.loads(self._read(START_TIMEOUT_S)) != "ready":
                raise RunnerLost("unexpected greeting")
        except (RunnerLost, OSError, pickle.UnpicklingError) as err:
            self.close()
            raise RuntimeError(
                f"verifier fork server did not start ({err}); preload modules: {self.preload}"
            ) from None

    def _read(self, timeout_s: float) -> bytes:
        fd = self._proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], timeout_s)
        if not ready:
            raise RunnerLost(f"no answer within {timeout_s:.0f} s")
        frame = read_frame(fd)
        if frame is None:
            raise RunnerLost(f"fork server exited (code {self._proc.poll()})")
        return frame

    def run(self, calls: list[tuple[Callable, str, dict]], alone: list[bool] | None = None) -> list[CallOutcome]:
        """Run ``fn(response, row)`` for each ``(fn, response, row)``; outcomes in the same order.

        ``fn`` must be picklable by reference (a module-level function or a ``functools.partial`` of one).
        ``alone[i]`` true: call ``i`` runs in a child process of its own (no chunk shares its process).

        Raises:
            ValueError: ``alone`` is given with a length other than ``len(calls)``.
        """
        if alone is not None and len(alone) != len(calls):
            raise ValueError(f"alone has {len(alone)} flags for {len(calls)} calls")
        if not calls:
            return []
        outcomes: list[CallOutcome | None] = [None] * len(calls)
        blobs, where = [], []
        for i, call in enumerate(calls):
            try:
                blobs.append(pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL))
                where.append(i)
            except Exception as err:  # noqa: BLE001
                outcomes[i] = CallOutcome("error", None, {"error": type(err).__name__,
                                                          "message": f"call not picklable: {err}"[:500]})
        if blobs:
            if self._proc is None or self._proc.poll() is not None:
                self.restarts += 1
                self._start_server()
            backstop = self.timeout_s * math.ceil(len(blobs) / self.parallel) + 60.0
            try:
                write_frame(self._proc.stdin.fileno(), {
                    "calls": blobs, "timeout_s": self.timeout_s, "parallel": self.parallel,
                    "chunk_size": self.calls_per_child,
                    "alone": [bool(alone[i]) for i in where] if alone is not None else None})
                got = pickle.loads(self._read(backstop))
            except (RunnerLost, OSError, pickle.UnpicklingError) as err:
                self.close()  # the next run starts a fresh server
                got = [("error", None, {"error": "RunnerLost", "message": str(err)[:500]}, 0.0)] * len(blobs)
            for i, (status, value, detail, elapsed) in zip(where, got):
                outcomes[i] = CallOutcome(status, value, detail, elapsed)
        return outcomes  # type: ignore[return-value]

    def preload_modules(self, modules: list[str]) -> dict[str, str]:
        """Import ``modules`` into the fork server now (outside any call's time limit), so that calls to
        verifiers defined there do not pay for the import. Returns ``{module: error}`` for failed imports."""
        new = [m for m in modules if m not in self.preload]
        if not new:
            return {}
        self.preload += new  # also imported by a restarted server
        if self._proc is None or self._proc.poll() is not None:
            self.restarts += 1
            self._start_server()
            return {}
        try:
            write_frame(self._proc.stdin.fileno(), {"import": new})
            return pickle.loads(self._read(START_TIMEOUT_S))
        except (RunnerLost, OSError, pickle.UnpicklingError) as err:
            self.close()
            return {m: f"RunnerLost: {err}" for m in new}

    def call(self, fn: Callable, response: str, row: dict) -> CallOutcome:
        """One protected call (see ``run``)."""
        return self.run([(fn, response, row)])[0]

    def close(self) -> None:
        """Stop the fork server and its children."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait(timeout=10)
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
