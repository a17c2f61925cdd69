"""The collective sync's engine waits share one deadline per phase, and the transfer group's build is bounded
(issue 26). With one wait per engine after another, four hung engines held rank 0 for 4 x
``sync.engine_timeout_s`` (480 s) while the other learner ranks waited under a 300 s ``learner.dist_timeout_s``.

The assertions are on outcomes, not on speed: an engine that answers after the phase's deadline but before a
second per-engine timeout would have run out counts as failed."""

from __future__ import annotations

import threading

import pytest

from learner.weight_sync import _bounded, _Fanout


def test_no_timeout_means_no_deadline():
    fan = _Fanout([], None)
    assert fan.remaining() is None and fan.wait({}) == ({}, {})


def test_bounded_returns_raises_or_times_out():
    _bounded(lambda: None, 5.0, "nothing")
    with pytest.raises(ValueError, match="inner"):
        _bounded(lambda: (_ for _ in ()).throw(ValueError("inner")), 5.0, "raising")
    release = threading.Event()
    try:
        with pytest.raises(TimeoutError, match="the nccl transfer group's warm-up did not finish within 0.2s"):
            _bounded(release.wait, 0.2, "the nccl transfer group's warm-up")  # a communicator init that hangs
    finally:
        release.set()


def test_config_keeps_the_collective_syncs_two_start_phases_inside_the_dist_timeout():
    from cluster.config import load_config
    from tests.helpers import REPO_ROOT

    tiny = REPO_ROOT / "configs/tiny_moe_zero2.yaml"
    assert load_config(tiny, ["sync.engine_timeout_s=200"]).sync.engine_timeout_s == 200  # object store: 200 < 300
    with pytest.raises(ValueError, match=r"sync.engine_timeout_s=200 x 2 \(sync.transport=collective"):
        load_config(tiny, ["sync.engine_timeout_s=200", "sync.transport=collective"])
    assert load_config(tiny, ["sync.engine_timeout_s=140", "sync.transport=collective"]).sync.transport == "collective"
