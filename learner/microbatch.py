"""Micro-batches of one learner rank: slicing a padded batch into forward/backward-sized pieces.

A rank receives its shard of every minibatch (``learner.contracts.TrainBatch``, right padded to the longest row
of the whole rollout batch). ``MicroBatch`` cuts rows ``lo:hi`` and trims them to their own longest real row, so
no forward pays for padding beyond it. ``batch_problem`` says why a batch cannot be trained on.
"""

from __future__ import annotations

import torch

from learner.contracts import SFTBatch, TrainBatch


def batch_problem(batch: TrainBatch, name: str) -> str | None:
    """Why ``batch`` cannot be trained on (shapes, dtypes, a response mask on padding), or None."""
    n, length = tuple(batch.input_ids.shape) if batch.input_ids.dim() == 2 else (-1, -1)
    if n < 0:
        return f"{name}.input_ids must be [N, L], got shape {tuple(batch.input_ids.shape)}"
    checks = [
        ("attention_mask", batch.attention_mask, (n, length)),
        ("response_mask", batch.response_mask, (n, length - 1)),
        ("old_log_probs", batch.old_log_probs, (n, length - 1)),
        ("advantages", batch.advantages, (n,)),
    ]
    for field, tensor, shape in checks:
        if tuple(tensor.shape) != shape:
            return f"{name}.{field} has shape {tuple(tensor.shape)}, expected {shape}"
    if n and length < 2:
        return f"{name} has sequence length {length}; at least 2 tokens are needed (prompt + response)"
    if bool((batch.response_mask.bool() & (batch.attention_mask[:, 1:] == 0)).any()):
        return f"{name}.response_mask marks target tokens where attention_mask is 0 (padding)"
    if not bool(torch.isfinite(batch.advantages).all()):
        return f"{name}.advantages holds NaN or inf"
    return None


class MicroBatch:
    """One micro-batch on this rank, trimmed to its longest real sequence (right padding)."""

    __slots__ = ("input_ids", "attention_mask", "targets", "mask", "old_log_probs", "advantages", "rows", "width")

    def __init__(self, batch: TrainBatch | SFTBatch, lo: int, hi: int, device: torch.device, field: str):
        am = batch.attention_mask[lo:hi]
        cols = torch.nonzero(am.sum(0) > 0)
        width = max(int(cols.max()) + 1 if cols.numel() else 1, 2)
        mask = getattr(batch, field)[lo:hi]
        if bool(mask[:, width - 1 :].any()):
            raise ValueError(f"{field} marks target tokens on padding (beyond the attention mask) in rows {lo}:{hi}")
        self.rows = (lo, hi)
        self.width = width
        self.input_ids = batch.input_ids[lo:hi, :width].to(device)
        self.attention_mask = am[:, :width].to(device)
        self.targets = self.input_ids[:, 1:]
        self.mask = mask[:, : width - 1].to(device).bool()
        if isinstance(batch, TrainBatch):
            self.old_log_probs = batch.old_log_probs[lo:hi, : width - 1].to(device, torch.float32)
            self.advantages = batch.advantages[lo:hi].to(device, torch.float32)
        else:
            self.old_log_probs = self.advantages = None


def micro_slices(n: int, size: int) -> list[tuple[int, int]]:
    """Row ranges ``[(lo, hi), ...]`` of consecutive micro-batches of at most ``size`` rows covering ``n`` rows."""
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]
