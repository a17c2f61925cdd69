"""Sequence packing: a micro-batch's sequences laid end to end, so that (almost) no forward or backward FLOP goes
to padding.

A right-padded micro-batch ``[b, w]`` holds ``N = sum_i L_i`` real tokens among ``b x w`` positions. Packed, the
sequences are placed end to end into rows ("bins") of at most ``w`` tokens (first-fit, longest first: the
best-fit-decreasing idea of TRL's ``packing_strategy="bfd"``), with ``position_ids`` restarting at 0 for every
sequence and no attention mask; transformers (``masking_utils.find_packed_sequence_indices``, 5.x) reads the
restarts and confines attention to each sequence (a block-diagonal causal mask under sdpa / eager on the CPU;
varlen kernels under flash attention), so every token sees exactly the tokens it sees in the padded forward, at
the same positions. A bin's unused tail is filled with pad tokens whose positions restart at 0 too: they come
after every real token of the bin, so causal attention keeps them out of every real token's result. Bounding a
bin by ``w`` keeps attention's cost per bin at the padded row's (one long row of all ``N`` tokens would cost
``N^2`` masked attention on the CPU, where no varlen kernel exists: measured slower than padding on short rows).
The log-probs are gathered at the wanted positions and scattered back into the padded ``[b, w-1]`` layout the
losses read (0 elsewhere). With a single bin the head runs only at the wanted positions (``logits_to_keep``).
The same scheme as verl's ``use_remove_padding`` (unpad, ``position_ids`` per sequence, flash-attention varlen,
pad the log-probs back) and TRL's ``padding_free`` (concatenated rows, restarting ``position_ids``).

What stays padded: forwards whose per-token side results are laid out by padded position (the MoE router tap
of diagnostics and Routing Replay, ``learner.moe``); the caller chooses (``learner.replica.Replica.log_probs``).
"""

from __future__ import annotations

import torch


def first_fit_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Row indices grouped into bins of total length <= ``capacity``: rows longest first (ties in row order), each
    into the first bin it fits, else a new bin. Every length must be <= ``capacity``.

    Example: lengths [5, 12, 3, 9], capacity 12 -> [[1], [3, 2], [0]] (12 | 9 + 3 | 5).
    """
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        k = next((k for k, r in enumerate(room) if lengths[i] <= r), None)
        if k is None:
            bins.append([])
            room.append(capacity)
            k = len(bins) - 1
        bins[k].append(i)
        room[k] -= lengths[i]
    return bins


class PackedRows:
    """The packing of one right-padded micro-batch.

    Args:
        attention_mask: ``[b, w]`` 0/1 (int or bool), right padded: each row's attended positions are a prefix.
        target_mask: ``[b, w-1]`` bool, the positions ``t`` whose log-prob of ``input_ids[:, t+1]`` is wanted;
            must lie inside the attended prefix (``t + 1 < L_i``).

    Attributes:
        position_ids: ``[n_bins, W]`` long, ``0..L_i-1`` for each sequence of a bin in turn, then ``0..`` over
            its unused tail; ``W`` the longest row.
        keep: ``[M]`` long, the flat positions (into ``[n_bins * W]``) of the wanted targets, in row-major order of
            ``target_mask``.
        num_tokens: ``N``, the real tokens; ``num_positions``: ``n_bins x W``, the positions the forward runs.

    Raises:
        ValueError: a row that is not right padded, or a target outside its row's attended prefix.
    """

    def __init__(self, attention_mask: torch.Tensor, target_mask: torch.Tensor):
        real = attention_mask.bool()
        b, w = real.shape
        lengths = real.sum(-1)
        if not bool((real == (torch.arange(w, device=real.device) < lengths[:, None])).all()):
            raise ValueError("sequence packing needs right-padded rows (each row's attention mask a prefix of ones)")
        if tuple(target_mask.shape) != (b, w - 1):
            raise ValueError(f"target_mask has shape {tuple(target_mask.shape)}, expected {(b, w - 1)}")
        if bool((target_mask.bool() & ~real[:, 1:]).any()):
            raise ValueError("target_mask marks positions whose target token is padding")
        self.real, self.targets = real, target_mask.bool()
        lens = lengths.tolist()
        width = max(max(lens, default=1), 1)
        bins = first_fit_bins(lens, width)
        start = [0] * b  # flat offset of row i's first token in [n_bins * width]
        positions = torch.zeros((len(bins), width), dtype=torch.long)
        for k, rows in enumerate(bins):
            offset = 0
            for i in rows:
                start[i] = k * width + offset
                positions[k, offset : offset + lens[i]] = torch.arange(lens[i])
                offset += lens[i]
            positions[k, offset:] = torch.arange(width - offset)
        self.width, self.num_bins = width, len(bins)
        self.num_tokens, self.num_positions = int(lengths.sum()), len(bins) * width
        self.position_ids = positions.to(real.device)
        cols = torch.arange(w, device=real.device)
        self.flat = (torch.tensor(start, dtype=torch.long, device=real.device)[:, None] + cols)[real]  # [N]
        self.keep = (torch.tensor(start, dtype=torch.long, device=real.device)[:, None] + cols[:-1])[self.targets]

    def pack(self, input_ids: torch.Tensor, pad: int = 0) -> torch.Tensor:
        """``[b, w]`` -> ``[n_bins, W]``: every row's real tokens at its place in its bin, ``pad`` elsewhere."""
        out = input_ids.new_full((self.num_positions,), pad)
        out[self.flat] = input_ids[self.real]
        return out.view(self.num_bins, self.width)

    def target_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[1, M]``: the target token of every wanted position (``input_ids[:, 1:]`` at ``target_mask``)."""
        return input_ids[:, 1:][self.targets].unsqueeze(0)

    def wanted_logits(self, model, input_ids: torch.Tensor) -> torch.Tensor:
        """``[1, M, V]`` logits at the wanted positions from one forward of the packed bins through ``model`` (a
        transformers causal LM, or a DeepSpeed engine around one); with a single bin the head runs only there."""
        ids = self.pack(input_ids)
        if self.num_bins == 1:
            return model(input_ids=ids, position_ids=self.position_ids, logits_to_keep=self.keep,
                         use_cache=False).logits
        logits = model(input_ids=ids, position_ids=self.position_ids, use_cache=False).logits
        return logits.reshape(self.num_positions, -1)[self.keep].unsqueeze(0)

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """``[1, M]`` values at the wanted positions -> ``[b, w-1]`` with 0 elsewhere (differentiable)."""
        out = values.new_zeros(self.targets.shape)
        return out.masked_scatter(self.targets, values.reshape(-1))
