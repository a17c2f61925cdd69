"""Weight sync learner -> engine, for real: a DeepSpeed learner rank streams its weights through the Ray object
store into an in-process vLLM engine (vLLM's weight-transfer protocol, our ``ray_object`` backend, layer-wise
reload), after real optimizer steps; the engine's log-probs must equal the learner's (fp32, 1e-5) after every
sync, for an MoE (untied, ZeRO-3 with every parameter partitioned), a tied MoE and a tied dense model.

The tied cases fail without the CPU ``lm_head`` repack refresh in ``rollout.weight_sync`` (log-probs drift by
~0.5 from the first sync on); the MoE cases fail without the CPU expert-repack fix.
"""

from __future__ import annotations

import torch


def learner_logprobs(ray, learner, seq: list[int], start: int) -> torch.Tensor:
    from learner.contracts import TrainBatch

    ids = torch.tensor([seq])
    resp = torch.zeros((1, len(seq) - 1), dtype=torch.bool)
    resp[0, start - 1 :] = True
    batch = TrainBatch(ids, torch.ones_like(ids), resp, torch.zeros(resp.shape), torch.zeros(1), torch.zeros(1), ["s"],
                       torch.zeros(1, dtype=torch.long))
    return ray.get(learner.compute_log_probs.remote(batch))[0][resp[0]]


def weight_change(before: dict, after: dict) -> float:
    """The largest absolute change of any tensor between two state dicts of the same keys."""
    return max((after[k] - before[k]).abs().max().item() for k in before)


def sft_batch(seed: int, n: int = 8, length: int = 16):
    """A seeded supervised batch of ``n`` random sequences of ``length`` tokens, loss on positions 4 on."""
    from learner.contracts import SFTBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 60, (n, length), generator=g)
    mask = torch.zeros((n, length - 1), dtype=torch.bool)
    mask[:, 4:] = True
    return SFTBatch(ids, torch.ones_like(ids), mask)
