"""Elastic learner threads (learner.elastic_threads): the /proc/stat arithmetic on hand-made files, and the
thread decisions on a scripted machine (another process busy, then idle, then busy again)."""

from __future__ import annotations

import pytest
import torch

from learner import elastic_threads as et
from learner.config import LearnerConfig


def test_busy_seconds_sums_the_cores_asked_for_without_idle_and_iowait(tmp_path):
    stat = tmp_path / "stat"
    # fields: user nice system idle iowait irq softirq steal (clock ticks)
    stat.write_text("cpu  999 0 0 0 0 0 0 0\n"
                    "cpu0 100 5 20 1000 7 1 2 3 0 0\n"
                    "cpu1 50 0 10 2000 0 0 0 0 0 0\n"
                    "cpu10 4000 0 0 0 0 0 0 0 0 0\n"
                    "intr 12345\n")
    ticks = et._TICKS
    assert et.busy_seconds({0}, str(stat)) == pytest.approx((100 + 5 + 20 + 1 + 2 + 3) / ticks)
    assert et.busy_seconds({0, 1}, str(stat)) == pytest.approx((131 + 60) / ticks)
    assert et.busy_seconds({10}, str(stat)) == pytest.approx(4000 / ticks)  # cpu10 is not cpu1
    assert et.busy_seconds({5}, str(stat)) == 0.0


@pytest.mark.parametrize("idle,want", [(0.0, 1), (0.74, 1), (1.2, 1), (1.75, 2), (2.0, 2), (3.9, 3), (8.0, 3)])
def test_threads_for_counts_a_core_idle_at_75_percent_within_bounds(idle, want):
    assert et.threads_for(idle, 1, 3) == want


class _Machine:
    """Two cores; ``others`` = cores' worth of CPU other processes use, ``mine`` = this process's."""

    def __init__(self):
        self.t = self.busy = self.own = 0.0

    def run(self, seconds: float, others: float, mine: float) -> None:
        self.t += seconds
        self.busy += seconds * (others + mine)
        self.own += seconds * mine


@pytest.fixture
def machine(monkeypatch):
    """A scripted two-core ``_Machine`` behind the module's clock and /proc readings; torch's thread count is
    restored afterwards."""
    m = _Machine()
    monkeypatch.setattr(et.time, "monotonic", lambda: m.t)
    monkeypatch.setattr(et, "busy_seconds", lambda cores: m.busy)
    monkeypatch.setattr(et, "own_seconds", lambda: m.own)
    monkeypatch.setattr(et.os, "sched_getaffinity", lambda _: {0, 1})
    before = torch.get_num_threads()
    yield m
    torch.set_num_threads(before)


def _decide(e: et.ElasticThreads) -> int:
    """Close the window (the watcher's tick) and decide, as before a forward."""
    e.tick()
    return e.adjust()


def test_elastic_threads_take_idle_cores_and_give_them_back(machine):
    m = machine
    e = et.ElasticThreads(1, 2, watch=False)
    e.start()
    assert torch.get_num_threads() == 1
    m.run(0.5, others=1.0, mine=1.0)  # the engine generates on the other core
    assert _decide(e) == 1
    m.run(0.5, others=0.05, mine=1.0)  # it is done: the core is idle (the driver uses 5%)
    assert _decide(e) == 2 and torch.get_num_threads() == 2
    m.run(0.5, others=0.05, mine=2.0)  # our two threads busy: still the same idle core to us
    assert _decide(e) == 2
    m.run(0.01, others=1.0, mine=2.0)  # too short an interval to judge: no change, interval kept
    assert _decide(e) == 2
    m.run(0.5, others=1.0, mine=1.0)  # the engine starts again
    assert _decide(e) == 1 and torch.get_num_threads() == 1
    m.run(0.5, others=0.0, mine=1.0)
    assert _decide(e) == 2
    e.start()  # a new update starts at the floor
    assert e.threads == 1 and torch.get_num_threads() == 1 and e.changes == 4


def test_elastic_threads_decide_on_the_latest_window_not_the_whole_interval(machine):
    """The engine busy for 1.5 s of a 1.7 s micro-batch, idle for the last 0.2 s: averaged over the interval the
    other core looks 88% busy (one thread), but the latest window (the watcher's tick) sees it idle: two
    threads at once."""
    m = machine
    e = et.ElasticThreads(1, 2, period=0.2, watch=False)
    e.start()
    assert e.adjust() == 1 and e.recent_idle is None  # no complete window yet: the floor
    m.run(1.5, others=1.0, mine=1.0)
    e.tick()
    assert e.adjust() == 1 and e.recent_idle == pytest.approx(1.0)
    m.run(0.2, others=0.0, mine=1.0)
    e.tick()
    assert e.recent_idle == pytest.approx(2.0) and e.adjust() == 2 and torch.get_num_threads() == 2
    m.run(0.2, others=1.0, mine=2.0)  # the engine is back: the next window drops the rank to one thread
    e.tick()
    assert e.adjust() == 1


def test_elastic_threads_config_refusals():
    assert LearnerConfig(max_threads_per_rank=2).max_threads_per_rank == 2
    with pytest.raises(ValueError, match="max_threads_per_rank=1 is below learner.threads_per_rank=2"):
        LearnerConfig(threads_per_rank=2, max_threads_per_rank=1)
    with pytest.raises(ValueError, match="max_threads_per_rank=2 is a CPU setting"):
        LearnerConfig(max_threads_per_rank=2, num_gpus_per_rank=1)
    with pytest.raises(ValueError, match="threads_per_rank"):
        et.ElasticThreads(2, 1)
