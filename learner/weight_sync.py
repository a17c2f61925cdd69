"""Weight sync, learner side: stream the weights, layer by layer, through the Ray object store to the engines.

The engines (``rollout.weight_sync``) load tensors by the names of the Hugging Face checkpoint files, which
differ from transformers' in-memory names where transformers converts at load time (for example one fused
``experts.gate_up_proj [E, 2I, H]`` in memory, one ``experts.{e}.gate_proj.weight`` per expert on disk). The
conversion back is transformers' own ``revert_weight_conversion``: the one place names are translated.

How a sync moves the bytes (``sync_weights``; collective over the learner ranks, rank 0 sends):

1. the parameters are walked in vLLM's layer-wise groups (``layerwise_groups``: embeddings, one group per
   decoder layer, final norm and ``lm_head``), consecutive groups merged up to ``bucket_mb``; under ZeRO-3
   only one bucket's parameters are gathered at a time;
2. rank 0 converts the bucket to checkpoint names and ``ray.put``s it as a list of uint8 numpy arrays, one per
   tensor: the single copy on the sending side, exactly the tensor bytes (a per-expert view pickles its own
   bytes only, not its fused storage's);
3. every engine loads the bucket (one ``update_weights`` call each; the object ref is resolved zero-copy on
   the engine's node) while rank 0 gathers and puts the next one; at most ``max_in_flight`` buckets exist at
   once, and each is released when every engine has loaded it;
4. ``finish_weight_update(version)`` on every engine.

An engine that fails during a sync (process death or an error) is reported, not raised: the driver replaces it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch


def to_checkpoint_format(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers in-memory names -> checkpoint names and layout (reverses its load-time conversions).

    Args:
        module: the transformers model the tensors belong to (its class decides the conversion).
        state: in-memory name -> tensor (any subset of the model, e.g. one layer).

    Returns:
        checkpoint name -> contiguous tensor (possibly a view of an input tensor's storage).
    """
    from transformers.core_model_loading import revert_weight_conversion

    out = revert_weight_conversion(module, dict(state))
    return {k: v.contiguous() for k, v in out.items()}


def weight_buckets(module: torch.nn.Module, bucket_mb: float) -> list[list[str]]:
    """In-memory names of the parameters and persistent buffers in vLLM's layer-wise groups (embeddings,
    each decoder layer, the rest), consecutive groups merged while they stay within ``bucket_mb`` MiB; a
    group larger than that is a bucket of its own (a layer is never split).

    Raises:
        ValueError: ``bucket_mb`` not > 0.
    """
    from vllm.distributed.weight_transfer.base import layerwise_groups

    if not bucket_mb > 0:
        raise ValueError(f"sync.bucket_mb={bucket_mb!r} must be > 0")
    sizes = {n: int(getattr(p, "ds_numel", p.numel())) * p.element_size() for n, p in module.named_parameters()}
    state_keys = set(module.state_dict().keys())
    sizes.update({n: b.numel() * b.element_size() for n, b in module.named_buffers() if n in state_keys})
    limit = bucket_mb * (1 << 20)
    buckets: list[list[str]] = []
    size = 0
    for group in layerwise_groups(list(sizes)):
        g = sum(sizes[n] for n in group)
        if buckets and size + g <= limit:
            buckets[-1].extend(group)
            size += g
        else:
            buckets.append(list(group))
            size = g
    return buckets


def checkpoint_buckets(rank, bucket_mb: float, keep: bool) -> Iterator[dict[str, torch.Tensor] | None]:
    """Yield each bucket in checkpoint names (``keep``) or None (a rank that only takes part in the gathers),
    while its parameters are gathered: consume the tensors before asking for the next bucket. Collective
    under ZeRO-3: every rank must consume the whole generator."""
    import deepspeed

    module = rank.engine.module
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    for names in weight_buckets(module, bucket_mb):
        group = [params[n] for n in names if n in params]
        with deepspeed.zero.GatheredParameters(group, modifier_rank=None, enabled=rank.zero3):
            if not keep:
                yield None
                continue
            tensors = {n: (params[n] if n in params else buffers[n]).detach() for n in names}
            yield to_checkpoint_format(module, tensors)


def pack_bucket(bucket: dict[str, torch.Tensor]) -> tuple[dict[str, list], list[Any], int]:
    """``(meta, buffers, nbytes)`` of a bucket: meta ``{"names", "dtype_names", "shapes"}``, one uint8 numpy
    view per tensor (no copy here; ``ray.put`` copies exactly these bytes), and the bytes in all."""
    meta = {"names": list(bucket), "dtype_names": [str(t.dtype).removeprefix("torch.") for t in bucket.values()],
            "shapes": [list(t.shape) for t in bucket.values()]}
    buffers = [t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy() for t in bucket.values()]
    return meta, buffers, sum(b.nbytes for b in buffers)


class _Fanout:
    """Rank 0's side of one sync: calls on the engines, failures recorded per engine instead of raised.

    An engine that does not answer a call within ``timeout_s`` seconds counts as failed (hung), so one stuck
    engine cannot hold the learner ranks in the sync forever; the driver replaces it afterwards."""

    def __init__(self, engines: list[Any], timeout_s: float | None = None):
        import ray

        self.ray = ray
        self.engines = dict(enumerate(engines))
        self.failed: dict[int, str] = {}
        self.timeout_s = timeout_s

    def call(self, method: str, *args) -> dict[int, Any]:
        return {i: getattr(e, method).remote(*args) for i, e in self.engines.items() if i not in self.failed}

    def wait(self, calls: dict[int, Any]) -> dict[int, Any]:
        """Wait for each call; returns the results of those that succeeded by engine index (the others are
        recorded in ``failed``)."""
        done: dict[int, Any] = {}
        for i, ref in calls.items():
            try:
                done[i] = self.ray.get(ref, timeout=self.timeout_s)
            except self.ray.exceptions.GetTimeoutError:
                self.failed.setdefault(i, f"no answer within sync.engine_timeout_s={self.timeout_s:g}")
            except self.ray.exceptions.RayError as err:  # dead engine or an error inside it: replaced by the driver
                self.failed.setdefault(i, f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
        return done


def sync_weights(rank, engines: list[Any], version: int, bucket_mb: float, max_in_flight: int = 2,
                 engine_timeout_s: float | None = None) -> dict[str, Any]:
    """Stream the current weights to ``engines`` (Ray actor handles of ``rollout.engine.RolloutEngine``) as
    weight version ``version``. Collective over the learner ranks; only rank 0 talks to the engines.

    Returns:
        On rank 0: ``{"bytes": weight bytes loaded, summed over the engines that acknowledged each bucket,
        "seconds": wall time, "buckets": count, "engine_load_s": seconds, "failed_engines": {index in engines:
        error text}}``; ``{}`` on the other ranks. ``engine_load_s``: for each bucket the seconds the slowest
        acknowledging engine spent in ``update_weights`` (its own timing: the load, not the transport or the
        queueing), summed over the buckets; the rest of ``seconds`` is the learner's gather, conversion and
        ``ray.put``, the round trips, start and finish, partly overlapped with the loads. An engine that fails
        or does not answer a call within ``engine_timeout_s`` seconds (None: wait forever) gets no further
        calls in this sync and is listed in ``failed_engines``.

    Raises:
        ValueError: ``bucket_mb`` not > 0 or ``max_in_flight`` < 1.
    """
    if max_in_flight < 1:
        raise ValueError(f"sync.max_buckets_in_flight={max_in_flight!r} must be >= 1")
    t0 = time.perf_counter()
    keep = rank.rank == 0
    fan = _Fanout(engines, engine_timeout_s) if keep else None
    if keep:
        fan.wait(fan.call("start_weight_update"))
    inflight: deque = deque()
    sent = buckets = 0
    load_s = 0.0
    for bucket in checkpoint_buckets(rank, bucket_mb, keep):
        if not keep:
            continue
        meta, buffers, nbytes = pack_bucket(bucket)
        ref = fan.ray.put(buffers)
        calls = fan.call("update_weights", meta, ref)
        buckets += 1
        inflight.append((calls, nbytes))
        del ref, buffers, bucket  # the object lives while an engine's call holds it
        if len(inflight) >= max_in_flight:
            sent, load_s = _acknowledge(fan, *inflight.popleft(), sent, load_s)
    if not keep:
        return {}
    while inflight:
        sent, load_s = _acknowledge(fan, *inflight.popleft(), sent, load_s)
    fan.wait(fan.call("finish_weight_update", int(version)))
    return {"bytes": sent, "seconds": time.perf_counter() - t0, "buckets": buckets, "engine_load_s": load_s,
            "failed_engines": fan.failed}


def _acknowledge(fan: _Fanout, calls: dict[int, Any], nbytes: int, sent: int, load_s: float) -> tuple[int, float]:
    """Wait for one bucket's ``update_weights`` calls: ``sent`` plus its bytes once per acknowledging engine,
    ``load_s`` plus the slowest acknowledging engine's seconds (non-numeric answers count 0)."""
    acks = fan.wait(calls)
    seconds = [float(v) for v in acks.values() if isinstance(v, (int, float))]
    return sent + nbytes * len(acks), load_s + max(seconds, default=0.0)


def checkpoint_state_dict(rank, bucket_mb: float = 64.0) -> dict[str, torch.Tensor]:
    """The full weights in checkpoint names as CPU copies, on rank 0 (``{}`` elsewhere). Collective."""
    keep = rank.rank == 0
    out: dict[str, torch.Tensor] = {}
    for bucket in checkpoint_buckets(rank, bucket_mb, keep):
        if keep:
            out.update({k: v.detach().to("cpu", copy=True) for k, v in bucket.items()})
    return out
