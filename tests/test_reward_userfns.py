"""User verifiers for the reward tests, referred to by name (``tests.test_reward_userfns:fn``) and imported
into the verifier fork server: a light module on purpose (no torch, and no pytest at import), so that
importing it is quick. Its own tests (at the end) check what the other reward tests rely on: every function
here resolves through ``reward.verifiers.get_verifier("module:function")`` to itself, travels to a child
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


# ------------------------------------------------------------------------------------------------------------
# tests of this module's contract (imports inside the functions keep the module light)

MODULE = "tests.test_reward_userfns"
HEAVY = ("torch", "ray", "vllm", "deepspeed", "transformers", "pytest")


def _user_verifiers() -> dict:
    """The verifier functions defined here: public, not tests."""
    import inspect
    import sys

    module = sys.modules[MODULE]
    return {name: fn for name, fn in vars(module).items()
            if inspect.isfunction(fn) and fn.__module__ == MODULE and not name.startswith(("_", "test_"))}


def test_every_user_verifier_resolves_by_name_to_itself_and_pickles_by_reference():
    import inspect
    import pickle

    from reward.config import RewardConfig
    from reward.verifiers import get_verifier

    fns = _user_verifiers()
    assert {"raises", "dies", "slow_exact", "exact_with_pid", "hang_in_c", "forks_and_returns"} <= set(fns)
    for name, fn in fns.items():
        assert get_verifier(f"{MODULE}:{name}") is fn, name
        assert get_verifier(f"{MODULE}:{name}", RewardConfig()) is fn, name  # options bind built-ins only
        assert pickle.loads(pickle.dumps(fn)) is fn, name  # the runner ships it to the fork server by name
        assert list(inspect.signature(fn).parameters) == ["response", "row"], name


def test_in_process_results_of_the_simple_user_verifiers():
    """What the runner and worker tests expect these to return or raise when called directly."""
    import math

    import pytest

    assert half_with_extra("anything", {}) == {"score": 0.5, "correct": True, "why": "partial"}
    assert math.isnan(returns_junk("nan", {})) and returns_junk("none", {}) is None
    with pytest.raises(KeyError, match="no such field"):
        raises("", {})


def test_importing_the_module_pulls_in_no_heavy_package():
    """The fork server preloads this module (``preload=[...]``); resolving all its verifiers by name must not
    import torch, Ray, vLLM, DeepSpeed, transformers or pytest (each would add seconds to a worker's start)."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    code = (
        "import sys\n"
        "from reward.verifiers import get_verifier\n"
        f"import {MODULE} as m\n"
        "for name in m._user_verifiers():\n"
        f"    get_verifier('{MODULE}:' + name)\n"
        f"print(len(m._user_verifiers()), sorted(h for h in {HEAVY!r} if h in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    count, heavy = out.stdout.split(" ", 1)
    assert int(count) == len(_user_verifiers()) and heavy.strip() == "[]", out.stdout
