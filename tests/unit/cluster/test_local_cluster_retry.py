"""``LocalCluster.add_node`` starts a worker node again when Ray's fixed 30 s raylet registration wait ran out
(seen once in CI on a busy 2-core machine), and raises at once for any other failure."""

from __future__ import annotations

import pytest

from cluster.runtime.local_cluster import STARTUP_TIMEOUT, LocalCluster
from cluster.runtime.local_head import SubmitError


def _cluster(monkeypatch, failures: list[str]) -> tuple[LocalCluster, list[int]]:
    """A LocalCluster whose single ``ray start`` fails with ``failures`` in turn, then succeeds."""
    cluster = LocalCluster.__new__(LocalCluster)
    calls: list[int] = []

    def start(cpus, resources, timeout_s):
        calls.append(cpus)
        if len(calls) <= len(failures):
            raise SubmitError(f"`ray start` of worker node 1 failed:\n{failures[len(calls) - 1]}")
        return {"index": 1, "cpus": cpus}

    monkeypatch.setattr(cluster, "_start_node", start)
    return cluster, calls


def test_a_startup_timeout_is_tried_again(monkeypatch, capsys):
    cluster, calls = _cluster(monkeypatch, [f"Exception: The current node {STARTUP_TIMEOUT}. This could ..."])
    assert cluster.add_node(1) == {"index": 1, "cpus": 1}
    assert calls == [1, 1] and "attempt 1 of 2" in capsys.readouterr().err


def test_other_failures_and_the_last_attempt_raise(monkeypatch):
    cluster, calls = _cluster(monkeypatch, ["ValueError: bad --resources"])
    with pytest.raises(SubmitError, match="bad --resources"):
        cluster.add_node(1)
    assert calls == [1]
    cluster, calls = _cluster(monkeypatch, [STARTUP_TIMEOUT] * 2)
    with pytest.raises(SubmitError, match=STARTUP_TIMEOUT):
        cluster.add_node(1, attempts=2)
    assert calls == [1, 1]
