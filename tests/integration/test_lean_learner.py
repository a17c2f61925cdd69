"""A lean learner (issue 11, item 4): micro-batches by token budget, the pre-update pass only when a setting
needs it, gradient checkpointing as an option.

Real DeepSpeed (CPU accelerator, gloo) on the embedded tiny Qwen3-MoE, one rank in this process; the
two-rank test (a token budget that gives the ranks different numbers of micro-batches) is slow.
"""

from __future__ import annotations

import math

import pytest
import torch

from learner.config import LearnerConfig
from learner.contracts import RolloutTrainResult, TrainBatch
from learner.microbatch import micro_slices, row_widths
from learner.objectives import loss_normalisers
from tests.helpers.learner import (
    TEMPERATURE,
    _start_ranks,
    _stop,
    _train,
    assert_grads_close,
    make_batch,
    reference_step,
)

RTOL = 1e-6  # gradients of two cuts of the same minibatch: the same up to float32 summation order


def _rank(model_path: str, cfg: LearnerConfig):
    from learner.service import LearnerRank

    return LearnerRank(model_path, cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=0, seed=0,
                       temperature=TEMPERATURE)


def _norms(batches: list[TrainBatch]) -> tuple[list[int], list[int]]:
    pairs = [loss_normalisers(b.response_mask) for b in batches]
    return [s for s, _ in pairs], [t for _, t in pairs]


def _train_captured(learner, batches: list[TrainBatch], guard=None) -> tuple[RolloutTrainResult, list[dict]]:
    """One rollout batch with gradient capture: (its result, the gradient of every optimizer step)."""
    learner.capture_gradients(True)
    out = learner.train_rollout_batch(batches, *_norms(batches), guard=guard)
    grads = learner.captured_gradients()
    learner.capture_gradients(False)
    return out, grads


def _count_forwards(learner) -> list[int]:
    """Counts the forwards of the policy (a forward hook on the transformers model under DeepSpeed)."""
    calls = [0]
    learner.engine.module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def assert_same_gradient(got: dict, want: dict, rtol: float = RTOL) -> None:
    """The whole gradient equal to ``rtol`` relative (2-norm of the difference over the 2-norm of ``want``),
    every tensor's to ``10 rtol`` of its own norm. (float32 sums in another order differ by ~1e-7 of a sum's
    scale: an entry near 0 has no relative precision of its own, and a tensor whose gradient sums many
    cancelling terms, such as a norm weight over every token and head, reaches ~1e-6.)"""
    assert set(got) == set(want)
    sq = [0.0, 0.0]
    for name, w in want.items():
        diff, ref = float((got[name].double() - w.double()).norm()), float(w.double().norm())
        assert diff <= 10 * rtol * ref + 1e-12, f"{name}: |diff| {diff:.3e} vs |grad| {ref:.3e}"
        sq = [sq[0] + diff**2, sq[1] + ref**2]
    assert math.sqrt(sq[0]) <= rtol * math.sqrt(sq[1]), f"|diff| {math.sqrt(sq[0]):.3e} vs |grad| {math.sqrt(sq[1]):.3e}"


def assert_same_update(got: dict, want: dict, grads: dict, lr: float, rtol: float = RTOL) -> None:
    """Parameters after one AdamW step equal to ``rtol`` of each tensor's largest parameter wherever
    ``|grad| > 1e-5``. (Adam's first step is ``lr g / (|g| + eps)``, eps 1e-8: on entries with ``|g|`` near eps
    it turns the float noise of the gradient into differences up to lr, which the last check bounds.)"""
    for name, w in want.items():
        diff = (got[name].double() - w.double()).abs()
        worst = float(torch.where(grads[name].abs() > 1e-5, diff, 0.0).max())
        assert worst <= rtol * float(w.abs().max()), f"{name}: {worst:.3e}"
        assert float(diff.max()) <= 2 * lr, name


@pytest.mark.parametrize("algorithm", ["gspo", "grpo"])
def test_token_budget_gives_the_gradient_and_update_of_the_fixed_split(model_path, algorithm):
    """Fixed micro-batches of 2 rows vs a 30-token budget (other cuts, each padded to its own longest row) vs
    a 1-token budget (smaller than any row: every row alone): the same gradient (1e-6 relative), the same
    update and the same metrics; and the gradient of plain torch's full minibatch."""
    batch = make_batch(model_path, 7, seed=61)
    runs = {}
    for name, budget in (("fixed", None), ("budget", 30), ("tiny", 1)):
        cfg = LearnerConfig(algorithm=algorithm, zero_stage=2, micro_batch_size=2, lr=1e-3, num_minibatches=1,
                            max_tokens_per_micro_batch=budget)
        learner = _rank(model_path, cfg)
        out, grads = _train_captured(learner, [batch])
        runs[name] = (out, grads, learner.replica.slices(batch), learner.full_state_dict())
    fixed_out, fixed_grads, fixed_slices, fixed_params = runs["fixed"]
    assert runs["budget"][2] != fixed_slices and len(runs["budget"][2]) > 1  # the cuts differ ...
    assert runs["tiny"][2] == [(i, i + 1) for i in range(len(batch))]
    for name in ("budget", "tiny"):
        out, grads, _, params = runs[name]
        assert len(grads) == 1 and out.optimizer_steps == 1
        assert_same_gradient(grads[0], fixed_grads[0])  # ... the gradient does not
        assert_same_update(params, fixed_params, fixed_grads[0], lr=1e-3)
        for key in ("loss/policy", "actor/clip_fraction", "actor/entropy", "actor/train_rollout_logprob_diff",
                    "actor/seq_ratio_mean", "actor/grad_norm", "moe/load_imbalance"):
            # the log-prob difference is a mean of |lp - old| ~ 1e-3 nats: float32 noise of lp (~1e-7) is absolute
            tol = 1e-7 if key == "actor/train_rollout_logprob_diff" else 1e-9
            assert out.metrics[key] == pytest.approx(fixed_out.metrics[key], rel=1e-6, abs=tol), key
    ref_grads, _ = reference_step(model_path, [batch], LearnerConfig(algorithm=algorithm, lr=1e-3))
    assert_grads_close(runs["budget"][1][0], ref_grads, rtol=1e-5)  # and equal plain torch's full minibatch


def test_group_by_length_gives_the_gradient_and_metrics_of_the_order_sent(model_path):
    """``learner.group_by_length`` on (longest rows first) and off, 2-row micro-batches of a batch whose rows
    differ in length: other micro-batches (fewer padded tokens), the same gradient, update and metrics."""
    batch = make_batch(model_path, 7, seed=62)
    assert len(set(row_widths(batch.attention_mask))) > 1
    runs = {}
    for grouped in (False, True):
        cfg = LearnerConfig(zero_stage=2, micro_batch_size=2, lr=1e-3, num_minibatches=1, group_by_length=grouped)
        learner = _rank(model_path, cfg)
        forwards = _count_forwards(learner)
        out, grads = _train_captured(learner, [batch])
        runs[grouped] = (out, grads, learner.full_state_dict(), forwards[0])
    (off, off_grads, off_params, _), (on, on_grads, on_params, n_on) = runs[False], runs[True]
    assert n_on >= 4  # the pre-update pass and the training pass, 4 micro-batches each
    assert_same_gradient(on_grads[0], off_grads[0])
    assert_same_update(on_params, off_params, off_grads[0], lr=1e-3)
    for key in ("loss/policy", "actor/clip_fraction", "actor/entropy", "actor/train_rollout_logprob_diff",
                "actor/seq_ratio_mean", "actor/seq_ratio_min", "actor/grad_norm", "moe/load_imbalance"):
        tol = 1e-7 if key == "actor/train_rollout_logprob_diff" else 1e-9  # |lp - old| ~ 1e-3: float32 noise
        assert on.metrics[key] == pytest.approx(off.metrics[key], rel=1e-6, abs=tol), key
    assert on.by_response_length.keys() == off.by_response_length.keys()


def test_token_budget_in_compute_log_probs_and_sft(model_path):
    from learner.contracts import SFTBatch

    batch = make_batch(model_path, 6, seed=63)
    sft = SFTBatch(input_ids=batch.input_ids, attention_mask=batch.attention_mask, loss_mask=batch.response_mask)
    got = {}
    for budget in (None, 20):
        learner = _rank(model_path, LearnerConfig(zero_stage=1, micro_batch_size=4, lr=1e-3,
                                                  max_tokens_per_micro_batch=budget))
        lps = learner.compute_log_probs(batch)
        learner.capture_gradients(True)
        out = learner.sft_step(sft, int(sft.loss_mask.sum()))
        got[budget] = (lps, out, learner.captured_gradients()[0], learner.replica.slices(batch))
    assert got[None][3] != got[20][3]
    assert float((got[None][0] - got[20][0]).abs().max()) < 1e-6
    assert bool((got[20][0][~batch.response_mask] == 0).all())
    assert got[20][1].loss == pytest.approx(got[None][1].loss, rel=1e-6)
    assert_same_gradient(got[20][2], got[None][2])


def test_pre_update_pass_skipped_when_nothing_needs_it(model_path):
    """rollout log-probs, no MoE diagnostics, no guard pre-check: 'auto' runs no pre-update forward (the
    forwards are the training passes alone), its metrics are absent, the update is that of 'always'."""
    batches = [make_batch(model_path, 5, seed=71), make_batch(model_path, 5, seed=72)]
    runs = {}
    for mode in ("always", "auto"):
        cfg = LearnerConfig(zero_stage=2, micro_batch_size=2, lr=1e-3, num_minibatches=2, moe_diagnostics=False,
                            pre_update_pass=mode, mismatch_monitor_every=0)
        learner = _rank(model_path, cfg)
        calls = _count_forwards(learner)
        out, grads = _train_captured(learner, batches, guard={"max_grad_norm": 1e6})
        runs[mode] = (out, grads, calls[0], learner.state_digest())
    passes = sum(len(micro_slices(b.attention_mask, 2)) for b in batches)  # 3 + 3
    first = len(micro_slices(batches[0].attention_mask, 2))  # the first minibatch's pass fuses with its training
    assert runs["always"][2] == 2 * passes - first and runs["auto"][2] == passes
    assert runs["auto"][3] == runs["always"][3]  # bit-identical weights after the update
    lean, full = runs["auto"][0].metrics, runs["always"][0].metrics
    for key in ("actor/entropy", "actor/train_rollout_logprob_diff"):
        assert key in full and key not in lean
    assert not any(k.startswith("moe/") for k in lean)
    assert lean["health/skipped"] == 0.0 and lean["health/nonfinite_log_probs"] == 0.0
    for key in ("loss/policy", "actor/clip_fraction", "actor/grad_norm", "actor/seq_ratio_mean"):
        assert lean[key] == full[key], key


def test_fused_first_minibatch_gives_the_update_and_metrics_of_the_separate_pass(model_path):
    """Recomputed behaviour log-probs: the first minibatch's taken from its own training forwards (fused) give
    every optimizer step's gradient, the weights and the pass's metrics of the separate no-gradient forward,
    with one minibatch's forwards fewer; in the second epoch the first minibatch still compares with the
    behaviour weights' log-probs (a current-weights "old" would put its ratio at 1 and change its gradient)."""
    ppo_epochs = 2
    batches = [make_batch(model_path, 5, seed=74), make_batch(model_path, 5, seed=75)]
    runs = {}
    for fused in (False, True):
        cfg = LearnerConfig(zero_stage=1, micro_batch_size=2, lr=1e-3, num_minibatches=2, moe_diagnostics=False,
                            old_logprob_source="recompute", rollout_correction="seq_geo_rs",
                            rollout_correction_low=0.9998, rollout_correction_high=1.0002, ppo_epochs=ppo_epochs,
                            fuse_first_minibatch=fused)
        learner = _rank(model_path, cfg)
        calls = _count_forwards(learner)
        out, grads = _train_captured(learner, batches, guard={"max_grad_norm": 1e6})
        runs[fused] = (out.metrics, grads, calls[0], learner.full_state_dict())
    first = len(micro_slices(batches[0].attention_mask, 2))
    assert runs[True][2] == runs[False][2] - first
    assert len(runs[True][1]) == len(runs[False][1]) == 2 * ppo_epochs
    for got, want in zip(runs[True][1], runs[False][1]):
        assert_same_gradient(got, want)
    assert_same_update(runs[True][3], runs[False][3], runs[False][1][0], lr=1e-3)
    fused, separate = runs[True][0], runs[False][0]
    for key in ("actor/entropy", "actor/train_rollout_logprob_diff", "mismatch/log_ratio_abs_max",
                "mismatch/masked_seq_share", "loss/policy", "actor/clip_fraction", "actor/seq_ratio_mean"):
        assert fused[key] == pytest.approx(separate[key], rel=1e-6, abs=1e-9), key
    assert separate["actor/train_rollout_logprob_diff"] > 1e-4  # the rollout noise it measures, not 0
    assert 0.0 < separate["mismatch/masked_seq_share"] < 1.0  # the correction drops some sequences, not all


def test_fused_first_minibatch_refused_before_update_still_reports_the_pass(model_path):
    """A non-finite rollout log-prob in the first minibatch refuses the update before any optimizer step, as
    with the separate pass; the first minibatch's forward then runs after all, so the metrics are complete."""
    batches = [make_batch(model_path, 4, seed=76), make_batch(model_path, 4, seed=77)]
    row = int(batches[0].response_mask.any(-1).nonzero()[0])
    batches[0].old_log_probs[row, int(batches[0].response_mask[row].nonzero()[0])] = float("inf")
    got = {}
    for fused in (False, True):
        learner = _rank(model_path, LearnerConfig(zero_stage=1, micro_batch_size=2, num_minibatches=2,
                                                  moe_diagnostics=False, old_logprob_source="recompute",
                                                  fuse_first_minibatch=fused))
        before = learner.state_digest()
        out = learner.train_rollout_batch(batches, *_norms(batches), guard={"max_grad_norm": 1e6})
        assert out.skipped and out.optimizer_steps == 0 and learner.state_digest() == before
        assert out.failed_checks == ("nonfinite_log_probs",) and out.metrics["health/nonfinite_log_probs"] == 1.0
        got[fused] = out.metrics
    assert got[True]["actor/entropy"] == pytest.approx(got[False]["actor/entropy"], rel=1e-6)


def test_pre_update_pass_runs_when_a_setting_needs_it(model_path):
    """auto: MoE diagnostics (default on) or a guard pre-check bring the pass (and its metrics) back; 'never'
    refuses a guard pre-check naming it; without the pass a non-finite rollout log-prob is still refused
    before any update."""
    batch = make_batch(model_path, 4, seed=73)
    learner = _rank(model_path, LearnerConfig(zero_stage=1, micro_batch_size=2, num_minibatches=1))
    out = learner.train_rollout_batch([batch], *_norms([batch]))
    assert "actor/entropy" in out.metrics and "moe/expert_load" in out.metrics  # moe_diagnostics needs it
    learner = _rank(model_path, LearnerConfig(zero_stage=1, micro_batch_size=2, num_minibatches=1,
                                              moe_diagnostics=False))
    out = learner.train_rollout_batch([batch], *_norms([batch]), guard={"min_entropy": 0.0})
    assert "actor/entropy" in out.metrics and "moe/expert_load" not in out.metrics  # the guard's pre-check needs it

    never = _rank(model_path, LearnerConfig(zero_stage=1, micro_batch_size=2, num_minibatches=1,
                                            moe_diagnostics=False, pre_update_pass="never"))
    with pytest.raises(ValueError, match=r"health.max_logprob_diff need\(s\) the pre-update pass"):
        never.train_rollout_batch([batch], *_norms([batch]), guard={"max_logprob_diff": 1.0})
    before = never.state_digest()
    poisoned = make_batch(model_path, 4, seed=73)
    row = int(poisoned.response_mask.any(-1).nonzero()[0])
    poisoned.old_log_probs[row, int(poisoned.response_mask[row].nonzero()[0])] = float("nan")
    out = never.train_rollout_batch([poisoned], *_norms([poisoned]), guard={})
    assert out.failed_checks == ("nonfinite_log_probs",) and out.metrics["health/nonfinite_log_probs"] == 1.0
    assert out.skipped and out.optimizer_steps == 0 and never.state_digest() == before
    assert "actor/entropy" not in out.metrics


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_gradient_checkpointing_same_gradient_and_routing_metrics(model_path, zero_stage):
    """Checkpointing on: the decoder layers alone are in training mode (attention and the rest stay in eval:
    no dropout), the training forwards really recompute (the routers run twice per training pass: forward
    and backward), and the gradients (two minibatches, 1e-6 relative), the MoE routing metrics taken with the
    router tap and the other metrics equal those without checkpointing; ZeRO-2 and ZeRO-3 (every parameter
    partitioned, gathered again for the recompute)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    batches = [make_batch(model_path, 5, seed=81), make_batch(model_path, 4, seed=82)]
    runs = {}
    for ckpt in (False, True):
        cfg = LearnerConfig(zero_stage=zero_stage, micro_batch_size=3, lr=1e-3, num_minibatches=2,
                            gradient_checkpointing=ckpt, zero3_param_persistence_threshold=0 if zero_stage == 3 else None)
        learner = _rank(model_path, cfg)
        model = learner.engine.module
        layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        assert len(layers) == 2 and all(m.training == ckpt for m in layers)
        assert not any(m.training for m in model.modules() if not isinstance(m, GradientCheckpointingLayer))
        router = learner.replica.tap._modules[0]
        calls = [0]
        router.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        out, grads = _train_captured(learner, batches)
        runs[ckpt] = (out, grads, calls[0], learner.state_digest())
    passes = sum(len(micro_slices(b.attention_mask, 3)) for b in batches)  # 2 + 2
    assert runs[False][2] == 2 * passes  # pre-update pass + training forwards
    assert runs[True][2] == 3 * passes  # + the recompute in every training backward
    for got, want in zip(runs[True][1], runs[False][1]):
        assert_same_gradient(got, want)
    assert runs[True][3] == runs[False][3]  # on the CPU even bit-identical: the recompute runs the same kernels
    for key, value in runs[False][0].metrics.items():
        if isinstance(value, float):
            assert runs[True][0].metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert runs[True][0].metrics["moe/expert_load"] == runs[False][0].metrics["moe/expert_load"]
    assert runs[True][0].metrics["moe/routing_volatility_passes"] == 1.0


def test_two_ranks_token_budget_with_different_micro_batch_counts(model_path, ray_cluster):
    """2 ranks, a 24-token budget: the ranks' shards cut into different numbers of micro-batches (the short
    rank runs zero-weighted passes); the gradient equals plain torch's full minibatch (1e-5) and both ranks end
    bit-identical."""
    ray = ray_cluster
    cfg = LearnerConfig(algorithm="gspo", zero_stage=2, micro_batch_size=2, lr=1e-3, num_minibatches=1,
                        max_tokens_per_micro_batch=24)
    batch = make_batch(model_path, 8, seed=91)
    shards = [batch.select(list(range(0, 4))), batch.select(list(range(4, 8)))]
    counts = [len(micro_slices(s.attention_mask, 2, 24)) for s in shards]
    assert counts[0] != counts[1], counts
    actors = _start_ranks(ray, model_path, cfg)
    try:
        ray.get([a.capture_gradients.remote(True) for a in actors])
        outs = _train(ray, actors, [[s] for s in shards], [batch])
        grads = ray.get([a.captured_gradients.remote() for a in actors])
        assert outs[0] == outs[1] and math.isfinite(outs[0].grad_norm)
        ref_grads, _ = reference_step(model_path, [batch], cfg)
        for g in grads:
            assert_grads_close(g[0], ref_grads)
        digests = ray.get([a.state_digest.remote() for a in actors])
        assert digests[0] == digests[1]
    finally:
        _stop(ray, actors)
