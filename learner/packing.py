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

The flat layout (``learner.packing_layout='flat'``; ``BinLayout``) removes the tails from every token-wise
layer too: the model runs one row ``[1, N]`` of exactly the real tokens, bin after bin, and a registered
transformers attention function (``bins_attention``) lays the row's queries, keys and values into the bins,
runs SDPA there with the bins' block-diagonal causal mask, and takes the real tokens' outputs back.
Projections, experts, norms and the head see no padding; attention still runs over whole bins (as over the
masked-out pairs of a bin), the CPU's SDPA having no varlen form. On a 2-core CPU its gathers cost more than
the tails (2-3% slower at 4.9% tails on the small bench workload, docs/benchmarks.md), so bins stay the
default.

What stays padded: forwards whose per-token side results are laid out by padded position (the MoE router tap
of diagnostics and Routing Replay, ``learner.moe``); the caller chooses (``learner.replica.Replica.log_probs``).
"""

from __future__ import annotations

import contextlib

import torch

# the transformers attention function of a flat packed forward (``PackedRows.wanted_logits(flat=True)``)
BINS_ATTENTION = "gspo_packed_bins"


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

    def wanted_logits(self, model, input_ids: torch.Tensor, flat: bool = False) -> torch.Tensor:
        """``[1, M, V]`` logits at the wanted positions from one forward of the packed bins through ``model`` (a
        transformers causal LM, or a DeepSpeed engine around one); with a single bin the head runs only there.
        ``flat``: one row of the real tokens instead (``BinLayout``): no token-wise layer runs on a bin's tail,
        attention still runs per bin, the head only at the wanted positions."""
        if flat:
            lay = self.flat_layout()
            row = input_ids[self.real][lay.input_order].unsqueeze(0)
            with attention_implementation(model, BINS_ATTENTION):
                return model(input_ids=row, position_ids=lay.position_ids, logits_to_keep=lay.keep,
                             use_cache=False, packed_bins=lay).logits
        ids = self.pack(input_ids)
        if self.num_bins == 1:
            return model(input_ids=ids, position_ids=self.position_ids, logits_to_keep=self.keep,
                         use_cache=False).logits
        logits = model(input_ids=ids, position_ids=self.position_ids, use_cache=False).logits
        return logits.reshape(self.num_positions, -1)[self.keep].unsqueeze(0)

    def flat_layout(self) -> "BinLayout":
        """The bins as seen from one row of the ``N`` real tokens in bin order (``wanted_logits(flat=True)``)."""
        return BinLayout(self)

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """``[1, M]`` values at the wanted positions -> ``[b, w-1]`` with 0 elsewhere (differentiable)."""
        out = values.new_zeros(self.targets.shape)
        return out.masked_scatter(self.targets, values.reshape(-1))


class BinLayout:
    """One row of a micro-batch's ``N`` real tokens, bin after bin, and the bins it is laid back into for
    attention alone: every token-wise layer (projections, experts, norms, head) runs on the ``N`` real tokens,
    none on a bin's tail; attention runs per bin as in the packed forward, the tail's queries included (their
    outputs are dropped).

    Attributes:
        row_pos: ``[N]`` long, each row token's flat position in ``[n_bins * W]`` (increasing).
        input_order: ``[N]`` long, the row's tokens as indices into ``input_ids[real]`` (row-major real tokens).
        position_ids: ``[1, N]`` long, the tokens' positions in their sequences.
        keep: ``[M]`` long, the row indices of the wanted targets, in ``target_mask``'s row-major order.
        mask: ``[n_bins, 1, W, W]`` bool, True where a bin's query may attend a key: same sequence, not later.
    """

    def __init__(self, packed: PackedRows):
        order = torch.argsort(packed.flat)
        self.row_pos, self.input_order = packed.flat[order], order
        self.num_bins, self.width = packed.num_bins, packed.width
        self.position_ids = packed.position_ids.reshape(-1)[self.row_pos].unsqueeze(0)
        rank = torch.full((packed.num_positions,), -1, dtype=torch.long, device=order.device)
        rank[self.row_pos] = torch.arange(len(order), device=order.device)
        self.keep = rank[packed.keep]
        segment = torch.cumsum(packed.position_ids == 0, dim=1)  # [n_bins, W]: a new sequence at each restart
        causal = torch.ones(self.width, self.width, dtype=torch.bool, device=order.device).tril()
        self.mask = ((segment[:, :, None] == segment[:, None, :]) & causal).unsqueeze(1)

    def to_bins(self, x: torch.Tensor) -> torch.Tensor:
        """``[1, h, N, d]`` (the row's queries, keys or values) -> ``[n_bins, h, W, d]``, zeros in the tails."""
        _, h, _, d = x.shape
        buf = x.new_zeros((h, self.num_bins * self.width, d)).index_copy(1, self.row_pos, x[0])
        return buf.view(h, self.num_bins, self.width, d).transpose(0, 1)

    def from_bins(self, out: torch.Tensor) -> torch.Tensor:
        """``[n_bins, W, h, d]`` (attention's output) -> ``[1, N, h, d]``: the row's tokens only."""
        return out.reshape(self.num_bins * self.width, *out.shape[2:]).index_select(0, self.row_pos).unsqueeze(0)


def bins_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                   is_causal: bool | None = None, packed_bins: BinLayout | None = None, **kwargs):
    """A transformers attention function (registered as ``BINS_ATTENTION``) for a flat packed forward: the row's
    ``query [1, h, N, d]``, ``key``/``value [1, h_kv, N, d]`` laid into ``packed_bins``' bins, transformers' SDPA
    attention there with the bins' block-diagonal causal mask, and the output ``[1, N, h, d]`` back in row order.

    Raises:
        ValueError: called without ``packed_bins``, or for a sliding-window layer.
    """
    from learner.attention import sdpa_fp32

    if packed_bins is None:
        raise ValueError(f"the {BINS_ATTENTION!r} attention runs only inside PackedRows.wanted_logits(flat=True)")
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"the {BINS_ATTENTION!r} attention has no sliding window")
    b = packed_bins
    out, _ = sdpa_fp32(module, b.to_bins(query), b.to_bins(key), b.to_bins(value), b.mask,  # bf16 on CPU: fp32
                       dropout=dropout, scaling=scaling, is_causal=False, **kwargs)
    return b.from_bins(out), None


@contextlib.contextmanager
def attention_implementation(model, name: str):
    """``model.config._attn_implementation`` set to ``name`` for the block (a transformers model, or a DeepSpeed
    engine around one); registers ``bins_attention`` under ``BINS_ATTENTION`` on first use."""
    from transformers import AttentionInterface

    if name == BINS_ATTENTION and name not in AttentionInterface._global_mapping:
        AttentionInterface.register(BINS_ATTENTION, bins_attention)
    config = getattr(model, "module", model).config
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before
