"""``RoutingStore``: engine routings by input tokens, prefix-cache hits filled from the request that computed the
cached KV (hand-made records in ``RoutingCapture.take``'s format; the engine-side test with real cache hits is in
tests/integration/test_rollout_routing.py)."""

from __future__ import annotations

import numpy as np
import pytest

from rollout.routing_capture import RoutingStore

LAYERS, K = 2, 2


@pytest.fixture(params=[2, 4, 16], ids=lambda b: f"block{b}")
def store(request):
    """A store whose KV block size makes the tests' cached prefixes (2, 3, 4, 8 tokens) block-aligned (indexed
    lookup) or not (the scan)."""
    return RoutingStore(block_size=request.param)


def routing(length: int, base: int) -> np.ndarray:
    """Distinct int16 [length, LAYERS, K] ids: position p, layer l, slot j -> base + 4p + 2l + j."""
    p, l, j = np.meshgrid(np.arange(length), np.arange(LAYERS), np.arange(K), indexing="ij")
    return (base + 4 * p + 2 * l + j).astype(np.int16)


def record(tokens: list[int], ids: np.ndarray, cached: int = 0) -> dict:
    """A take() record whose first ``cached`` positions came from the prefix cache (ids -1, tokens kept)."""
    ids = ids.copy()
    ids[:cached] = -1
    return {"tokens": list(tokens), "ids": ids.tobytes(), "shape": list(ids.shape)}


def test_full_records_are_found_by_their_input_tokens(store):
    ids = routing(4, 0)
    store.add([record([5, 6, 7, 8], ids)])
    # a completion of prompt + response [5, 6, 7, 8, 9]: its inputs are the first four tokens
    assert np.array_equal(store.get([5, 6, 7, 8, 9]), ids)
    with pytest.raises(KeyError, match="4 input tokens"):
        store.get([5, 6, 7, 1, 9])
    assert store.filled_positions == 0 and store.unresolved == 0


def test_a_cache_hit_takes_the_donors_experts_for_the_cached_positions_only(store):
    donor, own = routing(5, 0), routing(6, 100)
    store.add([record([1, 2, 3, 4, 5], donor)])
    store.add([record([1, 2, 3, 4, 9, 9], own, cached=4)])  # a later call, same weight version
    got = store.get([1, 2, 3, 4, 9, 9, 0])
    assert np.array_equal(got[:4], donor[:4]) and np.array_equal(got[4:], own[4:])
    assert store.filled_positions == 4 and store.unresolved == 0


def test_chains_of_hits_resolve_in_one_take_whatever_the_order(store):
    """A computed 0..7; B hit A's first 4 and computed 4..9; C hit B's first 8 (4 of them B's own)."""
    a, b, c = routing(8, 0), routing(10, 1000), routing(10, 2000)
    tok_a = [1, 2, 3, 4, 5, 6, 7, 8]
    tok_b = [1, 2, 3, 4, 50, 60, 70, 80, 90, 91]
    tok_c = [1, 2, 3, 4, 50, 60, 70, 80, 11, 12]
    store.add([record(tok_c, c, cached=8), record(tok_b, b, cached=4), record(tok_a, a)])
    got_c = store.get(tok_c + [0])
    assert np.array_equal(got_c[:4], a[:4]) and np.array_equal(got_c[4:8], b[4:8])
    assert np.array_equal(got_c[8:], c[8:])
    assert store.filled_positions == 12 and store.unresolved == 0


def test_a_hit_without_a_donor_or_with_a_middle_gap_is_left_out_and_counted(store):
    store.add([record([1, 2, 3, 4], routing(4, 0))])
    no_donor = record([7, 7, 3, 4], routing(4, 10), cached=2)
    gap = routing(4, 20)
    gap[2] = -1
    unknown_prefix = record([-1, -1, 3, 4], routing(4, 30), cached=2)  # cached tokens not reported
    store.add([no_donor, {"tokens": [1, 2, 3, 5], "ids": gap.tobytes(), "shape": list(gap.shape)}, unknown_prefix])
    assert store.unresolved == 3
    for tokens in ([7, 7, 3, 4, 0], [1, 2, 3, 5, 0]):
        with pytest.raises(KeyError):
            store.get(tokens)


def test_clear_forgets_the_weight_versions_routings(store):
    store.add([record([1, 2, 3, 4], routing(4, 0))])
    store.clear()
    with pytest.raises(KeyError):
        store.get([1, 2, 3, 4, 0])
    store.add([record([1, 2, 3, 9], routing(4, 50), cached=3)])  # the old version cannot donate any more
    assert store.unresolved == 1 and store.filled_positions == 0


def test_block_size_must_be_positive():
    with pytest.raises(ValueError, match="block_size=0"):
        RoutingStore(block_size=0)


def test_indexed_lookup_checks_the_tokens_not_only_the_hash(monkeypatch):
    """Every chain hash equal (a forced collision): the donor must still be the record whose tokens match."""
    store = RoutingStore(block_size=2)
    monkeypatch.setattr(store, "_chain", lambda key: ((p, 0) for p in range(2, len(key) + 1, 2)))
    wrong, right = routing(4, 0), routing(4, 50)
    store.add([record([9, 9, 3, 4], wrong), record([1, 2, 3, 4], right)])
    store.add([record([1, 2, 7, 7], routing(4, 100), cached=2)])
    assert np.array_equal(store.get([1, 2, 7, 7, 0])[:2], right[:2])
