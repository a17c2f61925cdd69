"""R3 (rollout routing replay): the engine's experts carried into the learner's forwards.

Hand-made routings on the tiny Qwen3-MoE (8 experts, top-2, ``norm_topk_prob=True``): a forced expert set per
(token, layer); the reference forward below replaces the router by the formula written out here (softmax of the
live router logits, gathered at the forced experts, renormalised over them), independent of ``RouterTap``.
"""

from __future__ import annotations

import pytest
import torch

from learner.config import LearnerConfig
from learner.contracts import TrainBatch
from tests.helpers.learner import TEMPERATURE, _ref_model, make_batch
from tests.helpers.moe import _rank, _train


def hand_routes(batch: TrainBatch, layers: int = 2) -> torch.Tensor:
    """int16 [N, L, layers, 2]: position t of layer l runs experts {(3t + l) % 8, (3t + l + 5) % 8}; -1 from each
    row's last real token on (as the engine reports)."""
    n, length = batch.input_ids.shape
    t = torch.arange(length).view(1, length, 1)
    lay = torch.arange(layers).view(1, 1, layers)
    a = ((3 * t + lay) % 8).expand(n, length, layers)
    b = ((3 * t + lay + 5) % 8).expand(n, length, layers)
    out = torch.stack([a, b], -1).to(torch.int16).clone()
    last = batch.attention_mask.sum(-1)  # rows' real lengths
    for i, r in enumerate(last.tolist()):
        out[i, r - 1 :] = -1
    return out


def forced_log_probs(model_path: str, batch: TrainBatch, routes: torch.Tensor) -> torch.Tensor:
    """[N, L-1] log-probs (temperature TEMPERATURE) of a transformers forward whose routers run ``routes``."""
    model = _ref_model(model_path)
    routers = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    n, length = batch.input_ids.shape
    for layer, router in enumerate(routers):
        forced = routes[:, :, layer].long().reshape(n * length, 2)
        forced = torch.where(forced < 0, torch.tensor([0, 1]), forced)

        def forward(hidden, router=router, forced=forced):
            logits = torch.nn.functional.linear(hidden.reshape(-1, router.hidden_dim), router.weight)
            probs = torch.softmax(logits.float(), -1).gather(-1, forced)
            return logits, (probs / probs.sum(-1, keepdim=True)).to(logits.dtype), forced

        router.forward = forward
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    lp = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    return torch.where(batch.response_mask, lp, 0.0)


def test_learner_forwards_run_the_engine_experts(model_path):
    """R3 on a hand-made routing: the pre-update pass's log-probs are those of a forward that runs exactly the
    forced experts with gate weights from the live router (difference to the hand-written reference ~1e-7,
    against > 1e-2 without replay), the learner reports how often its own routing differed, and the training
    forwards use the forced experts (routing_volatility compares them with the router's own pre-update choice)."""
    batches = [make_batch(model_path, 4, seed=s) for s in (41, 42)]
    for b in batches:
        b.rollout_routes = hand_routes(b)
        b.old_log_probs = forced_log_probs(model_path, b, b.rollout_routes)
    res = {}
    for mode in ("rollout", "off"):
        cfg = LearnerConfig(algorithm="grpo", zero_stage=2, micro_batch_size=2, lr=1e-5, num_minibatches=2,
                            routing_replay=mode)
        res[mode] = _train(_rank(model_path, cfg), [TrainBatch(**vars(b)) for b in batches])
    assert res["rollout"].metrics["actor/train_rollout_logprob_diff"] < 1e-5
    assert res["off"].metrics["actor/train_rollout_logprob_diff"] > 1e-2
    # the hand-made sets differ from the tiny model's own top-2 on most (token, layer) pairs
    assert res["rollout"].metrics["moe/rollout_routing_mismatch"] > 0.5
    assert res["rollout"].metrics["moe/rollout_routing_mismatch"] == res["off"].metrics["moe/rollout_routing_mismatch"]
    # training forwards used the forced sets: far from the router's own pre-update choice
    assert res["rollout"].metrics["moe/routing_volatility"] > 0.5
    assert res["off"].metrics["moe/routing_volatility"] < 0.1  # lr 1e-5: one update barely moves the router


def test_rollout_replay_refuses_a_batch_without_engine_routing(model_path):
    cfg = LearnerConfig(algorithm="grpo", zero_stage=2, micro_batch_size=2, num_minibatches=1, routing_replay="rollout")
    with pytest.raises(Exception, match="rollout.return_routed_experts=true"):
        _train(_rank(model_path, cfg), [make_batch(model_path, 4, seed=43)])
