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

from rollout.contracts import error_text

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
    offsets: list[int] = field(default_factory=list)  # collective: each tensor's byte offset in the flat buffer
    flat_bytes: int = 0  # collective: size of the flat buffer
    bucket: int = -1  # index of the bucket in this session (>= 0: a repeat of a loaded index is skipped)


def _nbytes(dtype_name: str, shape: list[int]) -> int:
    numel = int(np.prod(shape)) if shape else 1
    return numel * getattr(torch, dtype_name).itemsize


def flat_views(info: ObjectRefUpdateInfo, flat: torch.Tensor) -> list[torch.Tensor]:
    """One uint8 view of ``flat`` (the broadcast bucket, 1-D uint8 of ``info.flat_bytes``) per tensor, at the
    sender's ``info.offsets``.

    Raises:
        ValueError: a buffer of another size, an offset list of another length, a tensor outside the buffer or
            at an offset that its dtype cannot be viewed at (not a multiple of its element size).
    """
    sizes = [_nbytes(dt, shape) for dt, shape in zip(info.dtype_names, info.shapes)]
    if flat.dim() != 1 or flat.dtype != torch.uint8 or flat.numel() != info.flat_bytes:
        raise ValueError(f"weight bucket: flat buffer of {flat.numel()} bytes ({flat.dtype}), the metadata says "
                         f"{info.flat_bytes}")
    if len(info.offsets) != len(sizes):
        raise ValueError(f"weight bucket: {len(info.offsets)} offsets for {len(sizes)} tensors")
    for name, dt, o, n in zip(info.names, info.dtype_names, info.offsets, sizes):
        if o < 0 or o + n > info.flat_bytes or o % getattr(torch, dt).itemsize:
            raise ValueError(f"weight bucket: {name!r} ({dt}, {n} bytes) at offset {o} of {info.flat_bytes}")
    return [flat[o : o + n] for o, n in zip(info.offsets, sizes)]


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


def _join_group(info: ObjectRefInitInfo, rank: int, device: torch.device) -> Any:
    """This worker's membership of the transfer group of ``info`` as rank ``rank`` (vLLM's
    ``stateless_init_torch_distributed_process_group``), checked by receiving the sender's one-byte warm-up
    broadcast (NCCL builds its communicator then, not inside the first bucket). An NCCL group is built with
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``, so that a failed receive raises in the timed wait instead of NCCL's
    watchdog ending the worker (not tried on a GPU here).

    Raises:
        RuntimeError / DistStoreError / DistNetworkError: the rendezvous or the warm-up failed or timed out.
    """
    from datetime import timedelta
    from unittest import mock

    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"} if info.backend == "nccl" else {}
    with mock.patch.dict("os.environ", env):
        pg = stateless_init_torch_distributed_process_group(
            info.master_address, int(info.master_port), rank, int(info.world_size), info.backend,
            timeout=timedelta(seconds=float(info.timeout_s)))
    try:
        _receive(pg, torch.empty(1, dtype=torch.uint8, device=device), info.timeout_s)
    except BaseException:
        _leave(pg, broken=True)
        raise
    return pg


def _receive(pg: Any, tensor: torch.Tensor, timeout_s: float) -> None:
    """Receive rank 0's broadcast into ``tensor``, blocking until done (a timed ``Work.wait``: NCCL's untimed
    wait only orders the current stream and never raises). Raises RuntimeError on a failure or the timeout."""
    from datetime import timedelta

    from torch.distributed import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([tensor], opts).wait(timedelta(seconds=float(timeout_s)))


def _leave(pg: Any, broken: bool) -> None:
    """Leave a transfer group: ``abort`` when ``broken`` (a graceful shutdown could wait on a dead member),
    else vLLM's stateless destroy; errors of a group already broken are ignored."""
    from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

    try:
        if broken:
            pg.abort()
        else:
            stateless_destroy_torch_distributed_process_group(pg)
    except Exception:  # noqa: BLE001, S110 - a group broken by a dead member may refuse either way
        pass


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class ObjectRefTransfer(WeightTransferEngine[ObjectRefInitInfo, ObjectRefUpdateInfo]):
    """vLLM weight-transfer backend ``"ray_object"`` (see the module docstring). Runs in vLLM's worker."""

    init_info_cls = ObjectRefInitInfo
    update_info_cls = ObjectRefUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.received: set[str] = set()  # checkpoint names loaded in the current (or last) session
        self.loaded_buckets: set[int] = set()  # bucket indices loaded in the current session
        self.aborted = ""  # why the last collective receive failed ('' if it did not)
        self.group: Any = None  # the collective transfer group, when the learner built one
        self.group_timeout_s = 0.0  # its timed waits

    def init_transfer_engine(self, init_info: ObjectRefInitInfo) -> None:
        """Reset the received names; join the collective transfer group when ``init_info`` names one (see
        ``ObjectRefInitInfo``). Blocks until every member has joined or ``timeout_s`` passes.

        Raises:
            RuntimeError / DistStoreError: the rendezvous failed or timed out.
        """
        self.received = set()
        self.loaded_buckets = set()
        self.aborted = ""
        self.shutdown(broken=True)  # the last group's other members may be gone: no graceful wait on them
        if init_info.master_address is None:
            return
        rank = int(init_info.rank_offset) + int(self.parallel_config.rank)
        self.group_timeout_s = float(init_info.timeout_s)
        self.group = _join_group(init_info, rank, self.device)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.received = set()
        self.loaded_buckets = set()
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
            self.aborted = f"bucket {info.bucket}: no transfer group"
            return None
        try:
            flat = torch.empty(int(info.flat_bytes), dtype=torch.uint8, device=self.device)
            _receive(group, flat, self.group_timeout_s)
        except Exception as err:  # noqa: BLE001 - gloo / NCCL raise RuntimeError subclasses with the cause; OOM
            self.shutdown(broken=True)
            self.aborted = f"bucket {info.bucket}: {error_text(err)}"
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
        group, self.group = self.group, None
        if group is not None:
            _leave(group, broken)


class RolloutWorkerExtension:
    """``worker_extension_cls`` of the engines: importing it in vLLM's worker registers the backend there.
    ``rollout_received_names`` reports which tensors the current/last sync session loaded. A mixin of vLLM's
    worker (no constructor of its own): its one attribute is declared here."""

    _routing_capture: Any = None  # the MoE routing capture (rollout.routing_capture), once enabled

    def rollout_received_names(self) -> list[str]:
        engine = getattr(self, "weight_transfer_engine", None)
        return sorted(getattr(engine, "received", set()))

    def rollout_take_transfer_abort(self) -> str:
        """The failed collective receive since the last call ('' if none), then forget it."""
        engine = getattr(self, "weight_transfer_engine", None)
        text, engine.aborted = getattr(engine, "aborted", ""), ""
        return text

    def rollout_device(self) -> dict:
        """The device types of this worker's model parameters and its model runner's class (``module.Name``)."""
        runner = self.model_runner
        return {"weights": sorted({p.device.type for p in runner.get_model().parameters()}),
                "runner": f"{type(runner).__module__}.{type(runner).__name__}"}

    def rollout_enable_routing_capture(self) -> list[int]:
        """Bind ``rollout.routing_capture.RoutingCapture`` to this worker's MoE routers (idempotent); returns
        the captured layer ids."""
        from rollout.routing_capture import RoutingCapture

        if getattr(self, "_routing_capture", None) is None:
            self._routing_capture = RoutingCapture(self.model_runner)
        return list(self._routing_capture.layer_ids)

    def rollout_take_routing(self, only: list[str] | None = None) -> list[dict]:
        """Per-request routings recorded and not taken yet, of every request or of the vLLM request ids in
        ``only`` (``RoutingCapture.take``); [] when capture is off."""
        capture = getattr(self, "_routing_capture", None)
        return [] if capture is None else capture.take(only)


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
