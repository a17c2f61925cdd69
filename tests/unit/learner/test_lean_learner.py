"""A lean learner (issue 11, item 4): micro-batches by token budget, the pre-update pass only when a setting
needs it, gradient checkpointing as an option.

Real DeepSpeed (CPU accelerator, gloo) on the embedded tiny Qwen3-MoE, one rank in this process; the
two-rank test (a token budget that gives the ranks different numbers of micro-batches) is slow.
"""

from __future__ import annotations

import pytest
import torch

from learner.config import LearnerConfig
from learner.microbatch import length_order, micro_slices, row_widths


def _mask(widths: list[int], length: int = 12) -> torch.Tensor:
    am = torch.zeros((len(widths), length), dtype=torch.long)
    for i, w in enumerate(widths):
        am[i, :w] = 1
    return am


def test_row_widths_are_the_last_attended_column_plus_one():
    assert row_widths(_mask([5, 12, 1, 0, 3])) == [5, 12, 2, 2, 3]  # at least 2 (one input, one target)


def test_fixed_size_slices():
    am = _mask([3] * 7)
    assert micro_slices(am, 3) == [(0, 3), (3, 6), (6, 7)]
    assert micro_slices(am, 10) == [(0, 7)]
    assert micro_slices(am[:0], 3) == []
    with pytest.raises(ValueError, match="micro_batch_size"):
        micro_slices(am, 0)


def test_token_budget_packs_consecutive_rows_by_their_own_longest_row():
    am = _mask([4, 6, 3, 10, 2, 2, 2, 12])
    # budget 12: [4, 6] -> 2 x 6 = 12; + 3 -> 3 x 6 = 18 > 12, so a new one: [3] (+10 -> 2 x 10 > 12), [10] alone,
    # [2, 2, 2] -> 3 x 2 = 6 (+12 -> 4 x 12 > 12), [12] alone (exactly the budget).
    assert micro_slices(am, 99, max_tokens=12) == [(0, 2), (2, 3), (3, 4), (4, 7), (7, 8)]
    # budget 20: [4, 6, 3] -> 3 x 6 = 18; + 10 -> 4 x 10 > 20; [10, 2] -> 20; + 2 -> 30 > 20; [2, 2, 2] -> 6; + 12 -> 48.
    assert micro_slices(am, 99, max_tokens=20) == [(0, 3), (3, 5), (5, 7), (7, 8)]
    # a budget below every row: each row alone; a budget above the whole batch: one micro-batch.
    assert micro_slices(am, 99, max_tokens=1) == [(i, i + 1) for i in range(8)]
    assert micro_slices(am, 1, max_tokens=1000) == [(0, 8)]
    with pytest.raises(ValueError, match="max_tokens"):
        micro_slices(am, 2, max_tokens=0)


def test_length_order_is_longest_first_and_stable():
    assert length_order(_mask([5, 12, 1, 0, 3])) == [1, 0, 4, 2, 3]  # widths 5, 12, 2, 2, 3; the two 2s in order
    assert length_order(_mask([])) == []


def _padded_tokens(am: torch.Tensor, slices: list[tuple[int, int]]) -> int:
    w = row_widths(am)
    return sum((hi - lo) * max(w[lo:hi]) for lo, hi in slices)


def test_length_order_pads_less():
    """Widths 12, 3, 12, 3 in 2-row micro-batches: 2 x 12 + 2 x 12 = 48 tokens as sent, 2 x 12 + 2 x 3 = 30
    longest first."""
    am = _mask([12, 3, 12, 3])
    assert _padded_tokens(am, micro_slices(am, 2)) == 48
    sorted_am = am[length_order(am)]
    assert _padded_tokens(sorted_am, micro_slices(sorted_am, 2)) == 30


@pytest.mark.parametrize("seed", range(20))
def test_token_budget_slices_cover_every_row_within_the_budget(seed):
    g = torch.Generator().manual_seed(seed)
    widths = torch.randint(0, 31, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
    budget = int(torch.randint(1, 120, (1,), generator=g))
    am = _mask(widths, length=31)
    slices = micro_slices(am, 4, max_tokens=budget)
    assert [lo for lo, _ in slices] == [0] + [hi for _, hi in slices[:-1]] and slices[-1][1] == len(widths)
    w = row_widths(am)
    for k, (lo, hi) in enumerate(slices):
        assert hi > lo
        cost = (hi - lo) * max(w[lo:hi])
        assert cost <= budget or hi - lo == 1
        if k + 1 < len(slices):  # greedy: the next row would not have fitted
            assert (hi + 1 - lo) * max(w[lo : hi + 1]) > budget


def test_config_keys_and_refusals():
    cfg = LearnerConfig()
    assert cfg.max_tokens_per_micro_batch is None and cfg.pre_update_pass == "auto" and not cfg.gradient_checkpointing
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        LearnerConfig(max_tokens_per_micro_batch=0)
    with pytest.raises(ValueError, match=r"learner.moe_diagnostics=true need\(s\) the pre-update pass"):
        LearnerConfig(pre_update_pass="never")
    with pytest.raises(ValueError, match="learner.old_logprob_source=.recompute., learner.routing_replay=.learner."):
        LearnerConfig(pre_update_pass="never", moe_diagnostics=False, old_logprob_source="recompute",
                      routing_replay=True)
    lean = LearnerConfig(pre_update_pass="never", moe_diagnostics=False)
    assert lean.pre_update_pass_needs(None) == []
    assert lean.pre_update_pass_needs({"max_grad_norm": 1.0, "min_entropy": 0.1, "max_load_imbalance": 4.0}) == [
        "health.min_entropy", "health.max_load_imbalance"]
    assert lean.pre_update_pass_needs({"max_load_imbalance": 4.0}, is_moe=False) == []
    assert LearnerConfig().pre_update_pass_needs({}, is_moe=False) == []
    with pytest.raises(ValueError, match="learner.gradient_checkpointing=true with learner.routing_replay=.learner."):
        LearnerConfig(gradient_checkpointing=True, routing_replay=True)


def test_mismatch_monitor_every_defaults_on_and_refuses_negative():
    assert LearnerConfig().mismatch_monitor_every == 10
    with pytest.raises(ValueError, match="mismatch_monitor_every"):
        LearnerConfig(mismatch_monitor_every=-1)
