"""The sandbox backend of tests that run their own code to check verifiers (not the sandbox)."""

from __future__ import annotations


def sandbox_backend() -> str:
    """The code sandbox backend for tests that run code to check verifiers, not the sandbox: ``bwrap`` where
    bubblewrap works here, else ``plain``, chosen explicitly (their programs are the tests' own; the isolation
    is tested in tests/unit/reward/test_sandbox.py and tests/unit/reward/test_isolation.py, whose bwrap cases skip with
    a reason where bubblewrap is missing)."""
    from reward.config import SandboxConfig
    from reward.sandbox import bwrap_available, sandbox_python

    return "bwrap" if bwrap_available(sandbox_python(SandboxConfig())) else "plain"


#: a bounded fork bomb (300 sleeping children at most) that reports whether a limit blocked it (hostile tests)
FORK_BOMB = """
    import os, sys, time
    n = 0
    try:
        for _ in range(300):          # its own bound: 300 processes, each sleeping 20 s
            pid = os.fork()
            if pid == 0:
                time.sleep(20)
                os._exit(0)
            n += 1
    except OSError as err:
        print("blocked", n, err.errno, flush=True)
    print("forked", n, flush=True)
"""
