"""The rollout engine's weight updates in place: a weight-sync session (``start_weight_update``, one
``update_weights`` per bucket, ``finish_weight_update``) through vLLM's weight-transfer protocol and
``rollout.weight_sync``'s backend. A part of ``rollout.engine.RolloutEngine``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from rollout.contracts import BucketLoad
from rollout.engine_base import EngineBase
from rollout.in_flight import MODES, isolate_old_kv, merge_routing, output_counts, record_arrays, scheduler


class WeightUpdates(EngineBase):
    """``RolloutEngine``'s weight-sync session calls."""

    # the state these calls change (``EngineBase`` declares it too; each class declares what it assigns)
    _syncing: bool
    _version: int
    _in_flight: str
    _load_open: bool

    def set_in_flight(self, mode: str) -> None:
        """``sync.in_flight``: ``"off"`` (a sync refuses open turns), ``"keep"`` or ``"recompute"`` (a sync loads
        while turns of ``advance_turns`` are open; ``rollout.in_flight``).

        Raises:
            ValueError: another mode.
            RuntimeError: keep / recompute with vLLM's engine core in another process or scheduling
                asynchronously (``rollout.in_flight.scheduler``).
        """
        if mode not in MODES:
            raise ValueError(f"sync.in_flight={mode!r} must be one of {MODES}")
        if mode != "off":
            scheduler(self._llm)
        self._in_flight = mode

    def start_weight_update(self) -> None:
        """Open a weight-sync session (vLLM's ``start_weight_update``): sampling is refused until
        ``finish_weight_update`` succeeds, except that with ``sync.in_flight`` on ``advance_turns`` takes new
        turns (and runs no step) meanwhile.

        Raises:
            RuntimeError: turns of ``advance_turns`` are still open and ``sync.in_flight`` is off (they would
                mix two weight versions).
        """
        if self._in_flight == "off":
            self._check_no_open_turns("start_weight_update")
        self._syncing = self._load_open = True
        if self._routing_layers:
            if self._open_turns and self._in_flight != "off":
                self._hold_open_routings()
            self._llm.collective_rpc("rollout_take_routing")  # records of an interrupted call: old weights
        self._routing.clear()
        self._llm.start_weight_update()

    def transfer_world_size(self) -> int:
        """Processes of this engine that join a collective transfer group (its tensor-parallel workers)."""
        return int(self.cfg.tensor_parallel_size)

    def init_weight_transfer_group(self, info: Mapping[str, Any]) -> None:
        """Join (or, with ``{}``, leave) a collective transfer group: every worker of this engine takes rank
        ``info["rank_offset"] + its tensor-parallel rank`` (``rollout.weight_sync.ObjectRefInitInfo``). Blocks
        until the whole group has joined.

        Raises:
            RuntimeError: the rendezvous failed or timed out.
        """
        self._llm.init_weight_transfer_engine({"init_info": dict(info)})

    def update_weights(self, meta: Mapping[str, Any], buffers: list[Any] | None) -> BucketLoad:
        """Load one bucket of checkpoint-format tensors (layer-wise: a layer is processed once complete).

        Args:
            meta: ``{"names": [...], "dtype_names": [...], "shapes": [...]}`` and optionally ``"bucket"``: the
                bucket's index in this session, after which a repeat of that index is skipped; with ``buffers``
                None also ``"offsets"`` (each tensor's byte offset) and ``"flat_bytes"`` (see
                ``rollout.weight_sync.ObjectRefUpdateInfo``); names as in the model folder's checkpoint.
            buffers: one uint8 numpy array per tensor (Ray resolves the bucket's object ref into them, zero-copy),
                or None: the bytes come by rank 0's broadcast over the transfer group
                (``init_weight_transfer_group``).

        Returns:
            a ``BucketLoad``: the seconds taken; or, when the collective receive failed before any tensor of the
            bucket was loaded, the error's text (the session stays open, so the same bucket may come again
            through the object store).

        Raises:
            RuntimeError: no session is open.
            ValueError: names not in the model's checkpoint, or a buffer that does not match its metadata.
        """
        t0 = time.perf_counter()
        if not self._syncing:
            raise RuntimeError("update_weights called outside a weight-sync session (start_weight_update first)")
        unknown = set(meta["names"]) - self._known_names()
        if self._checkpoint_names is not None and unknown:
            self._close_session()
            fused = [n for n in unknown if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
            hint = (" (transformers' in-memory names sent in place of fused experts' checkpoint names: convert with "
                    "learner.weight_sync.to_checkpoint_format)") if fused else ""
            raise ValueError(f"weight bucket for {self.model_path!r} holds names not in its checkpoint: "
                             f"{sorted(unknown)[:5]}{hint}")
        collective = buffers is None
        if collective:
            info = {**meta, "buffers": [], "collective": True}
        else:
            if not self.cfg.in_process:  # msgpack to the engine core keeps bytes, not arrays
                buffers = [bytes(memoryview(b)) for b in buffers]
            info = {**meta, "buffers": list(buffers)}
        try:
            self._llm.update_weights({"update_info": info})
            aborted = [a for a in self._llm.collective_rpc("rollout_take_transfer_abort") if a] if collective else []
        except BaseException:
            self._close_session()
            raise
        if aborted:
            return BucketLoad(error=f"receive failed: {aborted[0]}")
        return BucketLoad(seconds=time.perf_counter() - t0)

    def finish_weight_update(self, version: int) -> int:
        """Close the session: finalize the layer-wise reload, check that every checkpoint tensor arrived,
        reset the prefix cache and take ``version``. Returns the number of tensors loaded. With turns open
        (``sync.in_flight``) the prefix cache is reset as ``rollout.in_flight`` describes for the mode, and the
        open turns' tokens from here on carry ``version``.

        Raises:
            ValueError: checkpoint tensors missing from the session (the engine stays refused for sampling).
            RuntimeError: vLLM refused to reset the prefix cache.
        """
        self._load_open = False  # from here on a failure leaves the engine refusing, never waiting
        self._llm.finish_weight_update()
        received = set(self._llm.collective_rpc("rollout_received_names")[0])
        missing = self._known_names() - received - ({"lm_head.weight"} if self._tied_embeddings else set())
        if self._checkpoint_names is not None and missing:
            raise ValueError(f"weight sync for {self.model_path!r} left {len(missing)} checkpoint tensors unloaded: "
                             f"{sorted(missing)[:5]}")
        if self._open_turns and self._in_flight != "off":
            self._load_under_open_turns(int(version))
        elif not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset the prefix cache after a weight update")
        self._routing.clear()  # no later request can hit KV (or routings) of the old weights
        self._version = int(version)
        self._syncing = False
        return len(received)

    def _hold_open_routings(self) -> None:
        """R3 before an in-flight load: take the open turns' routings so far, fill their prefix-cache runs from
        this version's donors (the store is cleared at the load) and keep them until the turn ends."""
        episode = {rid: eid for eid, (_, rid) in self._open_turns.items()}
        for rec in self._llm.collective_rpc("rollout_take_routing", args=(list(episode),))[0]:
            eid = episode[rec["request"]]
            head = self._routing_heads.get(eid)
            got = record_arrays(rec) if head is not None else self._routing.resolve(rec)
            if got is not None:  # else the turn ends without a complete routing (unresolved, an error at its end)
                self._routing_heads[eid] = merge_routing(head, got)

    def _load_under_open_turns(self, version: int) -> None:
        """The new weights are in while turns are open: mark where ``version``'s tokens start in each open turn,
        then keep their KV out of reach (``keep``) or have vLLM recompute it (``recompute``)."""
        sched = scheduler(self._llm)
        counts = output_counts(sched, {eid: rid for eid, (_, rid) in self._open_turns.items()})
        for eid, n in counts.items():
            self._turn_marks.setdefault(eid, [(0, self._version)]).append((n, version))
        if self._in_flight == "recompute":
            if not self._llm.reset_prefix_cache(reset_running_requests=True):
                raise RuntimeError("vLLM refused to reset the prefix cache (recomputing the open requests)")
        else:
            isolate_old_kv(sched)

    def load_state_dict(self, state: Mapping[str, torch.Tensor], version: int, bucket_tensors: int = 16) -> float:
        """Load checkpoint-format ``state`` through the same session calls, in buckets of ``bucket_tensors``
        tensors (for tests and tools; the learner streams its own buckets). Returns seconds taken."""
        t0 = time.perf_counter()
        names = list(state)
        self.start_weight_update()
        for i in range(0, len(names), bucket_tensors):
            chunk = [(n, state[n].detach().contiguous()) for n in names[i : i + bucket_tensors]]
            meta = {"names": [n for n, _ in chunk], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in chunk],
                    "shapes": [list(t.shape) for _, t in chunk]}
            self.update_weights(meta, [t.reshape(-1).view(torch.uint8).numpy() for _, t in chunk])
        self.finish_weight_update(version)
        return time.perf_counter() - t0

    def _close_session(self) -> None:
        """End a session that failed half-way (vLLM has no abort): the engine keeps refusing to sample until a
        whole sync succeeds."""
        self._load_open = False
        try:
            self._llm.finish_weight_update()
        except Exception:  # noqa: BLE001 - the session may already be closed by vLLM after its own error
            pass

    def _known_names(self) -> set[str]:
        names = set(self._checkpoint_names or ())
        return (names | {"lm_head.weight"}) if self._tied_embeddings else names
