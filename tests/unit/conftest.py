"""Unit tests start no DeepSpeed, Ray or vLLM: a unit test that starts Ray or initialises a torch process group
(DeepSpeed's and vLLM's engines both build one) fails, naming what it started. Only what the test itself
started counts: in a whole-suite session the integration tests before it may have left a process group up."""

from __future__ import annotations

import sys

import pytest


def services_up() -> set[str]:
    """What is up in this process now: ``"Ray"`` and/or a torch.distributed process group."""
    up = set()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        up.add("Ray")
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        up.add("a torch.distributed process group (DeepSpeed or vLLM)")
    return up


@pytest.fixture(autouse=True)
def starts_no_service():
    """Fails a unit test after which Ray or a torch.distributed process group is up that was not before it."""
    before = services_up()
    yield
    started = sorted(services_up() - before)
    if started:
        pytest.fail(f"a unit test started {' and '.join(started)}: it belongs in tests/integration/")
