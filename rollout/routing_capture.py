"""Rollout routing capture (engine side of R3, rollout routing replay): which experts the engine ran per token.

R3 (Ma et al., "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference Routers", arXiv
2510.11370): the learner replays, in its training forwards, the experts the *inference engine* chose when it
sampled the rollout, so that train-time and rollout-time routing agree. vLLM 0.32 returns these as
``CompletionOutput.routed_experts`` (``LLM(enable_return_routed_experts=True)``), but only with Model Runner V2,
which needs Triton: on this CPU it is refused at ``LLM(...)`` ("Model Runner V2 requires Triton",
``vllm/config/vllm.py``). What does run here is vLLM's own capture point: every MoE layer's router
(``vllm/model_executor/layers/fused_moe/router/base_router.py``, ``BaseRouter._select_experts``) calls
``capture_fn(topk_ids)`` with the logical expert ids the kernel then runs, before any EPLB remapping; vLLM's
MRV2 connector binds it the same way (``routed_experts_capturer.bind_routed_experts_capturer``).
``RoutingCapture`` binds that callback itself and maps the batch rows to requests with the V1 model runner's
own per-step buffers (``req_indices``, ``positions``, ``input_ids``, filled before the forward).

Cost: per forward and MoE layer one ``[tokens, k]`` int16 copy; per step a few small numpy copies.

What is recorded, exactly: for every request and every input position the engine COMPUTED, the ``[layers, k]``
expert ids of that position (the position's hidden state at layer ``l`` went through those experts). A sampled
response's positions are ``0 .. P + R - 2`` (prompt plus all response tokens but the last, which is sampled and
never fed back). Positions served from the prefix cache are not computed here; ``take`` keeps their input
tokens and ``RoutingStore`` fills their experts from the earlier request of the same weight version that computed
that KV (see its docstring): prefix caching stays on under capture. A sequence with any other gap is refused.

Runs inside vLLM's worker (``worker_extension_cls``); imports vLLM lazily.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["RoutingCapture", "RoutingStore"]


class RoutingCapture:
    """Records the experts every MoE router of a vLLM model ran, per request and position.

    Args:
        runner: the worker's V1 model runner (``worker.model_runner``; ``GPUModelRunner`` or the CPU subclass).

    Raises:
        ValueError: the model has no MoE layer with a ``BaseRouter`` (nothing to capture), or a runner without
            the per-step buffers used to map rows to requests (a model runner this was not written for).
    """

    def __init__(self, runner: Any):
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        for attr in ("req_indices", "positions", "input_ids", "input_batch"):
            if not hasattr(runner, attr):
                raise ValueError(f"model runner {type(runner).__name__} has no {attr!r}: routing capture needs the "
                                 "V1 model runner's per-step buffers")
        self._runner = runner
        layers = []
        for module in runner.get_model().modules():
            if isinstance(module, MoERunner) and isinstance(getattr(module, "router", None), BaseRouter):
                layers.append(module)
        if not layers:
            raise ValueError("routing capture: the engine's model has no MoE layer with a vLLM BaseRouter")
        self.layer_ids = sorted(int(m.layer_id) for m in layers)
        self._slot = {lid: i for i, lid in enumerate(self.layer_ids)}
        for m in layers:
            m.router.set_capture_fn(self._make_fn(int(m.layer_id)))
        self._steps: list[dict[str, Any]] = []
        self._parts: dict[str, list] = {}  # request -> (positions, tokens, ids) recorded but not taken yet
        self._prefix_tokens: dict[str, np.ndarray] = {}  # request -> input tokens it took from the prefix cache

    def _make_fn(self, layer_id: int):
        def capture(topk_ids: torch.Tensor) -> None:
            self._capture(layer_id, topk_ids)

        return capture

    def _capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        runner = self._runner
        num_reqs = int(runner.input_batch.num_reqs)
        if num_reqs == 0:  # dummy / profiling forwards
            return
        slot = self._slot[layer_id]
        if slot == 0:
            total = int(runner.query_start_loc.np[num_reqs])
            step = {
                "req_ids": list(runner.input_batch.req_ids[:num_reqs]),
                "req_index": np.array(runner.req_indices.np[:total], copy=True),
                "positions": runner.positions[:total].cpu().numpy().copy(),
                "tokens": runner.input_ids.cpu[:total].numpy().copy(),
                "ids": [None] * len(self.layer_ids),
            }
            self._steps.append(step)
            self._note_prefix_hits(step, runner.query_start_loc.np[:num_reqs])
        step = self._steps[-1]
        step["ids"][slot] = topk_ids[: len(step["positions"])].detach().to("cpu", torch.int16).numpy().copy()

    def _note_prefix_hits(self, step: dict[str, Any], starts: np.ndarray) -> None:
        """For a request seen for the first time whose first computed position ``p0`` is above 0 (positions
        ``0 .. p0-1`` served from the prefix cache), keep those input tokens from the persistent batch: the
        driver finds, by them, the request whose computation filled those cache blocks (``RoutingStore``)."""
        token_ids = self._runner.input_batch.token_ids_cpu
        for r, req_id in enumerate(step["req_ids"]):
            if req_id in self._prefix_tokens:
                continue
            p0 = int(step["positions"][int(starts[r])])
            self._prefix_tokens[req_id] = np.array(token_ids[r, :p0], dtype=np.int32, copy=True)

    def take(self, only: list[str] | None = None) -> list[dict[str, Any]]:
        """The routings recorded for requests (all, or the vLLM request ids in ``only``), then forgotten; the
        other requests' records are kept for a later call (turns still running: ``RolloutEngine.advance_turns``
        takes each turn's when it ends).

        Returns:
            ``[{"tokens": list of T ints, "ids": bytes of int16 [T, layers, k], "shape": [T, layers, k],
            "request": the vLLM request id}, ...]``:
            for positions ``0 .. T-1`` of the request, the input token and the experts each MoE layer ran for
            it; ``T`` is one past the highest recorded position. Positions served from the prefix cache (a
            leading run ``0 .. p0-1``) have ids -1 and their input tokens; a position missing otherwise has
            token -1 and ids -1.
        """
        for step in self._steps:
            if any(ids is None for ids in step["ids"]):
                continue  # a forward interrupted between layers: nothing of it is trusted
            stacked = np.stack(step["ids"], axis=1)  # [tokens, layers, k]
            for r, req_id in enumerate(step["req_ids"]):
                rows = step["req_index"] == r
                self._parts.setdefault(req_id, []).append(
                    (step["positions"][rows], step["tokens"][rows], stacked[rows]))
        self._steps = []
        wanted = list(self._parts) if only is None else [r for r in only if r in self._parts]
        out = [{**self._record(self._parts.pop(req_id), self._prefix_tokens.pop(req_id, None)), "request": req_id}
               for req_id in wanted]
        if only is None:
            self._prefix_tokens = {}
        return out

    def _record(self, parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], prefix: np.ndarray | None) -> dict:
        """One request's ``take`` record from its recorded parts and the tokens it took from the prefix cache."""
        length = max((int(p.max()) + 1 for p, _, _ in parts if len(p)), default=0)
        k = parts[0][2].shape[-1]
        tokens = np.full(length, -1, dtype=np.int32)
        ids = np.full((length, len(self.layer_ids), k), -1, dtype=np.int16)
        if prefix is not None and len(prefix) <= length:
            tokens[: len(prefix)] = prefix  # their ids stay -1: served from the prefix cache
        for pos, tok, rid in parts:
            tokens[pos] = tok
            ids[pos] = rid
        # plain bytes and lists: they cross vLLM's msgpack hop in multi-process mode unchanged
        return {"tokens": tokens.tolist(), "ids": ids.tobytes(), "shape": list(ids.shape)}


class RoutingStore:
    """The engine routings of one weight version, keyed by input tokens, with prefix-cache hits filled in.

    A request that took positions ``0 .. p0-1`` from the prefix cache did not compute them; the KV it attended
    to there was computed by an earlier request of the same weight version (the prefix cache is reset at every
    weight sync) with the same tokens at those positions. Routing at a position depends only on the tokens up
    to it and the weights, and that earlier request recorded the experts that produced the cached KV: its ids
    for ``0 .. p0-1`` are the ones the hitting request's forward used. ``add`` fills them in (donors from this
    take or any earlier one since ``clear``; requests with shorter cached prefixes first, so a donor that itself
    hit the cache is complete before it is used; vLLM caches blocks as they are scheduled, so a sibling sample
    can hit KV computed in the same forward: both records arrive in the same take).

    Which donor: the first recorded request with those tokens. When several requests computed the same prefix
    (after an eviction, say) the cached block may be another's; their routings agree wherever the engine's
    numerics do not depend on the batch (exact in the fp32 CPU test; a risk for bf16 on GPUs).

    Lookup: ``p0`` is a multiple of the KV block size (vLLM caches whole blocks), so each record is indexed by a
    chained hash of its tokens at every block boundary (one dict entry per block), and a hit costs one hash of
    its prefix and one comparison; an unaligned ``p0`` falls back to a scan. Memory: one ``[T, layers, k]``
    int16 array per distinct sequence until ``clear`` (call it at each sync).

    Args:
        block_size: the engine's KV-cache block size, tokens.

    Raises:
        ValueError: ``block_size`` < 1.
    """

    # set by clear() (the constructor calls it)
    _records: dict[tuple[int, ...], np.ndarray]
    _by_block: dict[tuple[int, int], tuple[int, ...]]
    _finals: dict[tuple[int, ...], np.ndarray]
    filled_positions: int
    unresolved: int

    def __init__(self, block_size: int = 16):
        if block_size < 1:
            raise ValueError(f"block_size={block_size!r} must be >= 1")
        self.block_size = int(block_size)
        self.clear()

    def clear(self) -> None:
        """Forget every routing (the prefix cache was reset: no later request can hit an earlier one's KV)."""
        self._finals = {}  # put_final: whole sequences that are no donor (turns open across a weight load)
        self._records = {}
        self._by_block = {}  # (p, chain hash of tokens[:p]) -> record key
        self.filled_positions = 0  # positions taken from a donor since the last clear
        self.unresolved = 0  # records left out: no donor, or a gap other than a leading cached run

    def add(self, taken: list[dict[str, Any]]) -> None:
        """Index ``RoutingCapture.take()``'s records, filling each leading prefix-cache run from a donor."""
        pending = []
        for rec in taken:
            tokens = np.asarray(rec["tokens"], dtype=np.int64)
            ids = np.frombuffer(rec["ids"], dtype=np.int16).reshape(rec["shape"])
            computed = ids[:, 0, 0] >= 0
            p0 = int(np.argmax(computed)) if computed.any() else len(tokens)
            if len(tokens) == 0 or (tokens < 0).any() or not computed[p0:].all():
                self.unresolved += 1
            elif p0 == 0:
                self._put(tuple(tokens.tolist()), ids)
            else:
                pending.append((p0, tokens, ids))
        for p0, tokens, ids in sorted(pending, key=lambda item: item[0]):
            donor = self._donor(tuple(tokens[:p0].tolist()))
            if donor is None:
                self.unresolved += 1
                continue
            full = ids.copy()
            full[:p0] = donor[:p0]
            full.setflags(write=False)
            self.filled_positions += p0
            self._put(tuple(tokens.tolist()), full)

    def resolve(self, rec: dict[str, Any]) -> tuple[np.ndarray, np.ndarray] | None:
        """One ``RoutingCapture.take`` record as int64 tokens ``[T]`` and int16 ids ``[T, layers, k]``, its leading
        prefix-cache run filled from a donor of this store; None when it has another gap or no donor (counted in
        ``unresolved``). Stores nothing (``rollout.in_flight.merge_routing`` keeps it)."""
        tokens = np.asarray(rec["tokens"], dtype=np.int64)
        ids = np.frombuffer(rec["ids"], dtype=np.int16).reshape(rec["shape"]).copy()
        computed = ids[:, 0, 0] >= 0
        p0 = int(np.argmax(computed)) if computed.any() else len(tokens)
        if len(tokens) == 0 or (tokens < 0).any() or not computed[p0:].all():
            self.unresolved += 1
            return None
        if p0:
            donor = self._donor(tuple(tokens[:p0].tolist()))
            if donor is None:
                self.unresolved += 1
                return None
            ids[:p0] = donor[:p0]
            self.filled_positions += p0
        return tokens, ids

    def put_final(self, tokens: np.ndarray, ids: np.ndarray) -> None:
        """Keep a whole sequence's routing for ``get`` without making it a donor: a turn open across an in-flight
        weight load holds experts of two versions, which no later request's prefix hit ran."""
        ids = np.array(ids, dtype=np.int16)
        ids.setflags(write=False)
        self._finals[tuple(int(t) for t in tokens)] = ids

    def _chain(self, key: tuple[int, ...]):
        """``(p, hash of key[:p])`` at every block boundary ``p`` of ``key``."""
        h, b = 0, self.block_size
        for p in range(b, len(key) + 1, b):
            h = hash((h, key[p - b : p]))
            yield p, h

    def _put(self, key: tuple[int, ...], ids: np.ndarray) -> None:
        self._records[key] = ids
        for entry in self._chain(key):
            self._by_block.setdefault(entry, key)

    def _donor(self, prefix: tuple[int, ...]) -> np.ndarray | None:
        """The ids of the first recorded sequence that starts with ``prefix``, or None."""
        p0 = len(prefix)
        if p0 % self.block_size == 0:
            last = None
            for last in self._chain(prefix):
                pass
            key = self._by_block.get(last) if last is not None else None
            if key is not None and key[:p0] == prefix:
                return self._records[key]
        for key, ids in self._records.items():  # an unaligned hit, or a hash collision: scan
            if len(key) >= p0 and key[:p0] == prefix:
                return ids
        return None

    def get(self, token_ids: list[int]) -> np.ndarray:
        """The engine routing of one sampled sequence.

        Args:
            token_ids: the completion's prompt + response token ids (length ``P + R``); its input positions are
                the first ``P + R - 1`` (the last sampled token is never fed back).

        Returns:
            int16 ``[P + R - 1, layers, k]`` (shared with the store: do not modify).

        Raises:
            KeyError: no recorded request has exactly those input tokens (not captured, or a cache hit whose
                donor was not recorded).
        """
        key = tuple(int(t) for t in token_ids[:-1])
        if key in self._finals:
            return self._finals[key]
        if key not in self._records:
            raise KeyError(f"no engine routing recorded for a sequence of {len(key)} input tokens")
        return self._records[key]
