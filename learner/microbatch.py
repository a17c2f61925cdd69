"""Micro-batches of one learner rank: slicing a padded batch into forward/backward-sized pieces.

A rank receives its shard of every minibatch (``learner.contracts.TrainBatch``, right padded to the longest row
of the whole rollout batch). ``micro_slices`` decides where the micro-batches start and end: a fixed number of
rows (``learner.micro_batch_size``) or a token budget (``learner.max_tokens_per_micro_batch``); it is the one
slicing function of the pre-update pass, the training passes, ``compute_log_probs`` and the SFT step, so all of
them cut a minibatch the same way. ``MicroBatch`` cuts rows ``lo:hi`` and trims them to their own longest real
row, so no forward pays for padding beyond it; ``length_order`` is the longest-first order in which
``learner.group_by_length`` trains a shard, so that rows of like length share a micro-batch. ``batch_problem``
says why a batch cannot be trained on.

How rows are cut does not change the gradient: every loss divides by the minibatch's global normalisers
(``learner.objectives.loss_normalisers`` summed over all micro-batches and ranks), so the micro-batch losses
sum to the minibatch's loss whatever the cut (up to float summation order; tested to 1e-6).
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
    ]
    for field, tensor, shape in checks:
        if tuple(tensor.shape) != shape:
            return f"{name}.{field} has shape {tuple(tensor.shape)}, expected {shape}"
    if tuple(batch.advantages.shape) not in ((n,), (n, length - 1)):  # per sequence, or per target token
        return f"{name}.advantages has shape {tuple(batch.advantages.shape)}, expected {(n,)} or {(n, length - 1)}"
    if n and length < 2:
        return f"{name} has sequence length {length}; at least 2 tokens are needed (prompt + response)"
    if bool((batch.response_mask.bool() & (batch.attention_mask[:, 1:] == 0)).any()):
        return f"{name}.response_mask marks target tokens where attention_mask is 0 (padding)"
    if not bool(torch.isfinite(batch.advantages).all()):
        return f"{name}.advantages holds NaN or inf"
    return None


class MicroBatch:
    """One micro-batch on this rank, trimmed to its longest real sequence (right padding)."""

    __slots__ = ("input_ids", "attention_mask", "targets", "mask", "old_log_probs", "advantages", "rows", "width",
                 "rollout_routes")

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
            adv = batch.advantages[lo:hi]  # [b], or [b, L-1] per target token, trimmed as the log-probs
            self.advantages = (adv if adv.dim() == 1 else adv[:, : width - 1]).to(device, torch.float32)
        else:
            self.old_log_probs = self.advantages = None
        routes = getattr(batch, "rollout_routes", None)
        self.rollout_routes = None if routes is None else routes[lo:hi, :width]  # int16 [b, w, layers, k], CPU


def row_widths(attention_mask: torch.Tensor) -> list[int]:
    """Per row of a right-padded ``[N, L]`` attention mask: the columns a forward of that row alone needs, i.e.
    its last attended column + 1, at least 2 (``MicroBatch``'s smallest width: one input and one target)."""
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [N, L], got shape {tuple(attention_mask.shape)}")
    n, length = attention_mask.shape
    cols = torch.arange(1, length + 1).expand(n, length)
    last = torch.where(attention_mask.cpu() != 0, cols, 0).amax(-1) if length else torch.zeros(n, dtype=torch.long)
    return [max(int(w), 2) for w in last.tolist()]


def length_order(attention_mask: torch.Tensor) -> list[int]:
    """Row indices of a right-padded ``[N, L]`` attention mask, longest row first (``row_widths``; ties keep
    their order): the order in which ``learner.group_by_length`` trains a rank's shard, so that consecutive
    micro-batches hold rows of like length and each pads only to its own longest row.

    Raises:
        ValueError: ``attention_mask`` is not 2-D.
    """
    widths = row_widths(attention_mask)
    return sorted(range(len(widths)), key=lambda i: -widths[i])


def micro_slices(attention_mask: torch.Tensor, micro_batch_size: int,
                 max_tokens: int | None = None) -> list[tuple[int, int]]:
    """Row ranges ``[(lo, hi), ...]`` of the consecutive micro-batches that cover a rank's batch.

    Args:
        attention_mask: the batch's ``[N, L]`` right-padded attention mask (int or bool).
        micro_batch_size: with ``max_tokens=None``, rows per micro-batch (the last one may have fewer).
        max_tokens: None, or a token budget per micro-batch: consecutive rows are packed greedily while
            ``rows x width`` stays within it, ``width`` being the micro-batch's own longest real row
            (``row_widths``; the forward pads to it and no further). A row wider than the budget forms a
            micro-batch alone. ``micro_batch_size`` is then not used.

    Returns:
        Ranges in row order, non-empty, covering ``0..N`` exactly once (``[]`` for ``N = 0``).

    Raises:
        ValueError: ``micro_batch_size < 1`` or ``max_tokens < 1``.
    """
    n = int(attention_mask.shape[0])
    if max_tokens is None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size!r} must be >= 1")
        return [(lo, min(lo + micro_batch_size, n)) for lo in range(0, n, micro_batch_size)]
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r} must be >= 1 (or None for micro_batch_size rows)")
    out: list[tuple[int, int]] = []
    lo, width = 0, 0
    for i, w in enumerate(row_widths(attention_mask)):
        if i > lo and (i - lo + 1) * max(width, w) > max_tokens:
            out.append((lo, i))
            lo, width = i, 0
        width = max(width, w)
    if n:
        out.append((lo, n))
    return out
