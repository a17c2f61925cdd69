"""The copy baselines of ``bench/sync.py`` (fast: no services). No timings are asserted, only what is timed:
the warm baseline copies every byte into destinations allocated once, after an untimed warm-up."""

from __future__ import annotations

import math

import pytest
import torch

from bench.sync import best_seconds, clone_seconds, copy_into, warm_copy_seconds


def test_best_seconds_runs_warmup_untimed_then_repeats():
    calls = []
    seconds = best_seconds(lambda: calls.append(1), repeats=3, warmup=2)
    assert len(calls) == 5
    assert seconds >= 0 and math.isfinite(seconds)


@pytest.mark.parametrize("repeats,warmup", [(0, 0), (1, -1)])
def test_best_seconds_rejects_bad_counts(repeats, warmup):
    with pytest.raises(ValueError, match="repeats"):
        best_seconds(lambda: None, repeats=repeats, warmup=warmup)


def test_copy_into_writes_the_preallocated_destinations():
    g = torch.Generator().manual_seed(0)
    src = [torch.randn((3, 4), generator=g), torch.randn((5,), generator=g), torch.randn((), generator=g)]
    dst = [torch.zeros_like(x) for x in src]
    ptrs = [d.data_ptr() for d in dst]
    copy_into(dst, src)
    assert all(torch.equal(d, x) for d, x in zip(dst, src))
    assert [d.data_ptr() for d in dst] == ptrs  # in place: nothing allocated
    with pytest.raises(ValueError):
        copy_into(dst[:2], src)  # a missing destination is an error, not a shorter copy


def test_best_seconds_is_the_fastest_call_on_the_clock(monkeypatch):
    """On a scripted clock (calls of 5, 2 and 7 s) the figure is the fastest call's, not the mean or the last."""
    import bench.sync as bench_sync

    ticks = iter([0.0, 5.0, 10.0, 12.0, 20.0, 27.0])
    monkeypatch.setattr(bench_sync.time, "perf_counter", lambda: next(ticks))
    assert best_seconds(lambda: None, repeats=3) == 2.0


def test_baselines_time_the_copy_they_name(monkeypatch):
    """Each baseline times the work it names: the warm copy calls ``copy_into`` on the same pre-allocated
    destinations every time (one untimed warm-up, then the repeats), the cold one clones fresh tensors."""
    import bench.sync as bench_sync

    shapes = [(64, 32), (16,)]
    seen = []
    real_copy = bench_sync.copy_into
    monkeypatch.setattr(bench_sync, "copy_into", lambda dst, src: (seen.append([d.data_ptr() for d in dst]),
                                                                  real_copy(dst, src)))
    seconds = warm_copy_seconds(shapes, repeats=3)
    assert len(seen) == 4 and all(ptrs == seen[0] for ptrs in seen)  # warm-up + 3 repeats, same buffers
    assert math.isfinite(seconds) and seconds >= 0
    cold = clone_seconds(shapes, repeats=2)
    assert math.isfinite(cold) and cold >= 0
