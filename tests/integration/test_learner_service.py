"""The learner service: real DeepSpeed (CPU accelerator, gloo) on the embedded tiny Qwen3-MoE.

Fast tests run one rank in this process (world_size=1). Slow tests start 2 ranks as Ray actors and prove that
micro-batched, data-parallel training gives exactly the gradient and update of one full-batch step computed
with plain torch and ``policy_loss`` (GSPO and GRPO, ZeRO stages 1, 2 and 3).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from learner.config import LearnerConfig
from learner.contracts import SFTBatch, TrainBatch
from learner.logprobs import token_log_probs
from learner.objectives import loss_normalisers, policy_loss, resolve_objective
from tests.helpers.learner import (
    TEMPERATURE,
    _ref_log_probs,
    _ref_model,
    _start_ranks,
    _stop,
    _train,
    assert_grads_close,
    assert_params_close,
    make_batch,
    reference_step,
    two_ranks_match_reference,
)
from tests.helpers.learner import port  # noqa: F401 - fixtures


def rank_shards(batch: TrainBatch, world_size: int) -> list[TrainBatch]:
    n = len(batch)
    per = n // world_size
    return [batch.select(list(range(r * per, (r + 1) * per))) for r in range(world_size)]


def _rank(model_path, cfg, port, seed=0):
    from learner.service import LearnerRank

    return LearnerRank(model_path, cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=port,
                       seed=seed, temperature=TEMPERATURE)


def _module_params(rank) -> dict[str, torch.Tensor]:
    return rank.full_state_dict()


@pytest.mark.parametrize("grad_clip", [1e-3, 1e3], ids=["clip_bites", "clip_idle"])
def test_zero0_clips_in_the_learner_as_torch_does(model_path, port, grad_clip):  # noqa: F811
    """ZeRO-0 in float32: DeepSpeed's clip is off and the learner clips with the norm it reports
    (``Replica._clip_stage0``). AdamW's first moment after one step is ``(1 - beta1) x`` the clipped gradient,
    whose scale Adam's update hides: it equals plain torch's full-batch gradient times ``min(1, clip / (norm +
    1e-6))``, whether the clip bites or not."""
    cfg = LearnerConfig(algorithm="gspo", zero_stage=0, micro_batch_size=2, lr=1e-3, grad_clip=grad_clip,
                        num_minibatches=1)
    batch = make_batch(model_path, 5, seed=4)
    learner = _rank(model_path, cfg, port)
    assert learner.engine.gradient_clipping() == 0.0
    s, t = loss_normalisers(batch.response_mask)
    out = learner.train_rollout_batch([batch], [s], [t])
    ref_grads, _ = reference_step(model_path, [batch], cfg)
    ref_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads.values())))
    assert out.grad_norm == pytest.approx(ref_norm, rel=1e-5)
    coef = min(1.0, grad_clip / (ref_norm + 1e-6))
    assert (coef < 1.0) == (grad_clip < 1.0)  # the two cases are what their names say
    opt = learner.replica.base_optimizer()
    for name, p in learner.engine.module.named_parameters():
        want = (1 - cfg.adam_betas[0]) * coef * ref_grads[name]
        torch.testing.assert_close(opt.state[p]["exp_avg"], want, rtol=1e-4, atol=1e-6 * coef)


def _one_step_equals_plain_torch(model_path, cfg, batch, port):
    """One rollout batch on a real rank (one optimizer step) against ``reference_step``'s plain-torch step:
    gradients and updated parameters close. Returns the rank's result and the reference gradients."""
    learner = _rank(model_path, cfg, port)
    learner.capture_gradients(True)
    s, t = loss_normalisers(batch.response_mask)
    out = learner.train_rollout_batch([batch], [s], [t])
    grads = learner.captured_gradients()
    learner.capture_gradients(False)
    ref_grads, ref_params = reference_step(model_path, [batch], cfg)
    assert len(grads) == 1 and out.optimizer_steps == 1
    assert_grads_close(grads[0], ref_grads)
    assert_params_close(_module_params(learner), ref_params, cfg.lr, ref_grads)
    return out, ref_grads


@pytest.mark.parametrize("algorithm", ["gspo", "grpo"])
def test_single_rank_micro_batches_equal_full_batch(model_path, port, algorithm):
    """3 micro-batches (2, 2, 1 rows) with gradient accumulation = one full-minibatch step in plain torch."""
    cfg = LearnerConfig(algorithm=algorithm, zero_stage=1, micro_batch_size=2, lr=1e-3, grad_clip=1.0,
                        num_minibatches=1)
    batch = make_batch(model_path, 5, seed=1)
    out, ref_grads = _one_step_equals_plain_torch(model_path, cfg, batch, port)
    ref_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads.values())))
    assert out.grad_norm == pytest.approx(ref_norm, rel=1e-5) and out.grad_norm == out.metrics["actor/grad_norm"]
    for key in ("loss/policy", "actor/clip_fraction", "actor/clip_fraction_low", "actor/clip_fraction_high",
                "actor/seq_ratio_mean", "actor/seq_ratio_min", "actor/seq_ratio_max", "actor/entropy",
                "actor/grad_norm", "actor/lr", "actor/train_rollout_logprob_diff"):
        assert key in out.metrics and isinstance(out.metrics[key], float), key
    assert out.metrics["actor/lr"] == pytest.approx(1e-3)


@pytest.mark.parametrize("group_by_length", [False, True])
def test_gspo_token_per_token_advantages_equal_full_batch(model_path, port, group_by_length):
    """Per-turn advantages (``TrainBatch.advantages`` ``[N, L-1]``, multi-turn episodes with per-turn rewards)
    through micro-batches trimmed to their own width (and reordered by length) = one full-minibatch step of
    plain torch with ``policy_loss`` on the same ``[N, L-1]`` advantages."""
    cfg = LearnerConfig(algorithm="gspo_token", zero_stage=1, micro_batch_size=2, lr=1e-3, grad_clip=1.0,
                        num_minibatches=1, group_by_length=group_by_length)
    batch = make_batch(model_path, 5, seed=1)
    g = torch.Generator().manual_seed(7)
    batch.advantages = torch.where(batch.response_mask, torch.randn(batch.response_mask.shape, generator=g), 0.0)
    out, ref_grads = _one_step_equals_plain_torch(model_path, cfg, batch, port)


def test_epochs_and_minibatches_give_one_step_each(model_path, port):
    cfg = LearnerConfig(algorithm="gspo", zero_stage=2, micro_batch_size=2, lr=1e-4, ppo_epochs=2,
                        num_minibatches=2)
    batches = [make_batch(model_path, 3, seed=11), make_batch(model_path, 4, seed=12)]
    learner = _rank(model_path, cfg, port)
    learner.capture_gradients(True)
    norms = [loss_normalisers(b.response_mask) for b in batches]
    out = learner.train_rollout_batch(batches, [n for n, _ in norms], [t for _, t in norms])
    steps = learner.captured_gradients()
    learner.capture_gradients(False)
    assert out.optimizer_steps == 4 and len(steps) == 4
    ref_grads, _ = reference_step(model_path, batches[:1], cfg)
    assert_grads_close(steps[0], ref_grads)
    # Later steps see updated weights: their gradients differ from the first.
    assert any(not torch.equal(steps[2][k], steps[0][k]) for k in steps[0])
    assert out.metrics["actor/grad_norm_max"] >= out.grad_norm > 0


def test_metrics_are_exact(model_path, port):
    """One minibatch, one epoch: every metric is a function of the initial weights, checked against a direct
    computation over the whole batch."""
    cfg = LearnerConfig(algorithm="gspo", zero_stage=0, micro_batch_size=3, lr=1e-4, num_minibatches=1)
    batch = make_batch(model_path, 7, seed=3, noise=2e-3, empty_row=True)
    model = _ref_model(model_path)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        lp = token_log_probs(logits, batch.input_ids[:, 1:], TEMPERATURE)
        result = policy_loss(lp, batch.old_log_probs, batch.advantages, batch.response_mask, resolve_objective("gspo"))
        loss, pm, per_seq = result.loss, result.metrics, result.per_sequence
    mask = batch.response_mask
    diff = float(torch.where(mask, (lp - batch.old_log_probs).abs(), 0.0).sum() / mask.sum())
    p = torch.softmax(logits.double() / TEMPERATURE, -1)
    ent = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)
    entropy = float(ent[mask].mean())
    seq = torch.exp(torch.where(mask, lp - batch.old_log_probs, 0.0).double().sum(-1) / mask.sum(-1).clamp(min=1))
    seq = seq[mask.any(-1)]

    learner = _rank(model_path, cfg, port)
    s, t = loss_normalisers(mask)
    out = learner.train_rollout_batch([batch], [s], [t])
    m = out.metrics
    assert out.loss == pytest.approx(float(loss), rel=1e-5, abs=1e-8) and out.loss == m["loss/policy"]
    assert m["loss/policy_minibatches"] == pytest.approx([float(loss)], rel=1e-5, abs=1e-8)
    assert m["actor/train_rollout_logprob_diff"] == pytest.approx(diff, rel=1e-4)
    assert m["actor/entropy"] == pytest.approx(entropy, rel=1e-5)
    assert m["actor/clip_fraction"] == pytest.approx(pm["clip_fraction"])
    assert 0.0 < m["actor/clip_fraction"] < 1.0  # the data exercises both branches
    assert m["actor/clip_fraction_low"] + m["actor/clip_fraction_high"] == pytest.approx(m["actor/clip_fraction"])
    assert m["actor/seq_ratio_mean"] == pytest.approx(float(seq.mean()), rel=1e-6)
    assert m["actor/seq_ratio_min"] == pytest.approx(float(seq.min()), rel=1e-6)
    assert m["actor/seq_ratio_max"] == pytest.approx(float(seq.max()), rel=1e-6)
    assert out.optimizer_steps == 1 and not out.skipped and out.failed_checks == ()
    assert out.grad_norm > 0 and out.grad_norm == m["actor/grad_norm_max"]
    # per response length: [sequences, sum of s_i, clipped, units], from the whole batch computed at once
    has = mask.any(-1)
    want: dict[int, list[float]] = {}
    for n, s_i, c in zip(per_seq.length[has].tolist(), seq.tolist(), per_seq.clipped[has].tolist()):
        acc = want.setdefault(n, [0.0, 0.0, 0.0, 0.0])
        acc[0], acc[1], acc[2], acc[3] = acc[0] + 1, acc[1] + s_i, acc[2] + c, acc[3] + 1
    got = out.by_response_length
    assert "actor/by_response_length" not in m  # not a logged metric
    assert sorted(got) == sorted(want) and len(want) > 1
    for n in want:
        assert got[n] == pytest.approx(want[n], rel=1e-6)
    assert sum(v[2] for v in got.values()) / sum(v[3] for v in got.values()) == pytest.approx(m["actor/clip_fraction"])


def test_recompute_old_log_probs_gives_unit_ratio(model_path, port):
    """With recomputed behaviour log-probs, the first minibatch's ratios are exactly 1 (no clipping), and the
    update equals the plain-torch reference that recomputes too; the logged difference is still the one to
    the rollout's log-probs."""
    cfg = LearnerConfig(algorithm="gspo", zero_stage=2, micro_batch_size=2, lr=1e-3, num_minibatches=1,
                        old_logprob_source="recompute")
    batch = make_batch(model_path, 4, seed=4, noise=0.05)
    learner = _rank(model_path, cfg, port)
    s, t = loss_normalisers(batch.response_mask)
    out = learner.train_rollout_batch([batch], [s], [t])
    assert out.metrics["actor/clip_fraction"] == 0.0
    assert out.metrics["actor/seq_ratio_mean"] == 1.0 and out.metrics["actor/seq_ratio_max"] == 1.0
    assert out.metrics["actor/train_rollout_logprob_diff"] > 0.02  # noise 0.05 => mean |diff| ~ 0.04
    ref_grads, ref_params = reference_step(model_path, [batch], cfg, old_source="recompute")
    assert_params_close(_module_params(learner), ref_params, cfg.lr, ref_grads)


def test_compute_log_probs_export_and_checksum(model_path, port):
    cfg = LearnerConfig(zero_stage=1, micro_batch_size=3)
    batch = make_batch(model_path, 5, seed=5)
    learner = _rank(model_path, cfg, port)
    got = learner.compute_log_probs(batch)
    with torch.no_grad():
        want = torch.where(batch.response_mask, _ref_log_probs(_ref_model(model_path), batch), 0.0)
    assert got.dtype == torch.float32 and got.shape == batch.response_mask.shape
    assert float((got - want).abs().max()) < 1e-5
    assert bool((got[~batch.response_mask] == 0).all())

    # In-memory names: equal to the module's state dict; checkpoint format: equal to the safetensors file.
    from safetensors.torch import load_file

    state = _ref_model(model_path).state_dict()
    from learner.weight_sync import weight_buckets

    buckets = weight_buckets(learner.engine.module, 0.05)  # layer-wise groups, none merged at 0.05 MiB
    assert len(buckets) > 2 and sorted(n for b in buckets for n in b) == sorted(learner.full_state_dict())
    merged = learner.full_state_dict()
    assert merged.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(merged[k], v), k
    on_disk = load_file(os.path.join(model_path, "model.safetensors"))
    merged = learner.checkpoint_state_dict()
    assert set(merged) == set(on_disk)
    for k, v in on_disk.items():
        assert torch.equal(merged[k], v), k
    assert learner.state_checksum() == pytest.approx(sum(float(v.double().sum()) for v in state.values()), rel=1e-12)
    assert len(weight_buckets(learner.engine.module, 1024)) == 1  # everything fits one bucket
    with pytest.raises(ValueError, match="bucket_mb"):
        weight_buckets(learner.engine.module, 0)


def test_sft_step_lr_and_reset(model_path, port):
    cfg = LearnerConfig(zero_stage=2, micro_batch_size=2, lr=1e-4)
    b = make_batch(model_path, 5, seed=6)
    sft = SFTBatch(input_ids=b.input_ids, attention_mask=b.attention_mask, loss_mask=b.response_mask)
    with torch.no_grad():
        lp = _ref_log_probs(_ref_model(model_path), sft, temperature=1.0)
    want = float(-lp[sft.loss_mask].sum() / sft.loss_mask.sum())
    learner = _rank(model_path, cfg, port)
    learner.set_lr(5e-3)
    before = learner.state_checksum()
    out = learner.sft_step(sft, int(sft.loss_mask.sum()))
    assert out.loss == pytest.approx(want, rel=1e-5) and out.num_tokens == int(sft.loss_mask.sum())
    assert out.grad_norm > 0 and out.lr == pytest.approx(5e-3)
    assert learner.state_checksum() != before
    assert len(learner.replica.base_optimizer().state) > 0
    learner.reset_optimizer_state()
    assert len(learner.replica.base_optimizer().state) == 0
    learner.set_lr(1e-6)
    assert learner.get_lr() == pytest.approx(1e-6)
    out2 = learner.sft_step(sft, int(sft.loss_mask.sum()))
    assert out2.loss < out.loss
    with pytest.raises(ValueError, match="num_tokens"):
        learner.sft_step(sft, int(sft.loss_mask.sum()) + 1)
    with pytest.raises(ValueError, match="lr"):
        learner.set_lr(-1.0)


def test_bad_normalisers_are_refused(model_path, port):
    learner = _rank(model_path, LearnerConfig(zero_stage=0, micro_batch_size=4), port)
    b = make_batch(model_path, 4, seed=7)
    s, t = loss_normalisers(b.response_mask)
    with pytest.raises(ValueError, match=r"num_tokens\[0\]"):
        learner.train_rollout_batch([b], [s], [t + 1])
    with pytest.raises(ValueError, match=r"num_sequences\[0\]"):
        learner.train_rollout_batch([b], [s + 1], [t])
    with pytest.raises(ValueError, match="one entry per minibatch"):
        learner.train_rollout_batch([b], [s, s], [t])


def test_bad_shard_is_refused(model_path, port):
    learner = _rank(model_path, LearnerConfig(zero_stage=0, micro_batch_size=4), port)
    b = make_batch(model_path, 4, seed=9)
    s, t = loss_normalisers(b.response_mask)
    b.response_mask[0, -1] = True  # a target on padding (row 0 is shorter than the batch)
    b.attention_mask[0, -1] = 0
    with pytest.raises(ValueError, match="padding"):
        learner.train_rollout_batch([b], [s], [t + 1])
    b2 = make_batch(model_path, 4, seed=9)
    b2.advantages[1] = float("nan")
    with pytest.raises(ValueError, match="advantages"):
        learner.train_rollout_batch([b2], [s], [t])


def test_kl_penalty_against_frozen_reference(model_path, port):
    """kl_coef > 0 loads a frozen reference: at the initial weights the policy is the reference (KL 0, and
    the loss equals the plain policy loss); after an update the KL of the next minibatch is positive."""
    cfg = LearnerConfig(algorithm="grpo", zero_stage=1, micro_batch_size=2, lr=1e-2, num_minibatches=2,
                        kl_coef=0.5, kl_estimator="k3")
    batches = [make_batch(model_path, 4, seed=13), make_batch(model_path, 4, seed=14)]
    learner = _rank(model_path, cfg, port)
    assert learner.ref_model is not None
    learner.capture_gradients(True)
    norms = [loss_normalisers(b.response_mask) for b in batches]
    out = learner.train_rollout_batch(batches[:1], [norms[0][0]], [norms[0][1]])
    assert out.metrics["loss/kl"] == 0.0
    ref_grads, _ = reference_step(model_path, batches[:1], cfg)  # KL gradient is 0 at the reference
    assert_grads_close(learner.captured_gradients()[0], ref_grads)
    out = learner.train_rollout_batch(batches[1:], [norms[1][0]], [norms[1][1]])
    assert out.metrics["loss/kl"] > 0.0


def test_bf16_training_runs(model_path, port):
    cfg = LearnerConfig(algorithm="gspo", zero_stage=2, dtype="bfloat16", micro_batch_size=2, lr=1e-3,
                        num_minibatches=1)
    b = make_batch(model_path, 4, seed=15)
    s, t = loss_normalisers(b.response_mask)
    learner = _rank(model_path, cfg, port)
    before = learner.state_checksum()
    out = learner.train_rollout_batch([b], [s], [t])
    # (moe/expert_load is a list of lists, moe/layers a list, loss/policy_minibatches a list; every other value
    # is a float)
    assert all(torch.isfinite(torch.tensor(v)).all() for k, v in out.metrics.items() if k != "moe/layers")
    assert torch.isfinite(torch.tensor(list(out.by_response_length.values()))).all()
    assert out.metrics["actor/grad_norm"] > 0
    assert learner.state_checksum() != before
    assert all(v.dtype == torch.bfloat16 for v in learner.checkpoint_state_dict().values())
    assert learner.compute_log_probs(b).dtype == torch.float32


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_bf16_accumulates_gradients_in_fp32(model_path, port, zero_stage):
    """bf16 weights, fp32 gradient accumulation at every ZeRO stage DeepSpeed allows it at (issue 15): the engine
    resolves (bf16, fp32) and a minibatch of two micro-batches trains (bf16's BF16_Optimizer at stage 1, the
    ZeRO optimizers at 2 and 3)."""
    cfg = LearnerConfig(algorithm="gspo", zero_stage=zero_stage, dtype="bfloat16", micro_batch_size=2, lr=1e-3,
                        num_minibatches=1)
    b = make_batch(model_path, 4, seed=16)
    s, t = loss_normalisers(b.response_mask)
    learner = _rank(model_path, cfg, port)
    assert learner.engine.get_data_types() == (torch.bfloat16, torch.float32)
    if zero_stage > 1:
        assert learner.engine.optimizer.gradient_accumulation_dtype == torch.float32
    before = learner.state_checksum()
    out = learner.train_rollout_batch([b], [s], [t])
    assert math.isfinite(out.grad_norm) and out.grad_norm > 0
    assert learner.state_checksum() != before


def test_bf16_one_rank_skips_the_gradient_all_reduce_and_its_bf16_rounding(model_path, port):
    """One bf16 rank (DeepSpeed's BF16_Optimizer, ZeRO-1) runs no gradient all-reduce: there is no peer, and
    DeepSpeed's reduce flattened every gradient per optimizer step and sent it in its communication dtype,
    bfloat16, rounding the fp32-accumulated gradients. The update is bit for bit that of the all-reduce in
    float32 (the identity on one rank) and not that of the default bf16 one."""
    cfg = LearnerConfig(algorithm="gspo", zero_stage=1, dtype="bfloat16", micro_batch_size=2, lr=1e-3,
                        num_minibatches=1)
    b = make_batch(model_path, 4, seed=17)
    s, t = loss_normalisers(b.response_mask)
    digests = {}
    for reduce_dtype in (None, torch.float32, torch.bfloat16):
        learner = _rank(model_path, cfg, port)
        assert learner.engine.enable_backward_allreduce is False
        assert learner.engine.communication_data_type == torch.float32  # where ranks reduce (learner/ds_config.py)
        if reduce_dtype is not None:
            learner.engine.enable_backward_allreduce = True
            learner.engine.communication_data_type = reduce_dtype
        before = learner.state_digest()
        learner.train_rollout_batch([b], [s], [t])
        digests[reduce_dtype] = learner.state_digest()
        assert digests[reduce_dtype] != before
    assert digests[None] == digests[torch.float32] != digests[torch.bfloat16]


def test_checkpoint_round_trip_single_rank(model_path, port, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = LearnerConfig(zero_stage=2, micro_batch_size=2, lr=1e-3, num_minibatches=1)
    b = make_batch(model_path, 4, seed=8)
    s, t = loss_normalisers(b.response_mask)
    learner = _rank(model_path, cfg, port)
    learner.train_rollout_batch([b], [s], [t])
    weights, opt_state = learner.state_digest(), learner.optimizer_state_digest()
    torch.manual_seed(123)
    learner.save_checkpoint(str(tmp_path / "ckpt"))
    expected_rand = torch.rand(3)
    learner.train_rollout_batch([b], [s], [t])
    assert learner.state_digest() != weights
    torch.rand(5)
    learner.load_checkpoint(str(tmp_path / "ckpt"))
    assert learner.state_digest() == weights
    assert learner.optimizer_state_digest() == opt_state
    assert torch.equal(torch.rand(3), expected_rand)  # RNG restored
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt" / "hf"), dtype=torch.float32)
    full = _module_params(learner)
    for k, v in hf.state_dict().items():
        assert torch.equal(v, full[k]), k
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "ckpt" / "hf"))
    assert tok.decode(tok("1+2=3", add_special_tokens=False)["input_ids"]) == "1+2=3"
    with pytest.raises(FileNotFoundError):
        learner.load_checkpoint(str(tmp_path / "nothing"))


@pytest.mark.parametrize(
    "algorithm,zero_stage,split",
    [("gspo", 1, (3, 3)),
     # wide case: make test checks two ZeRO-2 ranks with different micro-batch counts against plain torch's
     # gradient (test_lean_learner.py), uneven shards under ZeRO-3 (next test), GRPO on two ZeRO-2 ranks
     # (test_health_guard.py)
     pytest.param("grpo", 2, (4, 2), marks=pytest.mark.matrix)],
    ids=["gspo-zero1", "grpo-zero2-uneven"],
)
def test_two_ranks_equal_single_process_full_batch(model_path, ray_cluster, algorithm, zero_stage, split):
    """2 ranks x micro-batches of 2 (with gradient accumulation, global normalisers, DeepSpeed's rank
    averaging compensated) = one plain-torch full-minibatch step: same gradient (1e-5 relative), same update,
    ranks bit-identical, identical metrics on both ranks. Uneven shards (2 vs 1 micro-batches): the short
    rank runs a zero-weighted pass to stay in step. ZeRO-3: next test."""
    ray = ray_cluster
    cfg = LearnerConfig(algorithm=algorithm, zero_stage=zero_stage, micro_batch_size=2, lr=1e-3, grad_clip=1.0,
                        num_minibatches=1)
    batch = make_batch(model_path, sum(split), seed=20 + zero_stage)
    shards = [batch.select(list(range(0, split[0]))), batch.select(list(range(split[0], sum(split))))]
    outs, ref_grads, exported = two_ranks_match_reference(ray, model_path, cfg, batch, shards)
    ref_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads.values())))
    assert outs[0].grad_norm == pytest.approx(ref_norm, rel=1e-5)
    assert all(torch.equal(v, exported[1][k]) for k, v in exported[0].items())


def test_two_ranks_zero3_equivalence_export_and_checkpoint(model_path, ray_cluster, tmp_path):
    """ZeRO-3 with every parameter partitioned (persistence threshold 0), 2 ranks, uneven shards (the short
    rank runs zero-weighted passes so that the gathers stay in step):
    - the gradient and update equal the plain-torch full-batch step (GSPO);
    - the checkpoint-format weights (gathered bucket by bucket) equal the full state dict in checkpoint names, as
      save_pretrained writes them, and the HF folder loads in transformers with the same weights;
    - save -> train -> load restores the weights, each rank's optimizer partition and the RNG."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ray = ray_cluster
    cfg = LearnerConfig(algorithm="gspo", zero_stage=3, micro_batch_size=2, lr=1e-3, num_minibatches=1,
                        zero3_param_persistence_threshold=0)
    batch = make_batch(model_path, 7, seed=30)
    shards = [[batch.select(list(range(0, 5)))], [batch.select(list(range(5, 7)))]]  # 3 vs 1 micro-batches
    actors = _start_ranks(ray, model_path, cfg)
    try:
        assert max(ray.get([a.local_param_fraction.remote() for a in actors])) < 0.6
        ray.get([a.capture_gradients.remote(True) for a in actors])
        outs = _train(ray, actors, shards, [batch])
        grads = ray.get([a.captured_gradients.remote() for a in actors])
        ray.get([a.capture_gradients.remote(False) for a in actors])
        ref_grads, ref_params = reference_step(model_path, [batch], cfg)
        assert outs[0] == outs[1]
        for g in grads:
            assert_grads_close(g[0], ref_grads)
        mem = ray.get([a.full_state_dict.remote() for a in actors])
        assert_params_close(mem[0], ref_params, cfg.lr, ref_grads)

        per_rank = ray.get([a.checkpoint_state_dict.remote() for a in actors])  # gathered bucket by bucket
        assert per_rank[1] == {} and len(per_rank[0]) > 1
        exported = per_rank[0]
        weights = ray.get([a.state_digest.remote() for a in actors])
        assert weights[0] == weights[1]
        opt_states = ray.get([a.optimizer_state_digest.remote() for a in actors])
        assert opt_states[0] != opt_states[1]  # each rank holds its own optimizer partition
        ckpt = tmp_path / "ckpt"
        ray.get([a.save_checkpoint.remote(str(ckpt)) for a in actors])
        on_disk = load_file(str(ckpt / "hf" / "model.safetensors"))
        assert set(on_disk) == set(exported)
        for k, v in on_disk.items():
            assert torch.equal(v, exported[k]), k
        hf = AutoModelForCausalLM.from_pretrained(str(ckpt / "hf"), dtype=torch.float32)
        checksums = ray.get([a.state_checksum.remote() for a in actors])  # collective under ZeRO-3
        assert checksums[0] == checksums[1] == pytest.approx(
            sum(float(v.double().sum()) for v in hf.state_dict().values()), rel=1e-12)

        _train(ray, actors, shards, [batch])
        assert ray.get([a.state_digest.remote() for a in actors])[0] != weights[0]
        ray.get([a.load_checkpoint.remote(str(ckpt)) for a in actors])
        assert ray.get([a.state_digest.remote() for a in actors]) == weights
        assert ray.get([a.optimizer_state_digest.remote() for a in actors]) == opt_states
    finally:
        _stop(ray, actors)
