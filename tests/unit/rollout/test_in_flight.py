"""In-flight weight updates' bookkeeping (``rollout.in_flight``): each sampled token's version from the marks the
engine takes at every load while a turn is open (hand-computed cases and the errors)."""

from __future__ import annotations

import pytest

from rollout.in_flight import token_versions


def test_one_version_when_no_load_came():
    assert token_versions([(0, 4)], 3) == [4, 4, 4]
    assert token_versions([(0, 4)], 0) == []


def test_tokens_after_each_load_carry_its_version():
    # 2 tokens at v3, a load, 3 tokens at v4, a load, the rest at v5
    assert token_versions([(0, 3), (2, 4), (5, 5)], 7) == [3, 3, 4, 4, 4, 5, 5]


def test_a_load_before_the_first_token_or_two_loads_between_tokens_leave_no_empty_version():
    assert token_versions([(0, 3), (0, 4)], 2) == [4, 4]  # the turn joined during the load
    assert token_versions([(0, 1), (2, 2), (2, 3)], 4) == [1, 1, 3, 3]


def test_a_turn_that_ended_before_a_mark_it_never_reached():
    assert token_versions([(0, 1), (5, 2)], 3) == [1, 1, 1]


@pytest.mark.parametrize("marks", [[], [(1, 0)], [(0, 1), (3, 2), (2, 3)]])
def test_bad_marks_are_refused(marks):
    with pytest.raises(ValueError, match="marks"):
        token_versions(marks, 4)


def _routing(tokens, experts):
    import numpy as np

    ids = np.array([[[e, e + 1]] for e in experts], dtype=np.int16)  # [T, 1 layer, k=2]
    return np.array(tokens, dtype=np.int64), ids


def test_r3_merge_keeps_the_experts_recorded_before_the_load():
    import numpy as np

    from rollout.in_flight import merge_routing

    # before the load: positions 0-3 (two of them from the prefix cache, filled); after it, keep mode records
    # positions 4-5 only (the earlier ones' tokens, ids -1); recompute records 0-5 again under the new weights
    head = _routing([5, 6, 7, 8], [0, 1, 2, 3])
    keep = _routing([5, 6, 7, 8, 9, 10], [-1, -1, -1, -1, 4, 5])
    tokens, ids = merge_routing(head, keep)
    assert tokens.tolist() == [5, 6, 7, 8, 9, 10] and ids[:, 0, 0].tolist() == [0, 1, 2, 3, 4, 5]
    recompute = _routing([5, 6, 7, 8, 9, 10], [6, 6, 6, 6, 4, 5])
    assert merge_routing(head, recompute)[1][:, 0, 0].tolist() == [0, 1, 2, 3, 4, 5]
    gap = merge_routing(head, _routing([-1] * 6, [-1] * 5 + [5]))
    assert gap[0].tolist() == [5, 6, 7, 8, -1, -1] and gap[1][:, 0, 0].tolist() == [0, 1, 2, 3, -1, 5]
    assert merge_routing(None, keep) is keep
    assert np.array_equal(merge_routing(head, head)[1], head[1])
