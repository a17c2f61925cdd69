"""MoE routing diagnostics and Routing Replay (learner/moe.py and their use in learner/service.py).

The statistics are checked against hand-computed values; the router hooks against the tiny Qwen3-MoE's own
router outputs (transformers' ``output_router_logits``) and the experts module's actual inputs; the learner
metrics against an independent plain-transformers computation.
"""

from __future__ import annotations

import torch

from learner.objectives import loss_normalisers
from tests.helpers.learner import TEMPERATURE, _ref_model


def _rank(model_path, cfg):
    from learner.service import LearnerRank

    return LearnerRank(model_path, cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=0,
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
