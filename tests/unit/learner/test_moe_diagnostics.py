"""MoE routing diagnostics and Routing Replay (learner/moe.py and their use in learner/service.py).

The statistics are checked against hand-computed values; the router hooks against the tiny Qwen3-MoE's own
router outputs (transformers' ``output_router_logits``) and the experts module's actual inputs; the learner
metrics against an independent plain-transformers computation.
"""

from __future__ import annotations

import pytest
import torch

from learner.config import LearnerConfig
from learner.moe import (
    RouterTap,
    expert_counts,
    find_routers,
    load_statistics,
    response_positions,
    topk_set_changes,
)
from tests.helpers.learner import _ref_model, make_batch


def test_response_positions_select_the_predicting_inputs():
    mask = torch.tensor([[False, True, True], [True, False, False]])  # [b=2, w-1=3] over targets
    got = response_positions(mask)
    # row 0: inputs 1, 2 predict targets 2, 3; row 1: input 0 predicts target 1; last column never.
    assert got.tolist() == [False, True, True, False, True, False, False, False]


def test_expert_counts_and_load_statistics_by_hand():
    # 2 layers, 3 tokens, top-2, 4 experts; token 2 not selected.
    ids = torch.tensor([[[0, 1], [0, 2], [3, 3]], [[1, 0], [1, 0], [2, 2]]], dtype=torch.int16)
    select = torch.tensor([True, True, False])
    counts = expert_counts(ids, select, 4)
    assert counts.tolist() == [[2.0, 1.0, 1.0, 0.0], [2.0, 2.0, 0.0, 0.0]]
    stats = load_statistics(counts)
    assert stats["share"] == [[0.5, 0.25, 0.25, 0.0], [0.5, 0.5, 0.0, 0.0]]
    assert stats["imbalance"] == pytest.approx([2.0, 2.0])  # max 0.5 / mean 0.25
    # layer 0: shares deviate from 0.25 by (.25, 0, 0, -.25): std = sqrt(0.125/4) = 0.1768, / 0.25 = 0.7071
    assert stats["cv"] == pytest.approx([0.5**0.5, 1.0])
    assert stats["imbalance_mean"] == pytest.approx(2.0) and stats["imbalance_max"] == pytest.approx(2.0)
    assert stats["cv_mean"] == pytest.approx((0.5**0.5 + 1.0) / 2)
    even = load_statistics(torch.ones(1, 8))
    assert even["imbalance"] == [1.0] and even["cv"] == [0.0]
    empty = load_statistics(torch.zeros(1, 8))
    assert empty["imbalance"] == [1.0] and empty["share"] == [[0.0] * 8]


def test_topk_set_changes_ignores_order():
    a = torch.tensor([[[0, 1], [2, 3], [4, 5]]])
    b = torch.tensor([[[1, 0], [2, 4], [4, 5]]])  # token 0 same set reordered, token 1 changed
    assert topk_set_changes(a, b, torch.tensor([True, True, True])) == (1, 3)
    assert topk_set_changes(a, b, torch.tensor([True, False, True])) == (0, 2)
    with pytest.raises(ValueError, match="shapes"):
        topk_set_changes(a, b[:, :2], torch.tensor([True, True]))


def test_dense_model_has_no_router():
    tap = RouterTap(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert not tap.is_moe and not tap.can_replay and tap.layers == []
    assert find_routers(torch.nn.Linear(2, 2)) == []


def _experts_inputs(model) -> tuple[list, list]:
    """Pre-hooks on every experts module: the top_k_index / top_k_weights they are actually called with."""
    seen_ids, seen_w = [], []

    def hook(module, args):
        seen_ids.append(args[1].clone())
        seen_w.append(args[2].detach().clone())

    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            module.register_forward_pre_hook(hook)
    return seen_ids, seen_w


def test_tap_records_the_routers_choice_and_replay_reproduces_it(model_path):
    model = _ref_model(model_path)
    batch = make_batch(model_path, 3, seed=2)
    tap = RouterTap(model)
    assert tap.layers == [0, 1] and tap.num_experts == 8 and tap.top_k == 2 and tap.can_replay
    seen_ids, seen_w = _experts_inputs(model)
    with torch.no_grad():
        plain = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                      output_router_logits=True).logits
        with tap.capture() as rec:
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           output_router_logits=True)
    # Recording changes nothing; the recorded experts are the top-2 of transformers' own router logits and the
    # ones the experts module ran.
    assert torch.equal(logits.logits, plain)
    recorded = rec.used_tensor()
    assert recorded.dtype == torch.int16 and tuple(recorded.shape) == (2, batch.input_ids.numel(), 2)
    for layer, router_logits in enumerate(logits.router_logits):
        want = torch.topk(torch.softmax(router_logits.float(), -1), 2, -1).indices
        assert torch.equal(recorded[layer].long(), want)
        assert torch.equal(seen_ids[2 + layer], want)  # calls 0-1: the plain forward, 2-3: the captured one
    assert torch.equal(rec.router_tensor(), recorded)

    # Replay at unchanged weights: bit-identical logits and gating weights.
    seen_ids.clear()
    seen_w.clear()
    with torch.no_grad(), tap.capture(replay=recorded) as rec2:
        replayed = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    assert torch.equal(replayed, plain)
    assert torch.equal(rec2.used_tensor(), recorded)

    # Move the routers: their own choice changes for many tokens, but under replay the experts module runs
    # exactly the recorded experts, gated by the current router's probabilities renormalised over them.
    with torch.no_grad():
        for _, _, router in find_routers(model):
            router.weight.add_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(0)) * 0.5)
        moved = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                      output_router_logits=True)
        seen_ids.clear()
        seen_w.clear()
        with tap.capture(replay=recorded) as rec3:
            replayed_out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                 output_router_logits=True)
    replayed = replayed_out.logits
    own = rec3.router_tensor()
    changed, compared = topk_set_changes(own, recorded, torch.ones(own.shape[1], dtype=torch.bool))
    assert 0 < changed < compared
    assert torch.equal(rec3.used_tensor(), recorded)
    for layer in range(2):
        assert torch.equal(seen_ids[layer], recorded[layer].long())
        # (layer 1's router input depends on layer 0's replayed experts: take the logits of this forward)
        probs = torch.softmax(replayed_out.router_logits[layer].float(), -1).gather(-1, recorded[layer].long())
        assert torch.equal(seen_w[layer], probs / probs.sum(-1, keepdim=True))
        assert torch.equal(own[layer].long(), torch.topk(replayed_out.router_logits[layer], 2, -1).indices)
    assert not torch.allclose(replayed, moved.logits)

    tap.remove()
    with torch.no_grad():
        after = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    assert torch.equal(after, moved.logits)


def test_tap_refuses_misuse(model_path):
    model = _ref_model(model_path)
    tap = RouterTap(model)
    ids = torch.zeros((2, 4, 2), dtype=torch.int16)
    with pytest.raises(RuntimeError, match="replay ids"):
        with torch.no_grad(), tap.capture(replay=ids[:1]):
            pass
    with pytest.raises(RuntimeError, match="expected 2"):
        with tap.capture():
            pass  # no forward: no router call
    with pytest.raises(RuntimeError, match="shape"):
        with torch.no_grad(), tap.capture(replay=ids):  # 4 tokens recorded, 6 in the forward
            model(input_ids=torch.ones((1, 6), dtype=torch.long))


def test_router_lr_scale_puts_the_routers_in_their_own_group(model_path):
    from learner.rank_setup import param_groups

    model = _ref_model(model_path)
    one = param_groups(model, LearnerConfig(lr=1e-4))
    assert len(one) == 1 and len(one[0]["params"]) == sum(1 for p in model.parameters() if p.requires_grad)
    rest, routers = param_groups(model, LearnerConfig(lr=1e-4, router_lr_scale=10.0))
    router_ids = {id(p) for _, _, m in find_routers(model) for p in m.parameters()}
    assert {id(p) for p in routers["params"]} == router_ids and len(router_ids) == 2  # one gate per layer
    assert routers["lr"] == pytest.approx(1e-3) and routers["lr_scale"] == 10.0
    assert len(rest["params"]) + len(routers["params"]) == len(one[0]["params"])
    with pytest.raises(ValueError, match="learner.router_lr_scale=10.0 needs an MoE model"):
        param_groups(torch.nn.Linear(2, 2), LearnerConfig(router_lr_scale=10.0))
