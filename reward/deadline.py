"""Calls with a deadline in a thread of their own, for environment code (``reward.env_worker``).

Environments keep their state in the env worker's process (an episode's environment object lives across its
turns), so their calls cannot go to a killed-on-timeout child process the way verifier calls do
(``reward.runner``). Each call runs in a fresh daemon thread instead, and the caller waits for it up to a
deadline. **A thread cannot be killed in Python**: a call past its deadline is reported as ``timeout`` and
its thread is *abandoned*, left running until it returns by itself (a daemon thread does not keep the
process alive at exit). Abandoned threads still alive are counted (``abandoned_alive``) so that the driver can
replace a worker that holds too many (``env.max_abandoned_threads``): replacing the worker process is the
only way to stop them.

Outcomes are never exceptions: a ``reward.runner.CallOutcome`` with status ``ok`` (and the value),
``timeout`` or ``error`` (the call raised; ``BaseException`` included, so that a ``sys.exit`` in a tool ends
only its call).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from reward.infra import DETAIL_KEY, cause_of
from reward.runner import CallOutcome

MESSAGE_CHARS = 500  # longest exception message kept in an outcome's detail


def error_detail(err: BaseException, method: str) -> dict[str, str]:
    """``{"error": exception type name, "message": its text (truncated to MESSAGE_CHARS), "method": method}``, and
    ``"infra"``: the cause of a ``reward.infra.InfraFailure`` (a service's failure, not the model's)."""
    out = {"error": type(err).__name__, "message": str(err)[:MESSAGE_CHARS], "method": method}
    if cause_of(err):
        out[DETAIL_KEY] = cause_of(err)
    return out


class DeadlineRunner:
    """Runs calls in fresh daemon threads and waits for each up to its deadline. Thread-safe.

    Attributes:
        abandoned_total: calls abandoned past their deadline since construction (int).
    """

    def __init__(self, thread_name: str = "env-call"):
        self.abandoned_total = 0
        self._thread_name = thread_name
        self._lock = threading.Lock()
        self._abandoned: list[threading.Thread] = []

    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float, method: str = "") -> CallOutcome:
        """``fn(*args)`` in a new thread, waited for at most ``timeout_s`` seconds.

        Args:
            fn: what to call.
            args: its positional arguments.
            timeout_s: the deadline, wall-clock seconds (> 0).
            method: a name for the call in the outcome's detail (e.g. ``"step"``); default ``fn``'s name.

        Returns:
            ``CallOutcome``: ``ok`` with ``value``; ``error`` with ``detail = error_detail(...)`` and the
            exception as ``value``; or
            ``timeout`` (the thread is abandoned and counted). ``elapsed_s`` is the wall-clock seconds waited.

        Raises:
            ValueError: ``timeout_s`` is not a positive number.
        """
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
        method = method or getattr(fn, "__name__", "call")
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn(*args)
            except BaseException as err:  # noqa: BLE001 - reported as an outcome, SystemExit included
                box["error"] = err

        thread = threading.Thread(target=target, name=f"{self._thread_name}:{method}", daemon=True)
        start = time.perf_counter()
        thread.start()
        thread.join(timeout_s)
        elapsed = time.perf_counter() - start
        if thread.is_alive():
            with self._lock:
                self._abandoned.append(thread)
                self.abandoned_total += 1
            return CallOutcome("timeout", None, {
                "error": "Timeout", "method": method,
                "message": f"{method} did not return within {timeout_s:g} s (its thread is abandoned)"}, elapsed)
        if "error" in box:  # the exception itself as the value, for a caller that passes it on (InfraFailure)
            return CallOutcome("error", box["error"], error_detail(box["error"], method), elapsed)
        return CallOutcome("ok", box.get("value"), {}, elapsed)

    def abandoned_alive(self) -> int:
        """How many abandoned threads are still running (those that finished since are forgotten)."""
        with self._lock:
            self._abandoned = [t for t in self._abandoned if t.is_alive()]
            return len(self._abandoned)
