"""Sequence packing: a micro-batch's rows as one row, so that no forward or backward FLOP goes to padding.

A right-padded micro-batch ``[b, w]`` holds ``N = sum_i L_i`` real tokens among ``b x w`` positions. Packed, the
``b`` rows are concatenated into one row ``[1, N]`` with ``position_ids`` restarting at 0 for every sequence;
transformers (``masking_utils.find_packed_sequence_indices``, 5.x) reads the restarts and confines attention to
each sequence (a block-diagonal causal mask under sdpa / eager on the CPU; varlen kernels under flash
attention), so every token sees exactly the tokens it sees in the padded forward, at the same positions. The
language-model head then runs only at the positions whose log-prob is used (``logits_to_keep``: the target
mask's positions, e.g. the response tokens), and the log-probs are scattered back into the padded ``[b, w-1]``
layout the losses read (0 elsewhere). The same scheme as verl's ``use_remove_padding`` (unpad to ``[1, N]``,
``position_ids`` per sequence, flash-attention varlen, pad the log-probs back) and TRL's ``padding_free``
(``DataCollatorWithFlattening``: concatenated rows, restarting ``position_ids``). Here written for
transformers' own packed-mask detection, which needs ``attention_mask=None``.

What stays padded: forwards whose per-token side results are laid out by padded position (the MoE router tap
of diagnostics and Routing Replay, ``learner.moe``); the caller chooses (``learner.replica.Replica.log_probs``).
"""

from __future__ import annotations

import torch


class PackedRows:
    """The packing of one right-padded micro-batch.

    Args:
        attention_mask: ``[b, w]`` 0/1 (int or bool), right padded: each row's attended positions are a prefix.
        target_mask: ``[b, w-1]`` bool, the positions ``t`` whose log-prob of ``input_ids[:, t+1]`` is wanted;
            must lie inside the attended prefix (``t + 1 < L_i``).

    Attributes:
        position_ids: ``[1, N]`` long, ``0..L_i-1`` for each row ``i`` in turn.
        keep: ``[1, M]`` long, the packed positions (into ``[1, N]``) of the wanted targets, in row-major order of
            ``target_mask`` (``logits_to_keep`` for transformers).
        num_tokens: ``N``, the real tokens.

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
        self.real = real
        self.targets = target_mask.bool()
        self.num_tokens = int(lengths.sum())
        self.position_ids = (torch.cumsum(real.long(), -1) - 1)[real].unsqueeze(0)
        packed_index = (torch.cumsum(real.reshape(-1).long(), 0) - 1).reshape(b, w)
        self.keep = packed_index[:, :-1][self.targets].unsqueeze(0)

    def pack(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[b, w]`` -> ``[1, N]``: the real tokens of every row, row after row."""
        return input_ids[self.real].unsqueeze(0)

    def target_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[1, M]``: the target token of every wanted position (``input_ids[:, 1:]`` at ``target_mask``)."""
        return input_ids[:, 1:][self.targets].unsqueeze(0)

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """``[1, M]`` values at the wanted positions -> ``[b, w-1]`` with 0 elsewhere (differentiable)."""
        out = values.new_zeros(self.targets.shape)
        return out.masked_scatter(self.targets, values.reshape(-1))
