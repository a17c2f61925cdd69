"""In-flight weight updates (``sync.in_flight``): what the engine does to vLLM's scheduler when new weights load
while requests are open, and each sampled token's weight version.

A load happens between two scheduler steps (``RolloutEngine.advance_turns`` steps vLLM itself, in this process),
so every token is sampled by exactly one version: the tokens an open request had when the load finished are the
old version's, the ones after it the new one's (``token_versions`` expands the marks the engine keeps per turn).
What happens to the KV cache the open requests hold (computed under the old weights):

- ``keep``: they keep it. The tokens they sample next are the new weights' applied to that KV; their log-probs
  are exactly the distribution that sampled them (the behaviour policy). No request may reuse that KV later:
  ``isolate_old_kv`` drops every prefix-cache hash (blocks still in use stay allocated to their request; vLLM's
  own ``reset_prefix_cache`` refuses while any block is in use) and stops the open requests from registering
  the blocks they fill later (each of those would hold KV mixing the two versions).
- ``recompute``: vLLM's own mechanism, ``reset_prefix_cache(reset_running_requests=True)``: every running request
  is preempted (its blocks freed, its tokens kept, nothing re-sampled), the cache is emptied, and at the next step
  vLLM recomputes each request's prompt and sampled tokens under the new weights before it samples again. Costs
  one prefill of every open request per load.

The functions here take vLLM's in-process ``Scheduler`` (``scheduler(llm)``) and use its block pool and KV-cache
managers as vLLM 0.32 has them; ``tests/integration/test_in_flight.py`` checks the outcome against fresh forwards.
"""

from __future__ import annotations

import sys
from typing import Any

MODES = ("off", "keep", "recompute")


def token_versions(marks: list[tuple[int, int]], count: int) -> list[int]:
    """Each sampled token's weight version from a turn's marks.

    Args:
        marks: ``[(first_token_index, version), ...]`` in the order they were taken: from that index on, tokens
            were sampled by that version (a later mark at the same index replaces an earlier one: a load that
            finished before the turn sampled anything). Must not be empty and must start at index 0.
        count: the turn's sampled tokens (>= 0).

    Returns:
        ``count`` ints, non-decreasing where the versions are.

    Raises:
        ValueError: empty marks, a first mark not at 0, or indices that go down.
    """
    if not marks or marks[0][0] != 0:
        raise ValueError(f"token version marks {marks!r} must start at token 0")
    if any(b[0] < a[0] for a, b in zip(marks, marks[1:])):
        raise ValueError(f"token version marks {marks!r} must not go back")
    out: list[int] = []
    for i, (start, version) in enumerate(marks):
        end = marks[i + 1][0] if i + 1 < len(marks) else count
        out += [version] * max(0, min(end, count) - min(start, count))
    return out


def scheduler(llm: Any) -> Any:
    """The ``vllm.v1.core.sched.scheduler.Scheduler`` of an ``LLM`` whose engine core runs in this process.

    Raises:
        RuntimeError: the engine core is another process (``rollout.in_process=false``) or vLLM schedules
            asynchronously (a step's tokens would still be in flight when the load runs).
    """
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    sched = getattr(core, "scheduler", None)
    if sched is None:
        raise RuntimeError("in-flight weight updates need vLLM's engine core in this process "
                           "(rollout.in_process=true)")
    if getattr(llm.llm_engine.vllm_config.scheduler_config, "async_scheduling", False):
        raise RuntimeError("in-flight weight updates need vLLM's synchronous scheduling (async_scheduling is on)")
    return sched


def output_counts(sched: Any, request_ids: dict[str, str]) -> dict[str, int]:
    """Tokens each open request has sampled so far: ``{key: count}`` for ``request_ids`` (key -> vLLM request
    id); a request the scheduler no longer holds (it finished in the last step, not taken yet) is left out."""
    return {key: int(sched.requests[rid].num_output_tokens) for key, rid in request_ids.items()
            if rid in sched.requests}


def isolate_old_kv(sched: Any) -> int:
    """``keep``: make the KV computed under the old weights unreachable for any later request, while the
    requests that hold it keep it. Drops every block's prefix-cache hash (in use or free), then marks every
    request that holds blocks as fully cached in each KV-cache manager, so none of its later blocks is
    registered either. Returns the number of requests so marked.

    Raises:
        RuntimeError: a block still hashed afterwards (vLLM's block pool changed under this code).
    """
    manager = sched.kv_cache_manager
    pool = manager.block_pool
    pool.evict_blocks({b.block_id for b in pool.blocks if not b.is_null})
    marked = 0
    for single in manager.coordinator.single_type_managers:
        for rid in list(single.req_to_blocks):
            single.num_cached_block[rid] = sys.maxsize  # cache_blocks: nothing left to cache for it
            marked += 1
    if any(b.block_hash is not None for b in pool.blocks):
        raise RuntimeError("in-flight load (keep): prefix-cache hashes survived the eviction")
    return marked


def record_arrays(rec: dict[str, Any]) -> tuple[Any, Any]:
    """A ``RoutingCapture.take`` record as numpy arrays: int64 tokens ``[T]`` and int16 ids ``[T, layers, k]``
    (-1 where a position was not recorded)."""
    import numpy as np

    return (np.asarray(rec["tokens"], dtype=np.int64),
            np.frombuffer(rec["ids"], dtype=np.int16).reshape(rec["shape"]).copy())


def merge_routing(head: tuple[Any, Any] | None, new: tuple[Any, Any]) -> tuple[Any, Any]:
    """R3 across in-flight loads: a request's routing recorded before a load (``head``) and after it (``new``),
    each ``(tokens int64 [T], ids int16 [T, layers, k])`` with -1 where not recorded. A position recorded in
    ``head`` keeps those experts (the forward the next token was sampled from; ``recompute`` computes it again
    under the new weights, which only the tokens after the load saw), the others come from ``new``.

    Returns:
        ``(tokens, ids)`` of length ``max`` of the two.
    """
    import numpy as np

    if head is None:
        return new
    length = max(len(head[0]), len(new[0]))
    tokens = np.full(length, -1, dtype=np.int64)
    ids = np.full((length, *new[1].shape[1:]), -1, dtype=np.int16)
    for t, i in (new, head):  # head last: it wins where it has a record
        have = i[:, 0, 0] >= 0
        tokens[: len(t)][t >= 0] = t[t >= 0]
        ids[: len(i)][have] = i[have]
    return tokens, ids
