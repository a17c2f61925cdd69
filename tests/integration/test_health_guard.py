"""Health guard, learner side: ``train_rollout_batch(..., guard=...)`` skips a bad step's update exactly.

Faults are injected for real: a NaN / inf behaviour log-prob on a response token, a huge advantage that blows
up the gradient norm (or overflows it to inf), a clip-fraction limit the step breaks. After a refused step the
weights (``state_digest``) and every rank's optimizer state (``optimizer_state_digest``) are bit-identical to
before, and training afterwards is bit-identical to a run that never saw the bad step.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest
import torch

from learner.config import LearnerConfig
from learner.contracts import TrainBatch
from learner.objectives import loss_normalisers
from tests.helpers.learner import TEMPERATURE, _start_ranks, _stop, make_batch
from tests.helpers.moe import reference_expert_load

LOOSE = {"max_grad_norm": 1e3, "max_clip_fraction": 1.0, "max_logprob_diff": 1.0, "min_entropy": 0.0,
         "max_load_imbalance": 8.0}


def _rank(model_path, cfg):
    from learner.service import LearnerRank

    return LearnerRank(model_path, cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=0,
                       seed=0, temperature=TEMPERATURE)


def _train(learner, batches, guard=None):
    norms = [loss_normalisers(b.response_mask) for b in batches]
    return learner.train_rollout_batch(batches, [s for s, _ in norms], [t for _, t in norms], guard=guard)


def _digests(learner) -> tuple[str, str]:
    return learner.state_digest(), learner.optimizer_state_digest()


def _poisoned(batch: TrainBatch, value: float) -> TrainBatch:
    """A copy with ``value`` as the behaviour log-prob of the first response token of row 0."""
    old = batch.old_log_probs.clone()
    t = int(torch.nonzero(batch.response_mask[0])[0])
    old[0, t] = value
    return TrainBatch(batch.input_ids, batch.attention_mask, batch.response_mask, old, batch.advantages,
                      batch.rewards, batch.prompt_uids, batch.weight_versions)


def _scaled(batch: TrainBatch, factor: float) -> TrainBatch:
    return TrainBatch(batch.input_ids, batch.attention_mask, batch.response_mask, batch.old_log_probs,
                      batch.advantages * factor, batch.rewards, batch.prompt_uids, batch.weight_versions)


def _spy_restore(learner) -> list[str]:
    """Record the weights digest at the moment the guard restores (proves the refused steps had changed
    the weights, so the restore was needed)."""
    seen: list[str] = []
    original = learner.replica.restore

    def spy(snap):
        seen.append(learner.state_digest())
        original(snap)

    learner.replica.restore = spy
    return seen


@pytest.mark.parametrize("value", [float("nan"), float("-inf")], ids=["nan", "inf"])
def test_nonfinite_rollout_log_prob_is_refused_before_any_update(model_path, value):
    cfg = LearnerConfig(algorithm="gspo", zero_stage=2, micro_batch_size=2, lr=1e-3, num_minibatches=2)
    learner = _rank(model_path, cfg)
    before = _digests(learner)
    good, bad = make_batch(model_path, 4, seed=41), _poisoned(make_batch(model_path, 4, seed=42), value)
    out = _train(learner, [good, bad], guard={})
    assert out.skipped and out.failed_checks == ("nonfinite_log_probs",)
    assert out.metrics["health/skipped"] == 1.0 and out.metrics["health/failed_checks"] == "nonfinite_log_probs"
    assert out.metrics["health/nonfinite_log_probs"] == 1.0 and out.metrics["health/steps_undone"] == 0.0
    assert out.optimizer_steps == 0 and out.metrics["actor/num_optimizer_steps"] == 0.0
    assert _digests(learner) == before
    assert learner.current_version() == 0  # the weights are unchanged, so is their version for the engines
    assert len(learner.replica.base_optimizer().state) == 0  # no optimizer step ever ran
    assert "moe/expert_load" in out.metrics and not math.isfinite(out.metrics["actor/train_rollout_logprob_diff"])


@pytest.mark.parametrize(
    "zero_stage,dtype,offload",
    [(0, "float32", "none"), (1, "float32", "none"), (2, "float32", "none"), (3, "float32", "none"),
     (1, "bfloat16", "none"), (2, "bfloat16", "none"), (2, "float32", "cpu"), (3, "bfloat16", "cpu")],
)
def test_refused_step_is_undone_exactly_and_training_continues_as_if_never_seen(model_path, zero_stage, dtype,
                                                                                offload):
    """good step -> a step refused after both its optimizer steps ran (clip fraction above a limit of 0) ->
    good step: weights and optimizer state equal, bit for bit, those of a run with only the two good steps.
    ZeRO-3 with every parameter partitioned (persistence threshold 0); bf16 keeps fp32 master partitions
    (DeepSpeed's bf16 optimizer at stage 1, the ZeRO optimizer at stage 2; gradients accumulated in fp32).
    With optimizer offload the fp32 partitions and DeepSpeed's CPU Adam live on the host; the good steps after
    the rollback are steps 3 and 4, where CPU Adam's own step cache would have differed from the clean run's
    (``learner.state.reset_cpu_adam_cache``)."""
    cfg = LearnerConfig(algorithm="gspo", zero_stage=zero_stage, dtype=dtype, micro_batch_size=2, lr=1e-3,
                        num_minibatches=2, zero3_param_persistence_threshold=0 if zero_stage == 3 else None,
                        offload_optimizer=offload)
    good1 = [make_batch(model_path, 4, seed=s) for s in (51, 52)]
    bad = [make_batch(model_path, 4, seed=s, noise=2e-3) for s in (53, 54)]
    good2 = [make_batch(model_path, 4, seed=s) for s in (55, 56)]

    learner = _rank(model_path, cfg)
    seen = _spy_restore(learner)
    assert not _train(learner, good1, guard=LOOSE).skipped
    assert learner.current_version() == 1  # an applied update: the next version for the engines
    learner.synced_version, learner.weights_changed = 1, False  # as a sync of version 1 leaves it (no engine here)
    after_good1 = _digests(learner)
    out = _train(learner, bad, guard={**LOOSE, "max_clip_fraction": 0.0})
    assert out.skipped and out.failed_checks == ("max_clip_fraction",)
    assert out.metrics["actor/clip_fraction"] > 0.0 and out.metrics["health/steps_undone"] == 2.0
    assert "actor/clip_fraction=" in out.reasons and out.reasons == out.metrics["health/reasons"]
    assert len(seen) == 1 and seen[0] != after_good1[0]  # the refused steps had moved the weights
    assert _digests(learner) == after_good1
    assert learner.optimizer_steps == 2
    assert learner.current_version() == 1  # refused: still version 1
    ok = _train(learner, good2, guard=LOOSE)
    assert not ok.skipped and ok.failed_checks == () and ok.reasons == "" and ok.optimizer_steps == 2
    assert learner.current_version() == 2
    with_bad = _digests(learner)

    clean = _rank(model_path, cfg)
    _train(clean, good1)
    _train(clean, good2)
    assert _digests(clean) == with_bad


@pytest.mark.parametrize("factor,check", [(1e6, "max_grad_norm"), (1e30, "nonfinite")], ids=["huge", "overflow"])
def test_exploding_gradient_stops_training_and_is_undone(model_path, factor, check):
    """Minibatch 2 of 3 has advantages x factor: its step breaks max_grad_norm (or overflows to a non-finite
    loss or norm); minibatch 3 never runs, the first two steps are rolled back."""
    cfg = LearnerConfig(algorithm="grpo", zero_stage=2, micro_batch_size=2, lr=1e-3, num_minibatches=3)
    batches = [make_batch(model_path, 4, seed=s) for s in (61, 62, 63)]
    batches[1] = _scaled(batches[1], factor)
    learner = _rank(model_path, cfg)
    before = _digests(learner)
    out = _train(learner, batches, guard={"max_grad_norm": 1e3})
    assert out.skipped and out.metrics["health/steps_undone"] == 2.0  # stopped after step 2
    names = list(out.failed_checks)
    if check == "max_grad_norm":
        assert names == ["max_grad_norm"] and 1e3 < out.metrics["actor/grad_norm_max"] < math.inf
    else:
        assert set(names) <= {"nonfinite_loss", "nonfinite_grad_norm"} and names
    assert _digests(learner) == before
    # Without a guard the same step would have been applied.
    unguarded = _rank(model_path, cfg)
    assert _train(unguarded, batches).optimizer_steps == 3
    assert _digests(unguarded)[0] != before[0]


def test_pre_update_thresholds(model_path):
    cfg = LearnerConfig(algorithm="gspo", zero_stage=1, micro_batch_size=4, lr=1e-3, num_minibatches=1)
    learner = _rank(model_path, cfg)
    before = _digests(learner)
    b = make_batch(model_path, 4, seed=71, noise=0.05)
    out = _train(learner, [b], guard={"max_logprob_diff": 0.01, "min_entropy": 100.0, "max_load_imbalance": 1.0})
    assert out.failed_checks == ("max_logprob_diff", "min_entropy", "max_load_imbalance")
    assert out.skipped and _digests(learner) == before
    passed = _train(learner, [b], guard={"max_logprob_diff": 1.0, "min_entropy": 0.1, "max_load_imbalance": 8.0})
    assert not passed.skipped and _digests(learner)[0] != before[0]


def _train_ranks(ray, actors, shards: list[list[TrainBatch]], full: list[TrainBatch], guard):
    norms = [loss_normalisers(b.response_mask) for b in full]
    return ray.get([a.train_rollout_batch.remote(s, [n for n, _ in norms], [t for _, t in norms], guard=guard)
                    for a, s in zip(actors, shards)])


def _split(batches: list[TrainBatch]) -> list[list[TrainBatch]]:
    return [[b.select([0, 1]) for b in batches], [b.select([2, 3]) for b in batches]]


def test_two_ranks_zero2_refuse_together_and_restore_exactly(model_path, ray_cluster, tmp_path):
    """A fault on ONE rank's shard makes both ranks skip (the decision is collective); each rank's weights and
    optimizer partition are restored bit for bit; the next good step equals the same step taken from a
    checkpoint saved before the bad one; the MoE metrics agree on both ranks and with a full-batch reference."""
    ray = ray_cluster
    cfg = LearnerConfig(algorithm="grpo", zero_stage=2, micro_batch_size=1, lr=1e-3, num_minibatches=2)
    good1 = [make_batch(model_path, 4, seed=s) for s in (81, 82)]
    good2 = [make_batch(model_path, 4, seed=s) for s in (83, 84)]
    bad = [make_batch(model_path, 4, seed=s) for s in (85, 86)]
    actors = _start_ranks(ray, model_path, cfg)
    try:
        outs = _train_ranks(ray, actors, _split(good1), good1, LOOSE)
        assert outs[0] == outs[1] and not outs[0].skipped
        assert torch.equal(torch.tensor(outs[0].metrics["moe/expert_load"], dtype=torch.float64),
                           reference_expert_load(model_path, good1))
        weights = ray.get([a.state_digest.remote() for a in actors])
        opt = ray.get([a.optimizer_state_digest.remote() for a in actors])
        assert weights[0] == weights[1] and opt[0] != opt[1]
        ckpt = str(tmp_path / "ckpt")
        ray.get([a.save_checkpoint.remote(ckpt) for a in actors])

        # NaN behaviour log-prob on rank 1 only: refused before any update, on both ranks.
        shards = _split(bad)
        shards[1][0] = _poisoned(shards[1][0], float("nan"))
        outs = _train_ranks(ray, actors, shards, bad, LOOSE)
        assert json.dumps(asdict(outs[0]), sort_keys=True) == json.dumps(asdict(outs[1]), sort_keys=True)  # NaN != NaN
        assert outs[0].failed_checks == ("nonfinite_log_probs",)
        assert ray.get([a.state_digest.remote() for a in actors]) == weights
        assert ray.get([a.optimizer_state_digest.remote() for a in actors]) == opt

        # Huge advantages on rank 0's shard of minibatch 2: step 1 applied, step 2 breaks the norm: both undone.
        shards = _split(bad)
        shards[0][1] = _scaled(shards[0][1], 1e6)
        outs = _train_ranks(ray, actors, shards, bad, LOOSE)  # (normalisers depend on the masks only)
        assert outs[0] == outs[1]
        assert outs[0].failed_checks == ("max_grad_norm",) and outs[0].metrics["health/steps_undone"] == 2.0
        assert ray.get([a.state_digest.remote() for a in actors]) == weights
        assert ray.get([a.optimizer_state_digest.remote() for a in actors]) == opt

        outs = _train_ranks(ray, actors, _split(good2), good2, LOOSE)
        assert not outs[0].skipped
        after = (ray.get([a.state_digest.remote() for a in actors]), ray.get([a.optimizer_state_digest.remote() for a in actors]))
        ray.get([a.load_checkpoint.remote(ckpt) for a in actors])
        assert ray.get([a.state_digest.remote() for a in actors]) == weights
        _train_ranks(ray, actors, _split(good2), good2, None)
        assert (ray.get([a.state_digest.remote() for a in actors]),
                ray.get([a.optimizer_state_digest.remote() for a in actors])) == after
    finally:
        _stop(ray, actors)
