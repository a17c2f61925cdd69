"""R3 (rollout routing replay): the engine's experts carried into the learner's forwards.

Hand-made routings on the tiny Qwen3-MoE (8 experts, top-2, ``norm_topk_prob=True``): a forced expert set per
(token, layer); the reference forward below replaces the router by the formula written out here (softmax of the
live router logits, gathered at the forced experts, renormalised over them), independent of ``RouterTap``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.config import LearnerConfig
from learner.moe import rollout_replay_ids


def test_rollout_replay_ids_layout_and_fill():
    routes = torch.tensor([[[[1, 2]], [[3, 4]], [[-1, -1]]]], dtype=torch.int16)  # [b=1, w=3, layers=1, k=2]
    ids = rollout_replay_ids(routes, 2)
    assert ids.shape == (1, 3, 2)
    assert ids.tolist() == [[[1, 2], [3, 4], [0, 1]]]
    with pytest.raises(ValueError, match="expected"):
        rollout_replay_ids(routes, 3)


def test_train_batch_carries_engine_routing_with_padding():
    from cluster.driver.batching import build_train_batch
    from rollout.contracts import Completion

    def comp(p, r, ids):
        return Completion("u", 0, p, r, [-0.1] * len(r), "", "stop", 0, routed_experts=ids)

    a = comp([5, 6], [7, 8], np.arange(3 * 2 * 2, dtype=np.int16).reshape(3, 2, 2))
    b = comp([5], [7], np.full((1, 2, 2), 4, dtype=np.int16))
    batch = build_train_batch([a, b], torch.zeros(2), torch.zeros(2), pad_token_id=0)
    assert batch.rollout_routes.shape == (2, 4, 2, 2) and batch.rollout_routes.dtype == torch.int16
    assert batch.rollout_routes[0, :3].flatten().tolist() == list(range(12))
    assert (batch.rollout_routes[0, 3] == -1).all() and (batch.rollout_routes[1, 1:] == -1).all()
    assert batch.select([1]).rollout_routes.shape == (1, 4, 2, 2)
    with pytest.raises(ValueError, match="carry no routed_experts"):
        build_train_batch([a, comp([5], [7], None)], torch.zeros(2), torch.zeros(2), pad_token_id=0)
    with pytest.raises(ValueError, match="routed_experts has shape"):
        build_train_batch([comp([5], [7, 8], np.zeros((1, 2, 2), np.int16))], torch.zeros(1), torch.zeros(1), 0)


def test_config_modes_and_refusals():
    from cluster.config import load_config

    assert LearnerConfig(routing_replay=True).routing_replay == "learner"
    assert LearnerConfig(routing_replay=False).routing_replay == "off"
    with pytest.raises(ValueError, match="rollout.return_routed_experts=true"):
        load_config("configs/tiny_moe_zero2.yaml", ["learner.routing_replay=rollout"])
    cfg = load_config("configs/tiny_moe_zero2.yaml", ["learner.routing_replay=rollout", "rollout.return_routed_experts=true"])
    assert cfg.learner.routing_replay == "rollout"
    with pytest.raises(ValueError, match="gradient_checkpointing=true with learner.routing_replay='rollout'"):
        LearnerConfig(gradient_checkpointing=True, routing_replay="rollout")
