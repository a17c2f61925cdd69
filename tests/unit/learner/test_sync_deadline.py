"""The collective sync's engine waits share one deadline per phase, and the transfer group's build is bounded
(issue 26). With one wait per engine after another, four hung engines held rank 0 for 4 x
``sync.engine_timeout_s`` (480 s) while the other learner ranks waited under a 300 s ``learner.dist_timeout_s``.

The assertions are on outcomes, not on speed: an engine that answers after the phase's deadline but before a
second per-engine timeout would have run out counts as failed."""

from __future__ import annotations

import threading

import pytest

from learner.weight_sync import _bounded, _Fanout, _Sender, error_text
from rollout import contracts


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


def test_error_text_is_one_line_with_the_type_even_without_a_message():
    assert error_text(RuntimeError("gloo: connection closed\nat ...")) == "RuntimeError: gloo: connection closed"
    assert error_text(TimeoutError()) == "TimeoutError: (no message)"
    assert error_text(ValueError("x" * 400)) == "ValueError: " + "x" * 300
    for err in (RuntimeError("a\nb"), TimeoutError(), ValueError("x" * 400)):  # the engine side's twin
        assert contracts.error_text(err) == error_text(err)


def test_a_broadcast_failing_without_a_message_falls_back_to_the_object_store():
    """Before, the first line of an empty error text was an IndexError raised inside the except clause: the
    sync crashed instead of handing the rest to the object store."""
    import torch

    class Group:
        members: list[int] = []
        closed = False

        def broadcast(self, flat, timeout_s):
            raise TimeoutError()

        def close(self):
            self.closed = True

    group = Group()
    sender = _Sender(_Fanout([], None), 2, group)
    sender.send(0, {"w": torch.ones(2)})
    assert sender.fallback == "bucket 0: TimeoutError: (no message)"
    assert sender.group is None and group.closed
