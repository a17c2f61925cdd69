"""What the tests share: the environment of every test process, the repository root, the embedded tiny model
and a private local Ray cluster.

Tests run from any directory: paths into the checkout are built from ``REPO_ROOT`` (``from tests.conftest
import REPO_ROOT``), never relative to the working directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

# Set here, before any test module imports torch, DeepSpeed or Ray (pytest imports conftest first); a value
# already in the environment wins. One thread pool of one thread per process on this 2-core machine
# (CONTRIBUTING.md), DeepSpeed's CPU accelerator, no Hugging Face hub, no usage reports.
TEST_ENV = {
    "DS_ACCELERATOR": "cpu",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "WANDB_SILENT": "true",
}
for _key, _value in TEST_ENV.items():
    os.environ.setdefault(_key, _value)


def sandbox_backend() -> str:
    """The code sandbox backend for tests that run code to check verifiers, not the sandbox: ``bwrap`` where
    bubblewrap works here, else ``plain``, chosen explicitly (their programs are the tests' own; the isolation
    is tested in tests/test_reward_sandbox.py and tests/test_reward_isolation.py, whose bwrap cases skip with
    a reason where bubblewrap is missing)."""
    from reward.config import SandboxConfig
    from reward.sandbox import bwrap_available, sandbox_python

    return "bwrap" if bwrap_available(sandbox_python(SandboxConfig())) else "plain"


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory) -> Path:
    """The embedded tiny Qwen3-MoE (default shape, ``build_seed`` 0), built once per session. Tests only read
    it: one that needs to change a model builds its own."""
    from cluster.tiny_model import build_tiny_moe

    return build_tiny_moe(tmp_path_factory.mktemp("tiny_moe") / "tiny_moe", seed=0)


@pytest.fixture(scope="session")
def model_path(tiny_moe: Path) -> str:
    """``tiny_moe`` as a string (what ``LearnerRank`` and the learner tests' ``make_batch`` take)."""
    return str(tiny_moe)


@pytest.fixture(scope="module")
def ray_cluster():
    """A private local Ray for one test module: 2 CPUs, node address 127.0.0.1, no dashboard; its workers get
    this process's values of the ``TEST_ENV`` keys and the checkout on ``PYTHONPATH``. Yields the ``ray``
    module; shut down after the module."""
    import ray

    env = {**{key: os.environ[key] for key in TEST_ENV}, "PYTHONPATH": str(REPO_ROOT)}
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": env}, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
