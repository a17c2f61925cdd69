"""MoE routing diagnostics and Routing Replay (learner/moe.py and their use in learner/service.py).

The statistics are checked against hand-computed values; the router hooks against the tiny Qwen3-MoE's own
router outputs (transformers' ``output_router_logits``) and the experts module's actual inputs; the learner
metrics against an independent plain-transformers computation.
"""

from __future__ import annotations

import pytest
import torch

from learner.config import LearnerConfig
from tests.helpers.learner import make_batch
from tests.helpers.moe import _rank, _train, reference_expert_load


def test_expert_load_and_volatility_metrics(model_path):
    """3 minibatches (2 micro-batches each), GRPO, a large lr so that the routing moves: the expert load
    equals a plain-transformers computation; the volatility is measured on minibatches 2 and 3."""
    batches = [make_batch(model_path, 4, seed=s) for s in (31, 32, 33)]
    cfg = LearnerConfig(algorithm="grpo", zero_stage=2, micro_batch_size=2, lr=1e-2, num_minibatches=3)
    out = _train(_rank(model_path, cfg), batches)
    want = reference_expert_load(model_path, batches)
    got = torch.tensor(out.metrics["moe/expert_load"], dtype=torch.float64)
    assert got.shape == (2, 8) and torch.allclose(got.sum(-1), torch.ones(2, dtype=torch.float64))
    assert torch.equal(got, want)  # counts are integers: the shares are exact
    imb = (want.max(-1).values * 8).tolist()
    assert out.metrics["moe/layer0/load_imbalance"] == pytest.approx(imb[0])
    assert out.metrics["moe/layer1/load_imbalance"] == pytest.approx(imb[1])
    assert out.metrics["moe/load_imbalance"] == pytest.approx(sum(imb) / 2)
    assert out.metrics["moe/load_imbalance_max"] == pytest.approx(max(imb))
    cv = (want.std(-1, unbiased=False) * 8).tolist()
    assert out.metrics["moe/load_cv"] == pytest.approx(sum(cv) / 2)
    assert out.metrics["moe/layers"] == [0, 1]
    assert out.metrics["moe/routing_volatility_passes"] == 2.0
    assert 0.0 < out.metrics["moe/routing_volatility"] <= 1.0
    assert out.metrics["moe/routing_volatility"] == out.metrics["moe/routing_volatility_unreplayed"]  # no replay
    # per update: pass 2 after 1 update, pass 3 after 2 => mean(v2, v3/2) is below mean(v2, v3)
    assert 0.0 < out.metrics["moe/routing_volatility_per_update"] < out.metrics["moe/routing_volatility"]

    one = _train(_rank(model_path, LearnerConfig(zero_stage=1, micro_batch_size=2, num_minibatches=1)), batches[:1])
    assert one.metrics["moe/routing_volatility_passes"] == 0.0 and one.metrics["moe/routing_volatility"] == 0.0

    quiet = LearnerConfig(zero_stage=1, micro_batch_size=2, num_minibatches=1, moe_diagnostics=False)
    assert not any(k.startswith("moe/") for k in _train(_rank(model_path, quiet), batches[:1]).metrics)


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
    assert out.metrics["moe/routing_volatility_passes"] == 2.0
    assert out.metrics["moe/routing_volatility"] == 0.0
    assert out.metrics["moe/routing_volatility_unreplayed"] > 0.0
    if zero_stage == 3:
        return

    results = {}
    for replay in (False, True):
        c = LearnerConfig(algorithm="grpo", zero_stage=2, micro_batch_size=2, lr=1e-2, num_minibatches=1,
                          routing_replay=replay)
        learner = _rank(model_path, c)
        learner.capture_gradients(True)
        o = _train(learner, batches[:1])
        results[replay] = (o.loss, learner.captured_gradients()[0], learner.state_digest())
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
    assert not any(k.startswith("moe/") for k in out.metrics)
