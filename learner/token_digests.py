"""The learner's side of the token check (docs/agents.md "The token check"): the turns a rank trained, digested.

Per trained row (as a micro-batch holds it: ``learner.microbatch.MicroBatch``), each maximal run of targets in the
response mask is one sampled turn: the ids before its first sampled token are what the engine must have
conditioned on, the run's ids what it must have sampled. ``trained_turn_digests`` digests both with the engine's
spec (``rollout.token_records.turn_digest``, written again here: the services share no code; a unit test holds
them equal): BLAKE2b with a 16-byte digest over the context's length, the context ids and the sampled ids, each as
little-endian int32 bytes. The driver compares these with the engines' records.

Pure torch and the standard library.
"""

from __future__ import annotations

import hashlib

import torch


def turn_digest(context_ids: torch.Tensor, sampled_ids: torch.Tensor) -> str:
    """BLAKE2b (16 bytes, hex) of ``len(context_ids)``, ``context_ids`` and ``sampled_ids`` (1-D integer tensors,
    ids within int32), each as little-endian int32 bytes: ``rollout.token_records.turn_digest``'s spec."""
    h = hashlib.blake2b(digest_size=16)
    h.update(torch.tensor([int(context_ids.numel())], dtype=torch.int32).numpy().astype("<i4").tobytes())
    for ids in (context_ids, sampled_ids):
        h.update(ids.detach().to("cpu", torch.int32).numpy().astype("<i4", copy=False).tobytes())
    return h.hexdigest()


def trained_turn_digests(input_ids: torch.Tensor, mask: torch.Tensor) -> list[tuple[int, int, str]]:
    """The sampled turns of a micro-batch as the token check keys them.

    Args:
        input_ids: integer ``[B, W]``, the rows trained (right padded).
        mask: bool ``[B, W-1]``: target ``t`` (token ``t + 1``) carries loss, i.e. was sampled.

    Returns:
        One ``(context_len, sampled_len, digest)`` per maximal run of True in a row of ``mask``, rows in order:
        the run covering targets ``a-1 .. b-2`` is the turn ``input_ids[a:b]`` on the context ``input_ids[:a]``.

    Raises:
        ValueError: the shapes do not fit ``[B, W]`` and ``[B, W-1]``.
    """
    if input_ids.dim() != 2 or tuple(mask.shape) != (input_ids.shape[0], input_ids.shape[1] - 1):
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and mask {tuple(mask.shape)} must be [B, W] and "
                         f"[B, W-1]")
    ids, m = input_ids.detach().cpu(), mask.detach().cpu().bool()
    out = []
    for row, row_mask in zip(ids, m):
        edges = torch.diff(row_mask.to(torch.int8), prepend=torch.zeros(1, dtype=torch.int8),
                           append=torch.zeros(1, dtype=torch.int8))
        starts = (torch.nonzero(edges == 1).flatten() + 1).tolist()  # token positions (target t -> token t + 1)
        ends = (torch.nonzero(edges == -1).flatten() + 1).tolist()
        for a, b in zip(starts, ends):
            out.append((a, b - a, turn_digest(row[:a], row[a:b])))
    return out
