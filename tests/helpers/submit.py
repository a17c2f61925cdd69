"""Job submission through the Ray Jobs API (cluster/submit/job.py).

The slow tests start their own Ray heads on 127.0.0.1 with private temp dirs (/tmp/gspo-ray-t-*) and end
exactly those heads' processes; they never run ``ray stop``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cluster.submit.job import LocalHead, head_processes
from tests.helpers import REPO_ROOT

PY = sys.executable


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1",
               RAY_USAGE_STATS_ENABLED="0")
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(var, None)
    env.update(extra)
    return env


def _cli(*args: str, env: dict[str, str] | None = None, cwd: Path = REPO_ROOT, timeout: float = 600):
    return subprocess.run([PY, "-m", "cluster.submit", *args], cwd=cwd, env=env or _env(), capture_output=True,
                          text=True, timeout=timeout)


def _private_temp() -> Path:
    return Path(tempfile.mkdtemp(prefix="gspo-ray-t-", dir="/tmp"))


@pytest.fixture(scope="module")
def head():
    h = LocalHead(num_cpus=2, num_gpus=0, temp_dir=_private_temp())
    try:
        h.start()
        yield h
    finally:
        # signalled all at once, the head's gcs_server, raylet, autoscaler monitor and runtime-env agent outlive
        # SIGTERM by 5 to over 15 s (measured on the Zen 5, 2026-12-07): this private head gets 2 s, then SIGKILL
        h.stop(grace_s=2.0, remove_temp_dir=True)
        assert head_processes(h.temp_dir, h.pgid) == []
