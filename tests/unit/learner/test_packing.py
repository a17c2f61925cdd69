"""Sequence packing (issue 28, item 4): the index bookkeeping by hand, and packed log-probs and gradients equal to
the padded forward's within float32 rounding on the embedded tiny Qwen3-MoE and the six tiny architectures, in
both packed layouts (transformers on the CPU, no DeepSpeed: ``Replica.log_probs`` is called with the plain
model)."""

from __future__ import annotations

import pytest
import torch

from cluster.models.tiny_archs import ARCHS
from learner.config import LearnerConfig
from learner.microbatch import MicroBatch
from learner.packing import PackedRows, first_fit_bins
from learner.replica import Replica
from tests.helpers.learner import TEMPERATURE, _ref_model, make_batch


def test_first_fit_bins_by_hand():
    assert first_fit_bins([5, 12, 3, 9], 12) == [[1], [3, 2], [0]]  # 12 | 9 + 3 | 5
    assert first_fit_bins([2, 2, 2, 2], 4) == [[0, 1], [2, 3]]
    assert first_fit_bins([], 4) == []


def test_packed_rows_by_hand():
    # lengths 3, 1, 4, 2 in rows of width 4: bins [row 2] [row 0, row 1] [row 3] (first fit, longest first)
    am = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    targets = torch.tensor([[False, True, False], [False, False, False], [False, False, True], [True, False, False]])
    p = PackedRows(am, targets)
    assert (p.num_tokens, p.num_bins, p.width, p.num_positions) == (10, 3, 4, 12)
    assert p.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 0, 1]]
    ids = torch.arange(16).reshape(4, 4)
    assert p.pack(ids).tolist() == [[8, 9, 10, 11], [0, 1, 2, 4], [12, 13, 0, 0]]
    # wanted, in row-major order: (row 0, t 1) at flat 4 + 1; (row 2, t 2) at 0 + 2; (row 3, t 0) at 8
    assert p.keep.tolist() == [5, 2, 8]
    assert p.target_ids(ids).tolist() == [[2, 11, 13]]  # the token after each wanted position, in its bin too
    assert [int(p.pack(ids).reshape(-1)[k + 1]) for k in p.keep] == [2, 11, 13]
    assert p.unpack(torch.tensor([[7.0, 8.0, 9.0]])).tolist() == [[0, 7, 0], [0, 0, 0], [0, 0, 8], [9, 0, 0]]


def test_packed_rows_refuses_left_padding_and_targets_on_padding():
    with pytest.raises(ValueError, match="right-padded"):
        PackedRows(torch.tensor([[0, 1, 1]]), torch.tensor([[False, True]]))
    with pytest.raises(ValueError, match="padding"):
        PackedRows(torch.tensor([[1, 1, 0]]), torch.tensor([[False, True]]))
    with pytest.raises(ValueError, match="shape"):
        PackedRows(torch.tensor([[1, 1, 0]]), torch.tensor([[True]]))


@pytest.fixture(scope="module")
def arch_paths(tmp_path_factory):
    """``build(arch)``: the path of a tiny model of ``arch`` (``cluster.models.tiny_archs.ARCHS``), built once."""
    from cluster.models.tiny_archs import build_tiny_arch

    built: dict[str, str] = {}

    def build(arch: str) -> str:
        if arch not in built:
            built[arch] = str(build_tiny_arch(tmp_path_factory.mktemp(arch) / arch, arch, seed=0))
        return built[arch]

    return build


def _replica(pack: bool, layout: str = "bins", **kw) -> Replica:
    cfg = LearnerConfig(pack_sequences=pack, packing_layout=layout, **kw)
    return Replica(None, cfg, rank=0, world_size=1, device=torch.device("cpu"), temperature=TEMPERATURE)


def test_bin_layout_by_hand():
    """The flat row of ``test_packed_rows_by_hand``'s bins: the real tokens in bin order, their positions, the
    wanted targets' row indices, and attention within a bin to the same sequence and no later token."""
    am = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    targets = torch.tensor([[False, True, False], [False, False, False], [False, False, True], [True, False, False]])
    lay = PackedRows(am, targets).flat_layout()
    ids = torch.arange(16).reshape(4, 4)
    assert lay.row_pos.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # bin 2's tail (flat 10, 11) left out
    assert ids[am.bool()][lay.input_order].tolist() == [8, 9, 10, 11, 0, 1, 2, 4, 12, 13]
    assert lay.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 0, 1]]
    assert lay.keep.tolist() == [5, 2, 8]  # no tail before any wanted position here: the flat positions
    assert lay.mask.shape == (3, 1, 4, 4)
    assert lay.mask[1, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]]
    assert lay.mask[2, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]  # tail apart
    x = torch.arange(10.0).reshape(1, 1, 10, 1)  # [1, h, N, d]
    assert lay.to_bins(x)[:, 0, :, 0].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 0]]
    assert lay.from_bins(lay.to_bins(x).transpose(1, 2)).reshape(-1).tolist() == x.reshape(-1).tolist()


def test_bins_attention_runs_only_inside_a_flat_forward():
    from learner.packing import bins_attention

    q = torch.zeros(1, 1, 2, 4)
    with pytest.raises(ValueError, match="wanted_logits"):
        bins_attention(None, q, q, q, None)


LAYOUTS = [("padded", False, "bins"), ("bins", True, "bins"), ("flat", True, "flat")]


@pytest.mark.parametrize("arch", ["embedded", *ARCHS])
def test_packed_log_probs_and_gradient_equal_the_padded_forward(model_path, arch_paths, arch):
    """7 rows of different lengths (one without response tokens): log-probs at the response tokens within 2e-6
    nats (float32 rounding of another attention shape), entropy and the gradient of a response-token sum within
    1e-5 relative; packed log-probs are 0 outside the response mask; in both packed layouts, for the embedded
    tiny Qwen3-MoE and every architecture of ``cluster.models.tiny_archs``."""
    path = model_path if arch == "embedded" else arch_paths(arch)
    batch = make_batch(path, 7, seed=5, empty_row=True)
    mb = MicroBatch(batch, 0, len(batch), torch.device("cpu"), "response_mask")
    assert int(mb.attention_mask.sum()) < mb.attention_mask.numel()  # there is padding to skip
    model = _ref_model(path)
    got = {}
    for name, pack, layout in LAYOUTS:
        model.zero_grad()
        lp, ent = _replica(pack, layout).log_probs(model, mb, entropy_den=float(mb.mask.sum()))
        torch.where(mb.mask, lp, 0.0).sum().backward()
        got[name] = (lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()})
    assert model.config._attn_implementation == "sdpa"  # the flat forward put it back
    lp0, ent0, g0 = got["padded"]
    for layout in ("bins", "flat"):
        lp1, ent1, g1 = got[layout]
        assert float((lp1 - lp0).abs()[mb.mask].max()) < 2e-6, layout
        assert bool((lp1[~mb.mask] == 0).all())
        assert ent1 == pytest.approx(ent0, rel=1e-5)
        for name, g in g0.items():
            assert float((g1[name] - g).norm()) <= 1e-5 * float(g.norm()) + 1e-9, (layout, name)


def test_packed_forward_runs_fewer_positions(model_path):
    """The model runs the packed bins (fewer positions than the padded micro-batch when rows differ in length);
    with a single bin, the head runs only at the response positions."""
    batch = make_batch(model_path, 6, seed=6)
    mb = MicroBatch(batch, 0, len(batch), torch.device("cpu"), "response_mask")
    model = _ref_model(model_path)
    seen = {}
    model.model.register_forward_hook(lambda _m, _a, out: seen.__setitem__("hidden", out.last_hidden_state.shape))
    model.lm_head.register_forward_hook(lambda _m, _a, out: seen.__setitem__("head", out.shape))
    p = PackedRows(mb.attention_mask, mb.mask)
    assert p.num_positions < mb.attention_mask.numel()
    with torch.no_grad():
        _replica(True).log_probs(model, mb)
    assert tuple(seen["hidden"][:2]) == (p.num_bins, p.width)
    one = MicroBatch(batch.select([1]), 0, 1, torch.device("cpu"), "response_mask")  # one row: one bin
    assert PackedRows(one.attention_mask, one.mask).num_bins == 1
    with torch.no_grad():
        _replica(True).log_probs(model, one)
    assert seen["head"][1] == int(one.mask.sum()) < one.width


def test_flat_forward_runs_only_the_real_tokens_through_the_layers(model_path):
    """``learner.packing_layout='flat'``: the decoder's layers see one row of exactly the real tokens (the bins'
    tails run nowhere but in attention); gradient checkpointing keeps the bins."""
    batch = make_batch(model_path, 6, seed=6)
    mb = MicroBatch(batch, 0, len(batch), torch.device("cpu"), "response_mask")
    model = _ref_model(model_path)
    seen = {}
    model.model.register_forward_hook(lambda _m, _a, out: seen.__setitem__("hidden", out.last_hidden_state.shape))
    p = PackedRows(mb.attention_mask, mb.mask)
    assert p.num_positions > p.num_tokens  # there is a tail to skip
    with torch.no_grad():
        _replica(True, "flat").log_probs(model, mb)
    assert tuple(seen["hidden"][:2]) == (1, p.num_tokens)
    assert not _replica(True, "flat", gradient_checkpointing=True).flat_packing(model)

