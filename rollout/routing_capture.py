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
never fed back). Positions served from the prefix cache are not computed, so they have no routing: the engine
turns prefix caching off when capture is on (``RolloutEngine``), and ``take`` refuses a sequence with a gap.

Runs inside vLLM's worker (``worker_extension_cls``); imports vLLM lazily.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["RoutingCapture", "index_records", "routing_for_sequence"]


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
            self._steps.append({
                "req_ids": list(runner.input_batch.req_ids[:num_reqs]),
                "req_index": np.array(runner.req_indices.np[:total], copy=True),
                "positions": runner.positions[:total].cpu().numpy().copy(),
                "tokens": runner.input_ids.cpu[:total].numpy().copy(),
                "ids": [None] * len(self.layer_ids),
            })
        step = self._steps[-1]
        step["ids"][slot] = topk_ids[: len(step["positions"])].detach().to("cpu", torch.int16).numpy().copy()

    def take(self) -> list[dict[str, Any]]:
        """All routings recorded since the last ``take`` (then forgotten), one dict per request.

        Returns:
            ``[{"tokens": list of T ints, "ids": bytes of int16 [T, layers, k], "shape": [T, layers, k]}, ...]``:
            for positions ``0 .. T-1`` of the request, the input token and the experts each MoE layer ran for
            it; ``T`` is one past the highest recorded position. A position never computed (prefix-cache hit)
            has token -1 and ids -1.
        """
        per_req: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        for step in self._steps:
            if any(ids is None for ids in step["ids"]):
                continue  # a forward interrupted between layers: nothing of it is trusted
            stacked = np.stack(step["ids"], axis=1)  # [tokens, layers, k]
            for r, req_id in enumerate(step["req_ids"]):
                rows = step["req_index"] == r
                per_req.setdefault(req_id, []).append((step["positions"][rows], step["tokens"][rows], stacked[rows]))
        self._steps = []
        out = []
        for parts in per_req.values():
            length = int(max(int(p.max()) for p, _, _ in parts if len(p)) + 1) if any(len(p) for p, _, _ in parts) else 0
            k = parts[0][2].shape[-1]
            tokens = np.full(length, -1, dtype=np.int32)
            ids = np.full((length, len(self.layer_ids), k), -1, dtype=np.int16)
            for pos, tok, rid in parts:
                tokens[pos] = tok
                ids[pos] = rid
            # plain bytes and lists: they cross vLLM's msgpack hop in multi-process mode unchanged
            out.append({"tokens": tokens.tolist(), "ids": ids.tobytes(), "shape": list(ids.shape)})
        return out


def routing_for_sequence(records: dict[tuple[int, ...], np.ndarray], token_ids: list[int]) -> np.ndarray:
    """The engine routing of one sampled sequence, from ``index_records(RoutingCapture.take())``.

    Args:
        records: ``{tuple of input tokens: int16 [T, layers, k]}``.
        token_ids: the completion's prompt + response token ids (length ``P + R``); its input positions are the
            first ``P + R - 1`` (the last sampled token is never fed back).

    Returns:
        int16 ``[P + R - 1, layers, k]``.

    Raises:
        KeyError: no recorded request has exactly those input tokens (not captured, or a position served from
            the prefix cache).
    """
    key = tuple(int(t) for t in token_ids[:-1])
    if key not in records:
        raise KeyError(f"no engine routing recorded for a sequence of {len(key)} input tokens")
    return records[key]


def index_records(taken: list[dict[str, Any]]) -> dict[tuple[int, ...], np.ndarray]:
    """``{tuple(tokens): ids}`` over fully computed requests (no -1 position). Two requests with the same input
    tokens (identical samples) ran the same positions through the same weights: either record serves both."""
    out = {}
    for rec in taken:
        tokens = tuple(int(t) for t in rec["tokens"])
        if tokens and min(tokens) >= 0:
            out[tokens] = np.frombuffer(rec["ids"], dtype=np.int16).reshape(rec["shape"])
    return out
