"""The real driver (``python -m cluster.train``, what ``make train`` runs) as a process of its own, to be killed
with SIGKILL mid-run and resumed (tests/matrix/test_agent_resume.py, tests/matrix/test_determinism.py).

The driver runs in a new session, so its process group holds Ray's head processes and workers too, with a
private Ray temp dir (``private_ray_tmp``): killing the group and then whatever names that temp dir (as
``ray stop`` would, for this dir only) leaves nothing of the run behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from cluster.runtime.local_head import head_processes, terminate_then_kill
from tests.helpers import REPO_ROOT, TEST_ENV


@contextlib.contextmanager
def private_ray_tmp() -> Iterator[Path]:
    """A private temp dir for Ray and the run's other temporary files (short: socket paths must fit), removed
    on exit with any process that names it."""
    path = Path(tempfile.mkdtemp(prefix="gspo-ray-t-", dir="/tmp"))
    try:
        yield path
    finally:
        terminate_then_kill(head_processes(path), grace_s=5)
        shutil.rmtree(path, ignore_errors=True)


def driver_env(ray_tmp: Path, **extra: str) -> dict[str, str]:
    """The driver's environment: the tests' (``TEST_ENV``), Ray's session and every other temporary file (vLLM's)
    in ``ray_tmp``, no address of another Ray cluster, plus ``extra``."""
    (ray_tmp / "tmp").mkdir(exist_ok=True)
    env = dict(os.environ, **TEST_ENV, PYTHONPATH=str(REPO_ROOT), RAY_TMPDIR=str(ray_tmp),
               TMPDIR=str(ray_tmp / "tmp"), **extra)
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(var, None)
    return env


def start_driver(config: Path, overrides: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """``python -m cluster.train config *overrides`` in a new session, its output (both streams) in ``log``."""
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "cluster.train", str(config), *overrides], cwd=REPO_ROOT,
                                env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def tail(log: Path, n: int = 40) -> str:
    """The last ``n`` lines of ``log`` (``(no log)`` when it does not exist)."""
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:]) if log.is_file() else "(no log)"


def end_group(proc: subprocess.Popen, ray_tmp: Path) -> list[str]:
    """SIGKILL the driver's process group, then end whatever of this Ray still runs (``ray stop`` for this temp
    dir only). Returns what had to be ended after the group's kill (``pid command``), after making sure it ended.

    Raises:
        subprocess.TimeoutExpired: the driver did not exit within 60 s of its SIGKILL.
    """
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)
    deadline = time.time() + 30
    while (left := head_processes(ray_tmp, proc.pid)) and time.time() < deadline:
        time.sleep(0.5)  # SIGKILLed processes of the group take a moment to go
    named = []
    for p in left:
        try:
            named.append(f"{p.pid} {' '.join(p.cmdline()[:3])}")
        except Exception:  # noqa: BLE001 - gone meanwhile
            continue
    terminate_then_kill(left, grace_s=5)
    return named


def run_to_end(config: Path, overrides: list[str], env: dict[str, str], log: Path, ray_tmp: Path,
               timeout_s: float) -> tuple[int | None, list[str]]:
    """The driver run to its end (None: past ``timeout_s`` seconds), then whatever of it still runs ended: (exit
    code, what had to be ended)."""
    proc = start_driver(config, overrides, env, log)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        escaped = end_group(proc, ray_tmp)
    return rc, escaped
