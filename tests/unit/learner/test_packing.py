"""Sequence packing (issue 28, item 4): the index bookkeeping by hand, and packed log-probs and gradients equal to
the padded forward's within float32 rounding on the embedded tiny Qwen3-MoE and a tiny dense Llama (transformers
on the CPU, no DeepSpeed: ``Replica.log_probs`` is called with the plain model)."""

from __future__ import annotations

import pytest
import torch

from learner.config import LearnerConfig
from learner.microbatch import MicroBatch
from learner.packing import PackedRows
from learner.replica import Replica
from tests.helpers.learner import TEMPERATURE, _ref_model, make_batch


def test_packed_rows_by_hand():
    am = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    targets = torch.tensor([[False, True, False], [True, False, False], [False, False, True]])
    p = PackedRows(am, targets)
    assert p.num_tokens == 9
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    # (row 0, t 1) -> packed 1; (row 1, t 0) -> packed 3; (row 2, t 2) -> packed 5 + 2 = 7
    assert p.keep.tolist() == [[1, 3, 7]]
    ids = torch.arange(12).reshape(3, 4)
    assert p.pack(ids).tolist() == [[0, 1, 2, 4, 5, 8, 9, 10, 11]]
    assert p.target_ids(ids).tolist() == [[2, 5, 11]]  # input_ids[:, 1:] at the targets
    assert p.unpack(torch.tensor([[7.0, 8.0, 9.0]])).tolist() == [[0, 7, 0], [8, 0, 0], [0, 0, 9]]


def test_packed_rows_refuses_left_padding_and_targets_on_padding():
    with pytest.raises(ValueError, match="right-padded"):
        PackedRows(torch.tensor([[0, 1, 1]]), torch.tensor([[False, True]]))
    with pytest.raises(ValueError, match="padding"):
        PackedRows(torch.tensor([[1, 1, 0]]), torch.tensor([[False, True]]))
    with pytest.raises(ValueError, match="shape"):
        PackedRows(torch.tensor([[1, 1, 0]]), torch.tensor([[True]]))


@pytest.fixture(scope="module")
def dense_path(tmp_path_factory) -> str:
    from cluster.models.tiny_archs import build_tiny_arch

    return str(build_tiny_arch(tmp_path_factory.mktemp("dense") / "llama", "llama", seed=0))


def _replica(pack: bool) -> Replica:
    cfg = LearnerConfig(pack_sequences=pack)
    return Replica(None, cfg, rank=0, world_size=1, device=torch.device("cpu"), temperature=TEMPERATURE)


@pytest.mark.parametrize("arch", ["qwen3_moe", "llama"])
def test_packed_log_probs_and_gradient_equal_the_padded_forward(model_path, dense_path, arch):
    """7 rows of different lengths (one without response tokens): log-probs at the response tokens within 2e-6
    nats (float32 rounding of another attention shape), entropy and the gradient of a response-token sum within
    1e-5 relative; packed log-probs are 0 outside the response mask."""
    path = model_path if arch == "qwen3_moe" else dense_path
    batch = make_batch(path, 7, seed=5, empty_row=True)
    mb = MicroBatch(batch, 0, len(batch), torch.device("cpu"), "response_mask")
    assert int(mb.attention_mask.sum()) < mb.attention_mask.numel()  # there is padding to skip
    model = _ref_model(path)
    got = {}
    for pack in (False, True):
        model.zero_grad()
        lp, ent = _replica(pack).log_probs(model, mb, entropy_den=float(mb.mask.sum()))
        torch.where(mb.mask, lp, 0.0).sum().backward()
        got[pack] = (lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()})
    (lp0, ent0, g0), (lp1, ent1, g1) = got[False], got[True]
    assert float((lp1 - lp0).abs()[mb.mask].max()) < 2e-6
    assert bool((lp1[~mb.mask] == 0).all())
    assert ent1 == pytest.approx(ent0, rel=1e-5)
    for name, g in g0.items():
        assert float((g1[name] - g).norm()) <= 1e-5 * float(g.norm()) + 1e-9, name


def test_packed_forward_runs_only_real_tokens(model_path):
    """The model sees one row of the real tokens (no padding) and the head only the response positions."""
    batch = make_batch(model_path, 5, seed=6)
    mb = MicroBatch(batch, 0, len(batch), torch.device("cpu"), "response_mask")
    model = _ref_model(model_path)
    seen = {}
    model.model.register_forward_hook(lambda _m, _a, out: seen.__setitem__("hidden", out.last_hidden_state.shape))
    model.lm_head.register_forward_hook(lambda _m, _a, out: seen.__setitem__("head", out.shape))
    with torch.no_grad():
        _replica(True).log_probs(model, mb)
    assert seen["hidden"][:2] == (1, int(mb.attention_mask.sum()))
    assert seen["head"][:2] == (1, int(mb.mask.sum()))
