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

With ``sync.transport=collective`` step 2 packs the bucket into one flat uint8 tensor and step 3 broadcasts it
from rank 0 over a ``TransferGroup`` (gloo on the CPU, NCCL on GPUs) while every engine's ``update_weights``
receives it; the engines' calls still carry the metadata. Buckets then go one at a time (broadcast, then every
engine's answer). A group that cannot be built, a broadcast that fails or times out, or an engine whose receive
failed (gloo relays through members) hands the rest of that sync to the object store: the failed bucket is put
for the engines that did not load it, and engines skip a bucket index they already loaded. The NCCL group is
built so that a failure raises in the timed wait rather than ending the process (not tried: no GPU here).

An engine that fails during a sync (process death or an error) is reported, not raised: the driver replaces it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from learner.contracts import PendingLoad, SyncReport
from learner.lora import merged_bucket

if TYPE_CHECKING:
    from rollout.contracts import BucketLoad

log = logging.getLogger(__name__)


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
            yield to_checkpoint_format(*merged_bucket(module, tensors))  # LoRA: W0 + scale B A (learner.lora)


def pack_bucket(bucket: dict[str, torch.Tensor]) -> tuple[dict[str, list], list[Any], int]:
    """``(meta, buffers, nbytes)`` of a bucket: meta ``{"names", "dtype_names", "shapes"}``, one uint8 numpy
    view per tensor (no copy here; ``ray.put`` copies exactly these bytes), and the bytes in all."""
    meta = {"names": list(bucket), "dtype_names": [str(t.dtype).removeprefix("torch.") for t in bucket.values()],
            "shapes": [list(t.shape) for t in bucket.values()]}
    buffers = [t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy() for t in bucket.values()]
    return meta, buffers, sum(b.nbytes for b in buffers)


def wait_calls(ray: Any, calls: dict[Any, Any], timeout_s: float | None) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """Wait for Ray calls under one deadline.

    Args:
        ray: the ``ray`` module (imported by the caller: this module loads without Ray).
        calls: key -> object ref.
        timeout_s: seconds for all of them together; None waits without a deadline.

    Returns:
        (key -> result, for the calls that succeeded; key -> the ``RayError`` a call raised, or None for one that
        gave no answer in time), both in the order of ``calls``.
    """
    refs = list(calls.values())
    ready = set(ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[0]) if refs else set()
    done: dict[Any, Any] = {}
    errors: dict[Any, Any] = {}
    for key, ref in calls.items():
        if ref not in ready:
            errors[key] = None
            continue
        try:
            done[key] = ray.get(ref)
        except ray.exceptions.RayError as err:
            errors[key] = err
    return done, errors


def error_text(err: BaseException) -> str:
    """An engine call's error in one line for logs, metrics and the sync report: its type and the first line of its
    text (300 characters at most; ``(no message)`` for an error without text, e.g. ``TimeoutError()``). The
    engine side has its own (``rollout.contracts.error_text``): services do not import each other at run time."""
    lines = str(err).splitlines()
    return f"{type(err).__name__}: {lines[0][:300] if lines else '(no message)'}"


class _Fanout:
    """Rank 0's side of one sync: calls on the engines, failures recorded per engine instead of raised.

    One deadline for all the engine waits of a phase: a phase starts at construction and again at each
    ``start_phase`` (``sync_weights`` starts one each time rank 0 leaves the other ranks' collective: before
    each bucket is sent, and before the finish); every wait and broadcast of the phase ends by ``timeout_s``
    seconds after its start, whatever the number of engines or calls. An engine that has not answered by then
    counts as failed (hung) and the driver replaces it afterwards. So rank 0 is away from the other ranks,
    which wait in a ZeRO gather under ``learner.dist_timeout_s``, for ``sync.engine_timeout_s`` of engine waits
    at most (the config keeps that below ``dist_timeout_s``), where one wait per engine after another took
    ``engines x engine_timeout_s``."""

    def __init__(self, engines: list[Any], timeout_s: float | None = None):
        import ray

        self.ray = ray
        self.engines = dict(enumerate(engines))
        self.failed: dict[int, str] = {}
        self.timeout_s = timeout_s
        self.deadline: float | None = None
        self.start_phase()

    def start_phase(self) -> None:
        """The engine waits from now on end by ``timeout_s`` from now (never with ``timeout_s`` None)."""
        self.deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s

    def remaining(self) -> float | None:
        """Seconds left before this phase's deadline (>= 0), or None without a timeout."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def live(self) -> list[int]:
        return [i for i in self.engines if i not in self.failed]

    def call(self, method: str, *args, slots: list[int] | None = None) -> dict[int, Any]:
        """Call ``method`` on the live engines (of ``slots`` when given); object refs by engine index."""
        return {i: getattr(self.engines[i], method).remote(*args) for i in self.live() if slots is None or i in slots}

    def wait(self, calls: dict[int, Any], tolerate: bool = False) -> tuple[dict[int, Any], dict[int, str]]:
        """Wait for each call. Returns ``(results of those that succeeded, errors tolerated)`` by engine index:
        with ``tolerate`` an error raised inside a live engine is returned, not recorded; a dead engine, a
        timeout and (without ``tolerate``) any error are recorded in ``failed``."""
        done, errors = wait_calls(self.ray, calls, self.remaining())
        tolerated: dict[int, str] = {}
        for i, err in errors.items():
            if err is None:
                self.failed.setdefault(i, f"no answer within sync.engine_timeout_s={self.timeout_s:g} (one deadline "
                                          "for the engines' calls between two learner collectives)")
            elif tolerate and not isinstance(err, self.ray.exceptions.RayActorError):
                tolerated[i] = error_text(err)
            else:  # dead engine or an error inside it: replaced by the driver
                self.failed.setdefault(i, error_text(err))
        return done, tolerated


class TransferGroup:
    """Learner rank 0's end of a collective transfer group with the workers of the live engines of ``fan``
    (``sync.transport = collective``): rank 0 here, each engine's tensor-parallel workers after it, in engine
    order (their side: ``rollout.weight_sync``). vLLM's ``stateless_init_torch_distributed_process_group``
    builds it outside the learner's DeepSpeed group: gloo when ``device`` is the CPU, NCCL on a GPU (with
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` for this group only, so that a failure raises in the timed wait
    rather than NCCL's watchdog ending the process; not tried on a GPU here). One warm-up byte is broadcast
    at the end, so a member that cannot take part fails here and NCCL builds its communicator now. NCCL builds
    it lazily inside that first broadcast, in ``ncclCommInitRank``, which blocks until every member has called
    it and no ``Work.wait`` timeout covers; the rendezvous and the warm-up therefore run in a helper thread
    (``_bounded``) that rank 0 waits for until the phase's deadline (``fan.remaining()``, at most
    ``timeout_s``), and a build that has not finished by then is aborted and refused: the sync goes through
    the object store instead of hanging the learner.

    Raises:
        RuntimeError: the group could not be built: the rendezvous or the warm-up failed or timed out after
            ``timeout_s`` seconds, or an engine did not join (a dead or hung engine is also recorded in
            ``fan.failed``; an engine whose join raised is not: its weight-sync session stays usable).
    """

    def __init__(self, fan: _Fanout, key: tuple[str, ...], device: torch.device, timeout_s: float):
        import socket
        from datetime import timedelta
        from unittest import mock

        from vllm.distributed.utils import (
            stateless_init_torch_distributed_process_group,
        )

        self.key, self.timeout_s, self.pg = key, timeout_s, None
        backend = "nccl" if device.type == "cuda" else "gloo"
        sizes, _ = fan.wait(fan.call("transfer_world_size"), tolerate=True)
        self.members = list(sizes)
        host = fan.ray.util.get_node_ip_address()
        sock = socket.socket()
        sock.bind((host, 0))
        sock.listen()
        port, world = sock.getsockname()[1], 1 + sum(sizes.values())
        offsets = dict(zip(sizes, [1 + sum(list(sizes.values())[:k]) for k in range(len(sizes))]))
        joins = {i: fan.engines[i].init_weight_transfer_group.remote(
            {"master_address": host, "master_port": port, "rank_offset": offsets[i], "world_size": world,
             "backend": backend, "timeout_s": timeout_s}) for i in sizes}
        left = fan.remaining()
        build_s = timeout_s if left is None else min(timeout_s, left)

        def build() -> None:
            with mock.patch.dict("os.environ", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"} if backend == "nccl" else {}):
                self.pg = stateless_init_torch_distributed_process_group(
                    host, port, 0, world, backend, listen_socket=sock, timeout=timedelta(seconds=build_s))
            self.broadcast(torch.zeros(1, dtype=torch.uint8, device=device), build_s)

        try:
            _bounded(build, build_s, f"the {backend} transfer group's rendezvous and warm-up broadcast")
        except BaseException:
            self.close()
            raise
        finally:
            joined, refused = fan.wait(joins, tolerate=True)
        if len(joined) != len(self.members) or self.members != fan.live():
            self.close()
            raise RuntimeError(f"{len(joined)} of {len(fan.live())} engines joined"
                               + (f" ({next(iter(refused.values()))})" if refused else ""))

    def broadcast(self, flat: torch.Tensor, timeout_s: float | None = None) -> None:
        """Send ``flat`` (1-D uint8, on the device of the group's backend) to every member, blocking until it is
        sent (a timed ``Work.wait``: NCCL's untimed wait only orders the current stream and never raises).
        ``timeout_s``: at most this long (None: the group's ``timeout_s``). Raises the backend's RuntimeError
        when a member died or the time passed."""
        from datetime import timedelta

        from torch.distributed import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank = 0
        wait_s = self.timeout_s if timeout_s is None else min(self.timeout_s, timeout_s)
        self.pg.broadcast([flat], opts).wait(timedelta(seconds=wait_s))

    def close(self) -> None:
        """Leave the group by aborting it (no graceful shutdown: after a failure it could wait on a dead member;
        the engines leave their side when they join the next group)."""
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.abort()
            except Exception as err:  # noqa: BLE001 - a group broken by a dead member may refuse
                log.debug("transfer group abort: %s", err)


def _bounded(fn, timeout_s: float, what: str) -> None:
    """Run ``fn()`` in a daemon thread and wait for it at most ``timeout_s`` seconds; its exception is raised
    here. A call that does not return in time is left behind (a thread blocked in C++, e.g. NCCL's
    communicator init, cannot be interrupted; the caller aborts the group it was building).

    Raises:
        TimeoutError: ``fn`` had not returned after ``timeout_s`` seconds (the message names ``what``).
    """
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
            errors.append(err)

    thread = threading.Thread(target=run, name="transfer-group-build", daemon=True)
    thread.start()
    thread.join(max(0.0, timeout_s))
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout_s:.1f}s")
    if errors:
        raise errors[0]


def transfer_group(rank, fan: _Fanout, timeout_s: float) -> TransferGroup | None:
    """Rank 0's transfer group with the engines still live in ``fan``: the one kept on ``rank`` when the
    members are the same engines, else a new one (the old one closed). None, with a warning, when it cannot be
    built: that sync goes through the object store."""
    key = tuple(fan.engines[i]._actor_id.hex() for i in fan.live())
    kept = rank.transfer_group
    if kept is not None and kept.key == key and kept.pg is not None:
        return kept
    if kept is not None:
        kept.close()
        rank.transfer_group = None
    device = next(rank.engine.module.parameters()).device
    try:
        rank.transfer_group = TransferGroup(fan, key, device, timeout_s)
    except Exception as err:  # noqa: BLE001 - any rendezvous failure: this sync uses the object store
        log.warning("weight sync: no transfer group (%s); this sync goes through the object store", error_text(err))
        return None
    return rank.transfer_group


#: byte alignment of each tensor in a broadcast bucket: the engine views a tensor's bytes as its dtype, which
#: needs an offset divisible by the element size (torch refuses a float32 view at byte offset 6).
FLAT_ALIGN = 16


def flat_layout(sizes: list[int]) -> tuple[list[int], int]:
    """``(offsets, total)`` of tensors of ``sizes`` bytes packed in order, each at the next multiple of
    ``FLAT_ALIGN`` bytes; ``total`` ends at the last tensor's last byte (0 for none)."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(-(-end // FLAT_ALIGN) * FLAT_ALIGN)
        end = offsets[-1] + size
    return offsets, end


def pack_flat(bucket: dict[str, torch.Tensor], index: int) -> tuple[dict[str, Any], torch.Tensor]:
    """``(meta, flat)`` of a bucket for a broadcast: meta as ``pack_bucket``'s plus ``"bucket": index``,
    ``"offsets"`` (``flat_layout``) and ``"flat_bytes"``, and one 1-D uint8 tensor holding the tensors' bytes
    at those offsets (one copy, on the tensors' device; the alignment gaps are never read)."""
    tensors = [t.contiguous().reshape(-1).view(torch.uint8) for t in bucket.values()]
    offsets, total = flat_layout([t.numel() for t in tensors])
    meta = {"names": list(bucket), "dtype_names": [str(t.dtype).removeprefix("torch.") for t in bucket.values()],
            "shapes": [list(t.shape) for t in bucket.values()], "bucket": int(index), "offsets": offsets,
            "flat_bytes": total}
    flat = torch.empty(total, dtype=torch.uint8, device=tensors[0].device if tensors else "cpu")
    for o, t in zip(offsets, tensors):
        flat[o : o + t.numel()].copy_(t)
    return meta, flat


class _Sender:
    """Rank 0's stream of buckets to the engines of one sync.

    Through the transfer group while it works, one bucket at a time: its calls, the broadcast, then every
    engine's answer, so a failure is known before the next bucket (the broadcast is lockstep anyway). When the
    broadcast fails, an engine fails, or an engine answers that its receive failed (a ``str``, not seconds:
    gloo relays a broadcast through members, so a healthy member can fail on a dead one), the group is closed,
    the bucket is put in the object store for the engines that answered so, and the rest of the sync goes
    through the object store. Through the object
    store, up to ``max_in_flight`` buckets are unanswered at once (the put of one overlaps the loading of the
    previous)."""

    def __init__(self, fan: _Fanout, max_in_flight: int, group: TransferGroup | None):
        self.fan, self.max_in_flight, self.group = fan, max_in_flight, group
        self.inflight: deque = deque()
        self.sent = self.buckets = 0
        self.load_s = 0.0
        self.fallback = ""  # why the collective stopped mid-sync ('' if it did not)

    def send(self, index: int, bucket: dict[str, torch.Tensor]) -> None:
        self.buckets += 1
        if self.group is not None:
            self._broadcast(index, bucket)
        else:
            self._put(index, bucket)

    def _put(self, index: int, bucket: dict[str, torch.Tensor], slots: list[int] | None = None) -> None:
        meta, buffers, nbytes = pack_bucket(bucket)
        ref = self.fan.ray.put(buffers)
        self.inflight.append((self.fan.call("update_weights", {**meta, "bucket": int(index)}, ref, slots=slots), nbytes))
        del ref, buffers  # the object lives while an engine's call holds it
        if len(self.inflight) >= self.max_in_flight:
            self._acknowledge()

    def _broadcast(self, index: int, bucket: dict[str, torch.Tensor]) -> None:
        meta, flat = pack_flat(bucket, index)
        calls = self.fan.call("update_weights", meta, None)
        error = ""
        try:
            self.group.broadcast(flat, self.fan.remaining())
        except Exception as err:  # noqa: BLE001 - a dead or hung member: the rest of this sync via the object store
            error = error_text(err)  # never empty: an error without text still falls back
        del flat
        answers, _ = self.fan.wait(calls)
        aborted = {i: v.error for i, v in answers.items() if not v.loaded}
        acks = {i: v for i, v in answers.items() if i not in aborted}
        self._count(acks, sum(t.numel() * t.element_size() for t in bucket.values()))
        if error or aborted or self.fan.live() != self.group.members:
            self._fall_back(f"bucket {index}: {error or next(iter(aborted.values()), 'an engine failed')}")
            if aborted:
                self._put(index, bucket, slots=list(aborted))

    def _fall_back(self, why: str) -> None:
        self.fallback = why
        log.warning("weight sync: the collective transfer stopped at %s; the object store takes over", why)
        self.group.close()
        self.group = None

    def _count(self, acks: dict[int, BucketLoad], nbytes: int) -> None:
        """A bucket's answers: its bytes once per acknowledging engine, and the slowest acknowledging engine's
        seconds."""
        seconds = [v.seconds for v in acks.values()]
        self.sent += nbytes * len(acks)
        self.load_s += max(seconds, default=0.0)

    def _acknowledge(self) -> None:
        calls, nbytes = self.inflight.popleft()
        self._count(self.fan.wait(calls)[0], nbytes)

    def drain(self) -> None:
        while self.inflight:
            self._acknowledge()


def sync_weights(rank, engines: list[Any], version: int, bucket_mb: float, max_in_flight: int = 2,
                 engine_timeout_s: float | None = None, transport: str = "object_store",
                 defer: bool = False) -> SyncReport | None:
    """Stream the current weights to ``engines`` (Ray actor handles of ``rollout.engine.RolloutEngine``) as
    weight version ``version``. Collective over the learner ranks; only rank 0 talks to the engines.

    ``transport``: ``object_store`` (each bucket ``ray.put`` once) or ``collective`` (each bucket broadcast
    over a ``TransferGroup`` of rank 0 and the engines' workers, kept across syncs while the engines stay the
    same; when it cannot be built, or a broadcast fails, the object store carries the rest of that sync to the
    engines still live; the group's timeout is half of ``engine_timeout_s``, 300 s without one).

    Returns:
        On rank 0 a ``SyncReport``; None on the other ranks. Its ``engine_load_s`` is each engine's own timing
        of ``update_weights`` (the load, including a collective receive, not the object store's transport or
        the queueing); the rest of ``seconds`` is the learner's gather, conversion and sending, the round
        trips, start and finish, partly overlapped with the loads. An engine that fails or does not answer a call within
        ``engine_timeout_s`` seconds (None: wait forever) gets no further calls in this sync and is listed in
        ``failed_engines``. The waits between two learner collectives share one deadline (``_Fanout``): rank 0 is
    away from the other ranks' gathers for ``engine_timeout_s`` at most, twice that before the first bucket
    with ``collective`` (the engines' start, then the group's build).

    ``defer`` (``sync.load_beside_learner``, object store only): rank 0 does not wait for the engines' start,
    for the last ``max_in_flight - 1`` buckets' loads (all of them when the model fits one bucket) nor for the
    finish; it returns as soon as every bucket is put, with those calls' refs in the report's ``pending``, so
    the learner trains on while the engines load. The buckets' objects live until the engines' calls end
    (Ray pins a task's arguments). The caller must wait for ``pending`` before the engines sample.

    Raises:
        ValueError: ``bucket_mb`` not > 0, ``max_in_flight`` < 1, an unknown ``transport``, or ``defer`` with
            ``transport="collective"``.
    """
    if defer and transport != "object_store":
        raise ValueError(f"sync.load_beside_learner needs sync.transport='object_store', not {transport!r}")
    if max_in_flight < 1:
        raise ValueError(f"sync.max_buckets_in_flight={max_in_flight!r} must be >= 1")
    if transport not in ("object_store", "collective"):
        raise ValueError(f"sync.transport={transport!r} must be 'object_store' or 'collective'")
    t0 = time.perf_counter()
    keep = rank.rank == 0
    sender = None
    if keep:
        fan = _Fanout(engines, engine_timeout_s)
        starts = fan.call("start_weight_update")
        if not defer:
            fan.wait(starts)
        group = None
        if transport == "collective" and fan.live():
            # the group's build is a second phase before the first gather: the config keeps 2 x engine_timeout_s
            # below learner.dist_timeout_s for this transport (cluster.config)
            fan.start_phase()
            group = transfer_group(rank, fan, engine_timeout_s / 2 if engine_timeout_s else 300.0)
        sender = _Sender(fan, max_in_flight, group)
    for index, bucket in enumerate(checkpoint_buckets(rank, bucket_mb, keep)):
        if keep:
            fan.start_phase()  # rank 0 just left the other ranks' gather: engine_timeout_s until the next one
            sender.send(index, bucket)
        del bucket
    if not keep:
        return None
    fan.start_phase()
    if defer:
        return _deferred_report(sender, starts, fan.call("finish_weight_update", int(version)), t0)
    sender.drain()
    fan.wait(fan.call("finish_weight_update", int(version)))
    return SyncReport(bytes=sender.sent, seconds=time.perf_counter() - t0, buckets=sender.buckets,
                      engine_load_s=sender.load_s,
                      transport="collective" if sender.group is not None else "object_store",
                      fallback=sender.fallback, failed_engines=dict(fan.failed))


def _deferred_report(sender: _Sender, starts: dict[int, Any], finish: dict[int, Any], t0: float) -> SyncReport:
    """The report of a sync whose last loads and finish rank 0 left to the driver (``sync_weights(defer=True)``):
    the unanswered buckets count as loaded by every engine called, their refs in ``pending``."""
    pending = PendingLoad()
    for i, done in finish.items():
        buckets = [calls[i] for calls, _ in sender.inflight if i in calls]
        pending.calls[i] = [starts[i], *buckets, done] if i in starts else [*buckets, done]
        first = 1 if i in starts else 0
        pending.loads[i] = list(range(first, first + len(buckets)))
    sent = sender.sent + sum(nbytes * len(calls) for calls, nbytes in sender.inflight)
    return SyncReport(bytes=sent, seconds=time.perf_counter() - t0, buckets=sender.buckets,
                      engine_load_s=sender.load_s, failed_engines=dict(sender.fan.failed), pending=pending)


def checkpoint_state_dict(rank, bucket_mb: float = 64.0) -> dict[str, torch.Tensor]:
    """The full weights in checkpoint names as CPU copies, on rank 0 (``{}`` elsewhere). Collective."""
    keep = rank.rank == 0
    out: dict[str, torch.Tensor] = {}
    for bucket in checkpoint_buckets(rank, bucket_mb, keep):
        if keep:
            out.update({k: v.detach().to("cpu", copy=True) for k, v in bucket.items()})
    return out
