"""Optimizer offload (``learner.offload_optimizer='cpu'``, issue 12): DeepSpeed ZeRO-Offload with DeepSpeed's
CPU Adam, real DeepSpeed (CPU accelerator, gloo) on the embedded tiny Qwen3-MoE, one rank in this process.

The first test that builds DeepSpeed's ``cpu_adam`` op JIT-compiles it (about 1.5 min on this 2-core machine,
then cached under ``~/.cache/torch_extensions``). Offload on the CPU moves nothing (the device is the host), but
it runs DeepSpeed's offload code path and its CPU Adam, which is what these tests check: one step equals torch's
AdamW on the same batch, and a checkpoint resumes bit for bit. The health guard's exact rollback with offload is
in tests/unit/learner/test_health_guard.py.
"""

from __future__ import annotations

import pytest
import torch

from learner.config import LearnerConfig
from learner.contracts import RolloutTrainResult
from learner.objectives import loss_normalisers
from tests.helpers.learner import TEMPERATURE, make_batch


def _rank(model_path: str, cfg: LearnerConfig):
    from learner.service import LearnerRank

    return LearnerRank(model_path, cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=0,
                       seed=0, temperature=TEMPERATURE)


def _step(learner, batch) -> tuple[RolloutTrainResult, dict[str, torch.Tensor]]:
    """One rollout batch with gradient capture: (its result, the gradient of its one optimizer step)."""
    s, t = loss_normalisers(batch.response_mask)
    learner.capture_gradients(True)
    out = learner.train_rollout_batch([batch], [s], [t])
    (grads,) = learner.captured_gradients()
    learner.capture_gradients(False)
    return out, grads


def _update_tolerance(before: torch.Tensor, a: torch.Tensor, b: torch.Tensor, lr_max: float) -> torch.Tensor:
    """Elementwise bound on |a - b| for two AdamW steps from ``before`` with the same gradient.

    Both optimizers evaluate ``p - lr (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) - lr wd p`` in float32
    but in different orders (CPU Adam folds the bias corrections into the step size and the denominator, SIMD
    with fused multiply-adds): the update ``u`` (|u| <= about lr (1 + wd |p|) < 2 lr here) differs by a few
    float32 roundings of itself, and the new parameter by one rounding of ``p - u``. Hence ``2 eps32 (|p| +
    2 lr)``. bf16 weights are the fp32 master rounded to bf16: two masters that differ that little can round to
    neighbouring bf16 values, one bf16 ulp (<= eps_bf16 |p|) apart.
    """
    eps32 = torch.finfo(torch.float32).eps
    tol = 2 * eps32 * (before.float().abs() + 2 * lr_max)
    if a.dtype != torch.float32:
        tol = tol + torch.finfo(a.dtype).eps * torch.maximum(a.float().abs(), b.float().abs())
    return tol


@pytest.mark.parametrize("zero_stage,dtype", [(2, "float32"), (3, "bfloat16")])
def test_offloaded_step_equals_torch_adamw(model_path, zero_stage, dtype):
    """Offload at ZeRO-2 (fp32) and at the 30B config's ZeRO-3 in bf16: DeepSpeed's CPU Adam steps the host's
    fp32 partitions; one optimizer step over 3 micro-batches (gradient accumulation on the offload path) with
    two parameter groups (router_lr_scale) and weight decay gives the same gradient, bit for bit, and the same
    weights within ``_update_tolerance`` as torch's AdamW without offload."""
    batch = make_batch(model_path, 5, seed=1)
    runs = {}
    for offload in ("none", "cpu"):
        cfg = LearnerConfig(zero_stage=zero_stage, dtype=dtype, micro_batch_size=2, lr=1e-3, num_minibatches=1,
                            weight_decay=0.1, router_lr_scale=2.0, offload_optimizer=offload)
        learner = _rank(model_path, cfg)
        before = learner.full_state_dict()
        out, grads = _step(learner, batch)
        runs[offload] = (learner, before, out, grads, learner.full_state_dict())
    (plain, before, out, grads, after), (off, _, out_off, grads_off, after_off) = runs["none"], runs["cpu"]
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    assert type(off.replica.base_optimizer()) is DeepSpeedCPUAdam
    assert type(plain.replica.base_optimizer()) is torch.optim.AdamW
    assert [g["lr"] for g in off.replica.base_optimizer().param_groups] == pytest.approx([1e-3, 2e-3])
    assert off.engine.zero_cpu_offload() and not plain.engine.zero_cpu_offload()
    assert off.engine.get_data_types()[1] == torch.float32  # gradients still accumulated in fp32
    assert out_off.optimizer_steps == 1
    # ZeRO-3's offload path sums the squared norm in float32 (complete_grad_norm_calculation_for_cpu_offload),
    # the device path in float64; the clip factor then differs by about 1e-8 relative, which moves an Adam
    # update lr g / (|g| + eps) by at most a quarter of that, far inside the bound below.
    assert out_off.grad_norm == pytest.approx(out.grad_norm, rel=1e-6)
    for name, g in grads.items():
        assert torch.equal(grads_off[name], g), f"{name}: the offload path got another gradient"
    assert sum(not torch.equal(after_off[n], before[n]) for n in before) >= len(before) // 2
    for name, p in after.items():
        q, p0 = after_off[name], before[name]
        if not p.is_floating_point():
            continue
        # (bf16 weights of 1.0 stay 1.0 after a 1e-3 update: the same tensors move in both runs)
        assert torch.equal(q, p0) == torch.equal(p, p0), f"{name}: updated in one run only"
        excess = float(((q.float() - p.float()).abs() - _update_tolerance(p0, p, q, 2e-3)).max())
        assert excess <= 0.0, f"{name}: CPU Adam and AdamW differ by {excess:.3e} beyond the rounding bound"


def test_offloaded_checkpoint_resumes_bit_for_bit(model_path, tmp_path):
    """ZeRO-2 with offload: save after two steps; steps 3 and 4 give digest D; load, then the same two steps give
    D again (weights and CPU Adam's moments and step counts). In between the process's CPU Adam has reached step
    4: without ``learner.state.reset_cpu_adam_cache`` it would take step 3's ``beta2 ** 3`` from ``pow`` instead
    of the uninterrupted run's running product, which differ in float32 at step 3 (0.999 ** 3)."""
    cfg = LearnerConfig(zero_stage=2, micro_batch_size=2, lr=1e-3, num_minibatches=1, offload_optimizer="cpu")
    b1, b2, b3, b4 = (make_batch(model_path, 4, seed=s) for s in (81, 82, 83, 84))
    learner = _rank(model_path, cfg)
    _step(learner, b1)
    _step(learner, b2)
    saved = learner.state_digest(), learner.optimizer_state_digest()
    learner.save_checkpoint(str(tmp_path / "ckpt"))
    _step(learner, b3)
    _step(learner, b4)
    uninterrupted = learner.state_digest(), learner.optimizer_state_digest()
    assert uninterrupted[0] != saved[0]
    learner.load_checkpoint(str(tmp_path / "ckpt"))
    assert (learner.state_digest(), learner.optimizer_state_digest()) == saved
    assert learner.optimizer_steps == 2
    _step(learner, b3)
    _step(learner, b4)
    assert (learner.state_digest(), learner.optimizer_state_digest()) == uninterrupted


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _host_offload_bytes(learner) -> tuple[int, int]:
    """(optimizer, gradient) bytes of the buffers DeepSpeed's ZeRO-Offload keeps on its optimizer device (the
    host): the fp32 master partitions and CPU Adam's moments; the fp32 gradient the optimizer steps with, plus
    stage 3's flat gradient partitions or stages 1-2's host accumulation buffers."""
    opt, base = learner.engine.optimizer, learner.replica.base_optimizer()
    moments = [v for st in base.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]
    if learner.cfg.zero_stage == 3:
        masters = opt.fp32_partitioned_groups_flat
        accumulation = [opt.grad_partitions_flat_buffer]
    else:
        masters = opt.single_partition_of_fp32_groups
        accumulation = list(opt.accumulated_grads_in_cpu.values())
    return _nbytes(masters) + _nbytes(moments), _nbytes([m.grad for m in masters]) + _nbytes(accumulation)


@pytest.mark.parametrize("zero_stage,dtype", [(3, "bfloat16"), (2, "bfloat16"), (2, "float32")])
def test_plan_counts_the_offloaded_buffers(model_path, zero_stage, dtype):
    """cluster.planning.memory_model.learner_host_offload_gib against a real engine after a step of 3 micro-batches (one rank,
    so N = 1): 12 bytes a parameter of optimizer state, 4 or 8 of gradients; at ZeRO-3 DeepSpeed's optimizer
    device, where it also puts the gradient partitions, is the host. DeepSpeed pads partitions for alignment,
    hence 1 %."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    from cluster.planning.memory_model import learner_host_offload_gib

    cfg = LearnerConfig(zero_stage=zero_stage, dtype=dtype, micro_batch_size=2, lr=1e-3, num_minibatches=1,
                        offload_optimizer="cpu")
    learner = _rank(model_path, cfg)
    _step(learner, make_batch(model_path, 5, seed=1))
    p = sum(int(getattr(q, "ds_numel", q.numel())) for q in learner.engine.module.parameters())
    want = learner_host_offload_gib(float(p), zero_stage=zero_stage, dtype=dtype, world_size=1)
    got_opt, got_grad = _host_offload_bytes(learner)
    assert got_opt / 2**30 == pytest.approx(want["optimizer"], rel=0.01)
    assert got_grad / 2**30 == pytest.approx(want["gradients"], rel=0.01)
    if zero_stage == 3:
        assert learner.engine.optimizer.device == OffloadDeviceEnum.cpu


# wide case [2]: make test keeps ZeRO-3's two offloaded ranks (the stage of the shipped offload config,
# configs/qwen3_30b_a3b_gsm8k.yaml) and ZeRO-2 offload on one rank (its step against torch and its bit-exact resume)
@pytest.mark.parametrize("zero_stage", [pytest.param(2, marks=pytest.mark.matrix), 3])
def test_two_offloaded_ranks_equal_single_process_full_batch(model_path, ray_cluster, zero_stage):
    """2 ranks with offload, uneven shards (2 vs 1 micro-batches of 2): DeepSpeed's host-side partitions and
    accumulation buffers give the plain-torch full-minibatch gradient (1e-5 relative) and update
    (``assert_params_close``), ranks bit-identical."""
    from tests.helpers.learner import two_ranks_match_reference

    cfg = LearnerConfig(algorithm="grpo", zero_stage=zero_stage, micro_batch_size=2, lr=1e-3, num_minibatches=1,
                        offload_optimizer="cpu", zero3_param_persistence_threshold=0 if zero_stage == 3 else None)
    batch = make_batch(model_path, 6, seed=30 + zero_stage)
    two_ranks_match_reference(ray_cluster, model_path, cfg, batch, [batch.select([0, 1, 2, 3]), batch.select([4, 5])])
