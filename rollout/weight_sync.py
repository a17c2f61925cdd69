"""Weight sync, engine side: vLLM 0.32's own weight-transfer protocol, fed from Ray object refs.

vLLM's protocol is ``start_weight_update`` -> ``update_weights`` (one call per bucket) ->
``finish_weight_update``; its backends (``nccl``, ``ipc``, ``sharded_rdt``) need CUDA. ``ObjectRefTransfer``
is a backend registered in vLLM's own ``WeightTransferEngineFactory`` under ``"ray_object"``: a bucket is a
list of uint8 numpy arrays (one per tensor) that the learner ``ray.put`` once; the engine actor ``ray.get``s it
(zero-copy, read-only views of the object store's shared memory on the same node) and the backend rebuilds the
tensors as views (``dtype``, ``shape`` from the bucket's metadata) and hands them to ``model.load_weights``.

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
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

BACKEND = "ray_object"


@dataclass
class ObjectRefInitInfo(WeightTransferInitInfo):
    """No connection to set up: the buckets come through the object store."""


@dataclass
class ObjectRefUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: ``names[i]`` has dtype ``dtype_names[i]`` (torch name without ``torch.``) and shape
    ``shapes[i]``; ``buffers[i]`` holds its bytes (a uint8 numpy array, or ``bytes`` after vLLM's msgpack hop
    in multi-process mode)."""

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    buffers: list[Any] = field(default_factory=list)


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
        arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only object-store memory: vLLM's loaders only read it
            t = torch.from_numpy(arr).view(getattr(torch, dt))
        numel = int(np.prod(shape)) if shape else 1
        if t.numel() != numel:
            raise ValueError(f"weight bucket: {name!r} has {arr.nbytes} bytes, not {dt} {list(shape)}")
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
        self.received: set[str] = set()

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.received = set()
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

    def receive_weights(self, info: ObjectRefUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        tensors = bucket_tensors(info)
        with disable_mtp_completeness_check():
            self.model.load_weights(tensors)
        self.received.update(name for name, _ in tensors)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        if _is_cpu():
            lm_head, inner = getattr(self.model, "lm_head", None), getattr(self.model, "model", None)
            embed = getattr(inner, "embed_tokens", None)
            if lm_head is not None and embed is not None and lm_head.weight is embed.weight:
                lm_head.quant_method.process_weights_after_loading(lm_head)

    def shutdown(self) -> None:
        pass


class RolloutWorkerExtension:
    """``worker_extension_cls`` of the engines: importing it in vLLM's worker registers the backend there.
    ``rollout_received_names`` reports which tensors the current/last sync session loaded."""

    def rollout_received_names(self) -> list[str]:
        engine = getattr(self, "weight_transfer_engine", None)
        return sorted(getattr(engine, "received", set()))

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
