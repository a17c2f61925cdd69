"""The DeepSpeed config a learner rank is built with: batch arithmetic, ZeRO stage, and fp32 gradient
accumulation for bf16 weights (``data_types.grad_accum_dtype``; issue 15). The engine-side check (DeepSpeed
really resolving fp32 accumulation) is ``tests/integration/test_learner_service.py::test_bf16_accumulates_gradients_in_fp32``."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from learner.config import LearnerConfig
from learner.ds_config import build_ds_config


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_bf16_accumulates_gradients_in_fp32(zero_stage):
    ds = build_ds_config(LearnerConfig(zero_stage=zero_stage, dtype="bfloat16", micro_batch_size=4), world_size=2)
    assert ds["bf16"] == {"enabled": True} and ds["fp16"] == {"enabled": False}
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"}
    assert ds["communication_data_type"] == "fp32"  # reduced across ranks unrounded (DeepSpeed's default: bf16)
    assert ds["zero_optimization"]["stage"] == zero_stage
    assert ds["train_batch_size"] == 8 and ds["gradient_accumulation_steps"] == 1


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_float32_accumulates_in_fp32_too(zero_stage):
    ds = build_ds_config(LearnerConfig(zero_stage=zero_stage, dtype="float32"), world_size=1)
    assert ds["bf16"] == {"enabled": False} and ds["data_types"] == {"grad_accum_dtype": "fp32"}


def test_grad_accum_dtype_is_one_deepspeed_accepts():
    """DeepSpeed reads ``data_types.grad_accum_dtype`` through its DtypeEnum; the value must resolve to fp32."""
    import torch
    from deepspeed.runtime.config import DtypeEnum

    value = build_ds_config(LearnerConfig(dtype="bfloat16"), world_size=1)["data_types"]["grad_accum_dtype"]
    assert DtypeEnum(value).value == torch.float32


def test_bf16_without_zero_is_refused_naming_both_keys():
    """DeepSpeed 0.19 accumulates stage-0 bf16 gradients in bf16 (fp32 accumulation raises NotImplementedError
    there), so the config refuses the pair before any rank starts."""
    with pytest.raises(ValidationError) as err:
        LearnerConfig(zero_stage=0, dtype="bfloat16")
    assert "learner.dtype='bfloat16'" in str(err.value) and "learner.zero_stage=0" in str(err.value)
    assert LearnerConfig(zero_stage=0, dtype="float32").zero_stage == 0


def test_world_size_must_be_positive():
    with pytest.raises(ValueError, match="world_size=0"):
        build_ds_config(LearnerConfig(), world_size=0)


def test_overlap_comm_on_gpu_only():
    cfg = LearnerConfig(zero_stage=3, dtype="bfloat16")
    assert build_ds_config(cfg, world_size=2)["zero_optimization"]["overlap_comm"] is False
    assert build_ds_config(cfg, world_size=2, on_gpu=True)["zero_optimization"]["overlap_comm"] is True


def test_partitioned_build_and_reference_refusal():
    """ZeRO-3 on GPUs builds the model under zero.Init; a KL reference there is refused, naming the keys."""
    import pytest

    from learner.rank_setup import build_partitioned

    assert build_partitioned(LearnerConfig(zero_stage=3), on_gpu=True) is True
    assert build_partitioned(LearnerConfig(zero_stage=3), on_gpu=False) is False
    assert build_partitioned(LearnerConfig(zero_stage=2), on_gpu=True) is False
    with pytest.raises(ValueError, match="learner.kl_coef=0.1 with learner.zero_stage=3 on GPUs"):
        LearnerConfig(zero_stage=3, kl_coef=0.1, num_gpus_per_rank=1)
    assert LearnerConfig(zero_stage=3, kl_coef=0.1).kl_coef == 0.1  # the CPU keeps its unsharded reference


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_optimizer_offload_to_cpu(zero_stage):
    """learner.offload_optimizer='cpu': ZeRO's offload_optimizer section, host memory pinned on GPUs only; the
    CPU Adam that DeepSpeed insists on is built by learner.rank_setup.build_optimizer, so DeepSpeed's check
    (zero_force_ds_cpu_optimizer) stays at its default; everything else is the config without offload."""
    cfg = LearnerConfig(zero_stage=zero_stage, dtype="bfloat16", offload_optimizer="cpu")
    on_cpu, on_gpu = build_ds_config(cfg, world_size=8), build_ds_config(cfg, world_size=8, on_gpu=True)
    assert on_cpu["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert on_gpu["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "zero_force_ds_cpu_optimizer" not in on_gpu
    plain = build_ds_config(cfg.model_copy(update={"offload_optimizer": "none"}), world_size=8, on_gpu=True)
    del on_gpu["zero_optimization"]["offload_optimizer"]
    assert on_gpu == plain


def test_no_offload_section_by_default():
    for stage in (0, 1, 2, 3):
        ds = build_ds_config(LearnerConfig(zero_stage=stage), world_size=1, on_gpu=True)
        assert "offload_optimizer" not in ds["zero_optimization"]


def test_deepspeed_reads_the_offload_section():
    """DeepSpeed's own config parser turns the section into ZeRO-Offload to the CPU, pinned as asked."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    ds = build_ds_config(LearnerConfig(zero_stage=3, offload_optimizer="cpu"), world_size=2, on_gpu=True)
    zero = DeepSpeedZeroConfig(**ds["zero_optimization"])
    assert zero.offload_optimizer.device == OffloadDeviceEnum.cpu and zero.offload_optimizer.pin_memory is True


def test_the_policy_clips_itself_at_zero0_in_float32_only():
    """DeepSpeed's clip is off where the learner clips (``Replica._clip_stage0``): the policy at ZeRO-0 in float32;
    PPO's critic (``policy=False``) and the other stages and dtypes keep ``learner.grad_clip`` in DeepSpeed."""
    def clip(policy: bool, **kw) -> float:
        return build_ds_config(LearnerConfig(grad_clip=0.5, **kw), world_size=1, policy=policy)["gradient_clipping"]

    assert clip(True, zero_stage=0) == 0.0
    assert clip(False, zero_stage=0) == 0.5
    assert clip(True, zero_stage=1) == 0.5
    assert clip(True, zero_stage=1, dtype="bfloat16") == 0.5
