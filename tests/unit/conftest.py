"""Unit tests start no DeepSpeed, Ray or vLLM: a unit test that leaves Ray running or a torch process group
initialised (DeepSpeed's and vLLM's engines both build one) fails, naming what it started."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(autouse=True)
def starts_no_service():
    """After each unit test: Ray not initialised and no torch.distributed process group."""
    yield
    started = []
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        started.append("Ray")
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        started.append("a torch.distributed process group (DeepSpeed or vLLM)")
    if started:
        pytest.fail(f"a unit test started {' and '.join(started)}: it belongs in tests/integration/")
