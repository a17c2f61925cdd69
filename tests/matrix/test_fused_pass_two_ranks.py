"""The fused first minibatch (``learner.fuse_first_minibatch``) on two ranks where one rank's shard of that
minibatch is empty: its training runs only zero-weighted passes there, so the ranks differ in whether they
hold the minibatch's behaviour log-probs; every collective after training must still be taken by both.

Real DeepSpeed (CPU accelerator, gloo), two LearnerRank actors under Ray, the embedded tiny Qwen3-MoE.
"""

from __future__ import annotations

import math

import pytest

from learner.config import LearnerConfig
from learner.objectives import loss_normalisers
from tests.helpers.learner import _start_ranks, _stop, make_batch


def _cfg(fused: bool) -> LearnerConfig:
    return LearnerConfig(algorithm="gspo", zero_stage=1, micro_batch_size=2, lr=1e-3, num_minibatches=2,
                         moe_diagnostics=False, old_logprob_source="recompute", fuse_first_minibatch=fused,
                         dist_timeout_s=60.0)


def _shards(model_path: str, poison: bool):
    """Minibatch 0: one sequence (rank 0 has it, rank 1 an empty shard); minibatch 1: four, two per rank."""
    first, second = make_batch(model_path, 1, seed=81), make_batch(model_path, 4, seed=82)
    if poison:
        t = int(first.response_mask[0].nonzero()[0])
        first.old_log_probs[0, t] = float("nan")
    shards = [[first, second.select([0, 1])], [first.select([]), second.select([2, 3])]]
    return shards, [first, second]


@pytest.mark.parametrize("poison", [False, True])
def test_fused_pass_with_an_empty_first_shard_on_one_rank(model_path, ray_cluster, poison):
    """Trained: both ranks end with the same weights and results, and the pass's metrics equal the separate
    pass's. Refused before any update (a NaN rollout log-prob in the first minibatch): both ranks refuse
    and still report the pass's metrics (the first minibatch's forward runs after all, on both ranks together,
    instead of one rank waiting for the other until the collective times out)."""
    ray = ray_cluster
    shards, full = _shards(model_path, poison)
    results = {}
    for fused in (True, False):
        actors = _start_ranks(ray, model_path, _cfg(fused))
        try:
            norms = [loss_normalisers(b.response_mask) for b in full]
            outs = ray.get([a.train_rollout_batch.remote(sh, [n for n, _ in norms], [t for _, t in norms],
                                                         guard={"max_grad_norm": 1e6})
                            for a, sh in zip(actors, shards)])
            digests = ray.get([a.state_digest.remote() for a in actors])
        finally:
            _stop(ray, actors)
        assert repr(outs[0]) == repr(outs[1]) and digests[0] == digests[1]  # (repr: NaN metrics when refused)
        results[fused] = outs[0]
    fused, separate = results[True], results[False]
    assert fused.skipped == separate.skipped == poison
    if poison:
        assert fused.failed_checks == ("nonfinite_log_probs",) and fused.optimizer_steps == 0
    for key in ("actor/entropy", "actor/train_rollout_logprob_diff", "loss/policy", "actor/seq_ratio_mean"):
        want = separate.metrics[key]
        if math.isfinite(want):
            assert fused.metrics[key] == pytest.approx(want, rel=1e-6, abs=1e-9), key
        else:
            assert not math.isfinite(fused.metrics[key]), key
