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


def test_baselines_return_seconds():
    shapes = [(64, 32), (16,)]
    for seconds in (warm_copy_seconds(shapes, repeats=2), clone_seconds(shapes, repeats=2)):
        assert seconds > 0 and math.isfinite(seconds)
