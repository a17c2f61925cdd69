"""User verifiers for the reward tests, referred to by name (``tests.test_reward_userfns:fn``) and imported
into the verifier fork server: a light module on purpose (no torch), so that importing it is quick.
Holds no tests itself."""

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
