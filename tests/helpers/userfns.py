"""User verifiers for the reward tests, referred to by name (``tests.helpers.userfns:fn``) and imported
into the verifier fork server: a light module on purpose (no torch, and no pytest at import), so that
importing it is quick. ``tests/unit/reward/test_userfns.py`` checks what the other reward tests rely on: every
function here resolves through ``reward.verifiers.get_verifier("module:function")`` to itself, travels to a child
process by reference, has the verifier signature ``(response, row)``, and importing the module pulls in no
heavy package."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path


def hang_with_child(response: str, row: dict) -> float:
    """Hangs, after forking a child that would outlive it (both bounded: 30 s sleeps)."""
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    with open(row["meta"]["pidfile"], "w") as f:
        f.write(f"{os.getpid()} {pid}")
    time.sleep(30)
    return 1.0


def raises(response: str, row: dict) -> float:
    raise KeyError("no such field")


def returns_junk(response: str, row: dict):
    return {"nan": math.nan, "text": "abc", "none": None, "dict": {"no": "score"}, "inf": math.inf}[response]


def dies(response: str, row: dict) -> float:
    os._exit(3)


def half_with_extra(response: str, row: dict) -> dict:
    return {"score": 0.5, "correct": True, "why": "partial"}


def slow_exact(response: str, row: dict) -> float:
    """Marks that it started (a file in ``row["meta"]["marker_dir"]``), waits ``delay_s``, then ``exact``."""
    from reward.verifiers import exact_verifier

    meta = row["meta"]
    Path(meta["marker_dir"], f"{row['uid']}.{os.getpid()}").touch()
    time.sleep(meta.get("delay_s", 0.5))
    return exact_verifier(response, row)


def exact_with_pid(response: str, row: dict) -> dict:
    """``exact``, plus the pid of the process that ran the call and the seconds left before its deadline."""
    from reward import sandbox
    from reward.verifiers import exact_verifier

    left = None if sandbox.CALL_DEADLINE is None else sandbox.CALL_DEADLINE - time.monotonic()
    return {"score": exact_verifier(response, row), "pid": os.getpid(), "left_s": left}


def _note_pid(row: dict) -> None:
    with open(Path(row["meta"]["pid_dir"], f"{row['uid']}.{os.getpid()}"), "w"):
        pass


def hang_in_python(response: str, row: dict) -> float:
    """Notes its pid, forks a child that would outlive it (also noted), then sleeps (both bounded: 60 s)."""
    _note_pid(row)
    pid = os.fork()
    if pid == 0:
        _note_pid(row)
        time.sleep(60)
        os._exit(0)
    time.sleep(60)
    return 1.0


def hang_in_c(response: str, row: dict) -> float:
    """Ignores every catchable signal, then hangs inside one C call that never returns to the interpreter
    (a catastrophically backtracking regex: about 2**60 steps), so only SIGKILL can stop it."""
    import re
    import signal

    _note_pid(row)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    re.match(r"(a+)+$", "a" * 60 + "b")
    return 1.0


def segfaults(response: str, row: dict) -> float:
    import ctypes

    _note_pid(row)
    ctypes.string_at(0)
    return 1.0


def forks_and_returns(response: str, row: dict) -> float:
    """Forks, and both processes return (the copy must never report a second result)."""
    os.fork()
    return 1.0


MODULE = "tests.helpers.userfns"


def _user_verifiers() -> dict:
    """The verifier functions defined here: public, not tests."""
    import inspect
    import sys

    module = sys.modules[MODULE]
    return {name: fn for name, fn in vars(module).items()
            if inspect.isfunction(fn) and fn.__module__ == MODULE and not name.startswith(("_", "test_"))}
