"""Weight sync, engine side: vLLM 0.32's own weight-transfer protocol, fed from Ray object refs or a collective.

vLLM's protocol is ``start_weight_update`` -> ``update_weights`` (one call per bucket) ->
``finish_weight_update``; its backends (``nccl``, ``ipc``, ``sharded_rdt``) need CUDA. ``ObjectRefTransfer``
is a backend registered in vLLM's own ``WeightTransferEngineFactory`` under ``"ray_object"``. The bucket's
metadata always comes with the Ray actor call; its bytes come one of two ways (``sync.transport``):

* ``object_store``: a list of uint8 numpy arrays (one per tensor) that the learner ``ray.put`` once; the engine
  actor ``ray.get``s it (zero-copy, read-only views of the object store's shared memory on the same node);
* ``collective``: one flat uint8 buffer per bucket, broadcast by learner rank 0 over a process group of the
  learner's sender and every engine worker (``init_transfer_engine`` with a rendezvous; built by vLLM's
  ``stateless_init_torch_distributed_process_group``, so it leaves vLLM's own groups alone): gloo on the CPU,
  NCCL on GPUs (the same calls).

Either way the backend rebuilds the tensors as views (``dtype``, ``shape`` from the metadata) and hands them
to ``model.load_weights``.

Loading is vLLM's layer-wise reload (``initialize_layerwise_reload`` at start, ``finalize_layerwise_reload``
at the end): a layer is post-processed as soon as all its tensors have arrived, so no engine holds a staging
copy of the model. Two CPU-only repairs of vLLM 0.32 (``../shared/docs/cpu-stack.md``):

* MoE layers skip their expert repack on reload unless their cached kernel is dropped first
  (``quant_method.moe_kernel = None`` at start); every later forward would be silently wrong;
* an ``lm_head`` tied to ``embed_tokens`` receives no tensor, so its packed GEMM copy is never rebuilt: it is
  rebuilt at finish (without it, log-probs drift by ~0.5 after the first sync).

Importing this module registers the backend; the engine passes ``worker_extension_cls`` pointing here so the
import also happens in vLLM's worker process (multi-process mode).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

BACKEND = "ray_object"


@dataclass
class ObjectRefInitInfo(WeightTransferInitInfo):
    """Empty (the default): buckets come through the object store only. With ``master_address`` set: join a
    collective transfer group as rank ``rank_offset + this worker's tensor-parallel rank`` of ``world_size``
    (rank 0 is the learner's sender), backend ``backend`` (``gloo`` or ``nccl``), each operation timing out
    after ``timeout_s`` seconds; a group joined before is shut down first."""

    master_address: str | None = None
    master_port: int = 0
    rank_offset: int = 0
    world_size: int = 0
    backend: str = "gloo"
    timeout_s: float = 60.0


@dataclass
class ObjectRefUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: ``names[i]`` has dtype ``dtype_names[i]`` (torch name without ``torch.``) and shape
    ``shapes[i]``; ``buffers[i]`` holds its bytes (a uint8 numpy array, or ``bytes`` after vLLM's msgpack hop
    in multi-process mode)."""

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    buffers: list[Any] = field(default_factory=list)
    collective: bool = False  # the bytes come by broadcast over the transfer group, not in ``buffers``
    bucket: int = -1  # index of the bucket in this session (>= 0: a repeat of a loaded index is skipped)


#: Text that marks a collective receive that failed before any tensor of its bucket was loaded; the session
#: stays open, so the learner can send the same bucket through the object store (``learner.weight_sync``).
TRANSFER_ABORTED = "weight transfer aborted"


#: Byte alignment of each tensor in a flat (broadcast) bucket: a view as any dtype needs its offset to be a
#: multiple of the dtype's size (torch refuses a float32 view at byte offset 6).
FLAT_ALIGN = 16


def _nbytes(dtype_name: str, shape: list[int]) -> int:
    numel = int(np.prod(shape)) if shape else 1
    return numel * getattr(torch, dtype_name).itemsize


def flat_layout(sizes: list[int]) -> tuple[list[int], int]:
    """``(offsets, total)``: tensors of ``sizes`` bytes back to back, each starting at a multiple of
    ``FLAT_ALIGN`` bytes; ``total`` ends at the last tensor's last byte (0 for no tensor)."""
    offsets, end = [], 0
    for size in sizes:
        start = -(-end // FLAT_ALIGN) * FLAT_ALIGN
        offsets.append(start)
        end = start + size
    return offsets, end


def flat_views(info: ObjectRefUpdateInfo, flat: torch.Tensor) -> list[torch.Tensor]:
    """One uint8 view of ``flat`` (1-D uint8, the bucket's tensors at the offsets of ``flat_layout``) per
    tensor of the bucket.

    Raises:
        ValueError: ``flat`` does not hold exactly the bytes that the metadata's layout needs.
    """
    sizes = [_nbytes(dt, shape) for dt, shape in zip(info.dtype_names, info.shapes)]
    offsets, total = flat_layout(sizes)
    if flat.dim() != 1 or flat.dtype != torch.uint8 or flat.numel() != total:
        raise ValueError(f"weight bucket: flat buffer of {flat.numel()} bytes ({flat.dtype}), the metadata needs "
                         f"{total}")
    return [flat[o : o + n] for o, n in zip(offsets, sizes)]


def open_transfer_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
                        device: torch.device, listen_socket: Any = None) -> Any:
    """Join a collective transfer group (vLLM's ``stateless_init_torch_distributed_process_group``, outside
    every other group) and run one warm-up broadcast, so that a member that cannot take part fails here and
    NCCL builds its communicator now, not inside the first bucket. For NCCL the group is built with
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``: a failed broadcast then raises in ``group_broadcast`` (which waits
    with a timeout) instead of NCCL's watchdog ending the process (not tried on a GPU here).

    Raises:
        RuntimeError / DistStoreError / DistNetworkError: the rendezvous or the warm-up failed or timed out.
    """
    import os
    from datetime import timedelta

    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    saved = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    if backend == "nccl":
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
    try:
        pg = stateless_init_torch_distributed_process_group(
            host, int(port), int(rank), int(world_size), backend, listen_socket=listen_socket,
            timeout=timedelta(seconds=float(timeout_s)))
    finally:
        if backend == "nccl":
            os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
            if saved is not None:
                os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = saved
    try:
        group_broadcast(pg, torch.zeros(1, dtype=torch.uint8, device=device), timeout_s)
    except BaseException:
        close_transfer_group(pg, broken=True)
        raise
    return pg


def group_broadcast(pg: Any, tensor: torch.Tensor, timeout_s: float) -> None:
    """Broadcast ``tensor`` from group rank 0 (send on rank 0, receive elsewhere) and block the calling thread
    until it is done (``Work.wait`` with a timeout: without one, NCCL's wait only orders the current stream).

    Raises:
        RuntimeError (and subclasses): a member died, or ``timeout_s`` passed.
    """
    from datetime import timedelta

    from torch.distributed import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([tensor], opts).wait(timedelta(seconds=float(timeout_s)))


def close_transfer_group(pg: Any, broken: bool = False) -> None:
    """Leave a transfer group: ``abort`` when ``broken`` (a failed or hung operation: a graceful shutdown could
    wait on it), else vLLM's stateless destroy. Errors of a group already broken are ignored."""
    from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

    if broken:
        try:
            pg.abort()
            return
        except Exception:  # noqa: BLE001, S110 - a backend without abort: the stateless destroy below
            pass
    try:
        stateless_destroy_torch_distributed_process_group(pg)
    except Exception:  # noqa: BLE001, S110 - a group broken by a dead member may refuse a clean shutdown
        pass


def bucket_tensors(info: ObjectRefUpdateInfo) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views of a bucket's buffers (no copy).

    Raises:
        ValueError: lists of different lengths, or a buffer whose size does not match its dtype and shape.
    """
    n = len(info.names)
    if not (len(info.dtype_names) == len(info.shapes) == len(info.buffers) == n):
        raise ValueError(f"weight bucket: {n} names, {len(info.dtype_names)} dtypes, {len(info.shapes)} shapes and "
                         f"{len(info.buffers)} buffers")
    out = []
    for name, dt, shape, buf in zip(info.names, info.dtype_names, info.shapes, info.buffers):
        if isinstance(buf, torch.Tensor):
            t = buf.view(getattr(torch, dt))
        else:
            arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # read-only object-store memory: vLLM's loaders only read it
                t = torch.from_numpy(arr).view(getattr(torch, dt))
        numel = int(np.prod(shape)) if shape else 1
        if t.numel() != numel:
            raise ValueError(f"weight bucket: {name!r} has {t.numel() * t.element_size()} bytes, not {dt} {list(shape)}")
        out.append((name, t.view(*shape) if shape else t.view(())))
    return out


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class ObjectRefTransfer(WeightTransferEngine[ObjectRefInitInfo, ObjectRefUpdateInfo]):
    """vLLM weight-transfer backend ``"ray_object"`` (see the module docstring). Runs in vLLM's worker."""

    init_info_cls = ObjectRefInitInfo
    update_info_cls = ObjectRefUpdateInfo

    def init_transfer_engine(self, init_info: ObjectRefInitInfo) -> None:
        """Reset the received names; join the collective transfer group when ``init_info`` names one (see
        ``ObjectRefInitInfo``). Blocks until every member has joined or ``timeout_s`` passes.

        Raises:
            RuntimeError / DistStoreError: the rendezvous failed or timed out.
        """
        self.received: set[str] = set()
        self.loaded_buckets: set[int] = set()
        self.aborted = ""
        self.shutdown(broken=True)  # the last group's other members may be gone: no graceful wait on them
        if init_info.master_address is None:
            return
        rank = int(init_info.rank_offset) + int(self.parallel_config.rank)
        self.group_timeout_s = float(init_info.timeout_s)
        self.group = open_transfer_group(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                                         init_info.backend, self.group_timeout_s, self.device)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.received = set()
        self.loaded_buckets: set[int] = set()
        self.aborted = ""
        if _is_cpu():
            for module in self.model.modules():
                method = getattr(module, "quant_method", None)
                if method is not None and getattr(method, "moe_kernel", None) is not None:
                    method.moe_kernel = None
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:  # the base class synchronises an accelerator: none on CPU
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def _receive_flat(self, info: ObjectRefUpdateInfo) -> list[torch.Tensor] | None:
        """The bucket's bytes from rank 0's broadcast over the transfer group, as one uint8 view per tensor;
        None when there is no group or the broadcast failed or timed out (recorded in ``self.aborted``, the
        group left: vLLM's worker would end the session if this raised, so it does not)."""
        group = getattr(self, "group", None)
        if group is None:
            self.aborted = f"{TRANSFER_ABORTED}: no transfer group (bucket {info.bucket})"
            return None
        try:
            _, total = flat_layout([_nbytes(dt, shape) for dt, shape in zip(info.dtype_names, info.shapes)])
            flat = torch.empty(total, dtype=torch.uint8, device=self.device)
            group_broadcast(group, flat, self.group_timeout_s)
        except Exception as err:  # noqa: BLE001 - gloo / NCCL raise RuntimeError subclasses with the cause; OOM
            self.shutdown(broken=True)
            self.aborted = f"{TRANSFER_ABORTED} (bucket {info.bucket}): {str(err).splitlines()[0][:300]}"
            return None
        return flat_views(info, flat)

    def receive_weights(self, info: ObjectRefUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        if info.bucket >= 0 and info.bucket in self.loaded_buckets:
            return  # sent again through the object store after another member's collective receive failed
        if info.collective:
            info.buffers = self._receive_flat(info)
            if info.buffers is None:
                return
        tensors = bucket_tensors(info)
        with disable_mtp_completeness_check():
            self.model.load_weights(tensors)
        self.received.update(name for name, _ in tensors)
        if info.bucket >= 0:
            self.loaded_buckets.add(info.bucket)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        if _is_cpu():
            lm_head, inner = getattr(self.model, "lm_head", None), getattr(self.model, "model", None)
            embed = getattr(inner, "embed_tokens", None)
            if lm_head is not None and embed is not None and lm_head.weight is embed.weight:
                lm_head.quant_method.process_weights_after_loading(lm_head)

    def shutdown(self, broken: bool = False) -> None:
        """Leave the transfer group, if any (the object-store path needs none); ``broken``: abort it."""
        group, self.group = getattr(self, "group", None), None
        if group is not None:
            close_transfer_group(group, broken)


class RolloutWorkerExtension:
    """``worker_extension_cls`` of the engines: importing it in vLLM's worker registers the backend there.
    ``rollout_received_names`` reports which tensors the current/last sync session loaded."""

    def rollout_received_names(self) -> list[str]:
        engine = getattr(self, "weight_transfer_engine", None)
        return sorted(getattr(engine, "received", set()))

    def rollout_take_transfer_abort(self) -> str:
        """The failed collective receive since the last call ('' if none), then forget it."""
        engine = getattr(self, "weight_transfer_engine", None)
        text, engine.aborted = getattr(engine, "aborted", ""), ""
        return text

    def rollout_enable_routing_capture(self) -> list[int]:
        """Bind ``rollout.routing_capture.RoutingCapture`` to this worker's MoE routers (idempotent); returns
        the captured layer ids."""
        from rollout.routing_capture import RoutingCapture

        if getattr(self, "_routing_capture", None) is None:
            self._routing_capture = RoutingCapture(self.model_runner)
        return list(self._routing_capture.layer_ids)

    def rollout_take_routing(self) -> list[dict]:
        """Per-request routings recorded since the last call (``RoutingCapture.take``); [] when capture is off."""
        capture = getattr(self, "_routing_capture", None)
        return [] if capture is None else capture.take()


def register() -> None:
    """Register ``ObjectRefTransfer`` as vLLM backend ``"ray_object"`` in this process (idempotent).

    Also quiets the layer-wise reload's per-sync warning for layers that hold no weights to load
    (``RotaryEmbedding: Failed to load weights``: its buffers are computed, not loaded); its errors still show.
    """
    import logging

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, ObjectRefTransfer)


register()
