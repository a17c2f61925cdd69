"""Weight sync, learner side: the full weights in checkpoint names, cut into buckets for the rollout engines.

The engines (``rollout.weight_sync``) load tensors by the names of the Hugging Face checkpoint files, which
differ from transformers' in-memory names where transformers converts at load time (for example one fused
``experts.gate_up_proj [E, 2I, H]`` in memory, one ``experts.{e}.gate_proj.weight`` per expert on disk). The
conversion back is transformers' own ``revert_weight_conversion``: the one place names are translated.
"""

from __future__ import annotations

import torch

from learner.state import full_params


def to_checkpoint_format(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers in-memory names -> checkpoint names and layout (reverses its load-time conversions).

    Args:
        module: the transformers model the state dict belongs to (its class decides the conversion).
        state: in-memory name -> tensor.

    Returns:
        checkpoint name -> contiguous tensor.
    """
    from transformers.core_model_loading import revert_weight_conversion

    out = revert_weight_conversion(module, dict(state))
    return {k: v.contiguous() for k, v in out.items()}


def bucketize(state: dict[str, torch.Tensor], bucket_mb: float) -> list[dict[str, torch.Tensor]]:
    """Cut ``state`` into consecutive buckets of about ``bucket_mb`` MiB (a larger tensor gets its own).

    Raises:
        ValueError: ``bucket_mb`` not > 0.
    """
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb={bucket_mb!r} must be > 0")
    limit = bucket_mb * (1 << 20)
    buckets: list[dict[str, torch.Tensor]] = []
    current: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > limit:
            buckets.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def export_weights(rank, bucket_mb: float, as_refs: bool = True, checkpoint_format: bool = True) -> list:
    """The full weights for the rollout engines, in buckets of about ``bucket_mb`` MiB. Collective.

    Args:
        rank: the ``learner.service.LearnerRank``.
        bucket_mb: target bucket size in MiB (> 0).
        as_refs: True: each bucket goes into the Ray object store (``ray.put`` on rank 0, which owns the
            objects: fetch them before the actor dies); False: the bucket dicts themselves.
        checkpoint_format: True: checkpoint names and layout (``to_checkpoint_format``); False: transformers'
            in-memory names.

    Returns:
        On rank 0 a list of ``ray.ObjectRef`` (or of ``dict[str, Tensor]`` on the CPU), in parameter order,
        together holding every weight once; ``[]`` on the other ranks.

    Raises:
        ValueError: ``bucket_mb`` not > 0.
    """
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb={bucket_mb!r} must be > 0")
    keep = rank.rank == 0
    state = {n: t for n, t in full_params(rank.engine, rank.zero3, keep) if t is not None}
    if not keep:
        return []
    if checkpoint_format:
        state = to_checkpoint_format(rank.engine.module, state)
    buckets = bucketize(state, bucket_mb)
    if not as_refs:
        return buckets
    import ray

    return [ray.put(b) for b in buckets]
