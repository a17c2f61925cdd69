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
from learner.objectives import loss_normalisers
from tests.test_learner_service import TEMPERATURE, _free_port, _ref_model, make_batch

# ------------------------------------------------------------------------------------------------------------
# pure statistics


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


# ------------------------------------------------------------------------------------------------------------
# router hooks on the tiny Qwen3-MoE (plain transformers)


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


# ------------------------------------------------------------------------------------------------------------
# the learner's MoE metrics and Routing Replay (one DeepSpeed rank in this process)


def _rank(model_path, cfg):
    from learner.service import LearnerRank

    return LearnerRank(model_path, cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=_free_port(),
                       seed=0, temperature=TEMPERATURE)


def _train(learner, batches, **kw):
    norms = [loss_normalisers(b.response_mask) for b in batches]
    return learner.train_rollout_batch(batches, [s for s, _ in norms], [t for _, t in norms], **kw)


def reference_expert_load(model_path, batches) -> torch.Tensor:
    """[layers, E] shares from plain transformers: top-2 of the router logits at the input positions that
    predict response tokens, over all batches."""
    model = _ref_model(model_path)
    counts = torch.zeros(2, 8, dtype=torch.float64)
    for b in batches:
        with torch.no_grad():
            out = model(input_ids=b.input_ids, attention_mask=b.attention_mask, output_router_logits=True)
        sel = torch.cat([b.response_mask, torch.zeros(len(b), 1, dtype=torch.bool)], 1).reshape(-1)
        for layer, rl in enumerate(out.router_logits):
            top = torch.topk(torch.softmax(rl.float(), -1), 2, -1).indices[sel]
            counts[layer] += torch.bincount(top.reshape(-1), minlength=8).double()
    return counts / counts.sum(-1, keepdim=True)


def test_expert_load_and_volatility_metrics(model_path):
    """3 minibatches (2 micro-batches each), GRPO, a large lr so that the routing moves: the expert load
    equals a plain-transformers computation; the volatility is measured on minibatches 2 and 3."""
    batches = [make_batch(model_path, 4, seed=s) for s in (31, 32, 33)]
    cfg = LearnerConfig(algorithm="grpo", zero_stage=2, micro_batch_size=2, lr=1e-2, num_minibatches=3)
    out = _train(_rank(model_path, cfg), batches)
    want = reference_expert_load(model_path, batches)
    got = torch.tensor(out["moe/expert_load"], dtype=torch.float64)
    assert got.shape == (2, 8) and torch.allclose(got.sum(-1), torch.ones(2, dtype=torch.float64))
    assert torch.equal(got, want)  # counts are integers: the shares are exact
    imb = (want.max(-1).values * 8).tolist()
    assert out["moe/layer0/load_imbalance"] == pytest.approx(imb[0])
    assert out["moe/layer1/load_imbalance"] == pytest.approx(imb[1])
    assert out["moe/load_imbalance"] == pytest.approx(sum(imb) / 2)
    assert out["moe/load_imbalance_max"] == pytest.approx(max(imb))
    cv = (want.std(-1, unbiased=False) * 8).tolist()
    assert out["moe/load_cv"] == pytest.approx(sum(cv) / 2)
    assert out["moe/layers"] == [0, 1]
    assert out["moe/routing_volatility_passes"] == 2.0
    assert 0.0 < out["moe/routing_volatility"] <= 1.0
    assert out["moe/routing_volatility"] == out["moe/routing_volatility_unreplayed"]  # no replay
    # per update: pass 2 after 1 update, pass 3 after 2 => mean(v2, v3/2) is below mean(v2, v3)
    assert 0.0 < out["moe/routing_volatility_per_update"] < out["moe/routing_volatility"]

    one = _train(_rank(model_path, LearnerConfig(zero_stage=1, micro_batch_size=2, num_minibatches=1)), batches[:1])
    assert one["moe/routing_volatility_passes"] == 0.0 and one["moe/routing_volatility"] == 0.0

    quiet = LearnerConfig(zero_stage=1, micro_batch_size=2, num_minibatches=1, moe_diagnostics=False)
    assert not any(k.startswith("moe/") for k in _train(_rank(model_path, quiet), batches[:1]))


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_routing_replay_keeps_recorded_experts_and_is_exact_at_unchanged_weights(model_path, zero_stage):
    """With routing_replay the training forwards use exactly the pre-update experts after updates (volatility
    0 while the router's own choice moved; ZeRO-3 with every parameter partitioned too), and with one
    minibatch (no update before the training forward) the loss, gradients and update are bit-identical to
    training without replay."""
    batches = [make_batch(model_path, 4, seed=s) for s in (31, 32, 33)]
    cfg = LearnerConfig(algorithm="grpo", zero_stage=zero_stage, micro_batch_size=2, lr=1e-2, num_minibatches=3,
                        routing_replay=True, zero3_param_persistence_threshold=0 if zero_stage == 3 else None)
    out = _train(_rank(model_path, cfg), batches)
    assert out["moe/routing_volatility_passes"] == 2.0
    assert out["moe/routing_volatility"] == 0.0
    assert out["moe/routing_volatility_unreplayed"] > 0.0
    if zero_stage == 3:
        return

    results = {}
    for replay in (False, True):
        c = LearnerConfig(algorithm="grpo", zero_stage=2, micro_batch_size=2, lr=1e-2, num_minibatches=1,
                          routing_replay=replay)
        learner = _rank(model_path, c)
        learner.capture_gradients(True)
        o = _train(learner, batches[:1])
        results[replay] = (o["loss/policy"], learner.captured_gradients()[0], learner.state_digest())
    assert results[True][0] == results[False][0]
    for name, g in results[False][1].items():
        assert torch.equal(results[True][1][name], g), name
    assert results[True][2] == results[False][2]


def test_routing_replay_needs_an_moe_model(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from cluster.models.tiny_model import build_char_tokenizer

    config = Qwen3Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "dense")
    build_char_tokenizer().save_pretrained(tmp_path / "dense")
    with pytest.raises(ValueError, match="routing_replay"):
        _rank(str(tmp_path / "dense"), LearnerConfig(zero_stage=0, routing_replay=True))
    dense = _rank(str(tmp_path / "dense"), LearnerConfig(zero_stage=0, micro_batch_size=4, num_minibatches=1))
    b = make_batch(str(tmp_path / "dense"), 3, seed=1)
    out = _train(dense, [b])
    assert not any(k.startswith("moe/") for k in out)


def test_router_lr_scale_puts_the_routers_in_their_own_group(model_path):
    from learner.service import param_groups

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
