"""Config section ``learner``: the DeepSpeed learner and the RL objective.

The algorithm names, the loss aggregations, the KL estimators and the rule that refuses a length-weighted
aggregation for GSPO live in the core, in its torch-free module ``learner/objective_names.py`` (re-exported by
``learner/objectives.py``); this schema takes them from there, so that loading a config imports no torch.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from learner.objective_names import (
    ALGORITHMS,
    GSPO_LOSS_AGG,
    KL_ESTIMATORS,
    LOSS_AGGS,
    SEQUENCE_LEVEL_ALGORITHMS,
    check_loss_agg,
)


class Section(BaseModel):
    """Base of the learner config sections: unknown keys are refused and values are validated on assignment
    (tests/test_config.py checks that every section of the composed schema is strict)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=False)


Algorithm = Literal[ALGORITHMS]  # type: ignore[valid-type]  (Literal of the core's tuple of names)
LossAgg = Literal[LOSS_AGGS]  # type: ignore[valid-type]
KlEstimator = Literal[KL_ESTIMATORS]  # type: ignore[valid-type]


class LearnerConfig(Section):
    """Objective, optimiser and parallelism of the learner."""

    world_size: int = Field(1, ge=1, description="data-parallel DeepSpeed ranks (one Ray actor each)")
    num_cpus_per_rank: float = Field(1.0, gt=0, description="Ray CPUs reserved per learner rank")
    num_gpus_per_rank: float = Field(0.0, ge=0, description="Ray GPUs per learner rank (0 on CPU)")
    threads_per_rank: int = Field(1, ge=1, description="torch threads per rank on CPU (1 is fastest here)")
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="training dtype; bfloat16 accumulates gradients in fp32 and needs zero_stage >= 1"
    )
    algorithm: Algorithm = Field(
        "gspo", description="policy objective; clip range and loss_agg default per algorithm (learner/README.md)"
    )
    clip_low: float | None = Field(None, ge=0, description="ratio clip 1-clip_low; default per algorithm")
    clip_high: float | None = Field(None, ge=0, description="ratio clip 1+clip_high; default per algorithm")
    loss_agg: LossAgg | None = Field(
        None,
        description=f"loss aggregation; None = the algorithm's default ({', '.join(SEQUENCE_LEVEL_ALGORITHMS)} "
        f"accept only {GSPO_LOSS_AGG})",
    )
    num_minibatches: int = Field(4, ge=1, description="optimizer steps per rollout batch and epoch (paper: 4)")
    ppo_epochs: int = Field(1, ge=1, description="passes over the rollout batch")
    micro_batch_size: int = Field(16, ge=1, description="sequences per forward/backward on one rank")
    lr: float = Field(1e-6, gt=0, description="RL learning rate (AdamW)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW (beta1, beta2)")
    grad_clip: float = Field(1.0, gt=0, description="global gradient-norm clip")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty to the reference policy (paper: 0)")
    kl_estimator: KlEstimator = Field(
        "k3", description="estimator of the KL penalty (Schulman, 'Approximating KL divergence', 2020)"
    )
    normalize_adv_std: bool = Field(True, description="group z-score (True) or mean-only, Dr. GRPO (False)")
    old_logprob_source: Literal["rollout", "recompute"] = Field(
        "rollout", description="behaviour log-probs from the engine or a learner forward before updating"
    )
    cpu_shm_allreduce: bool = Field(
        False, description="CPU only: DeepSpeed's JIT-built shared-memory all-reduce instead of plain gloo"
    )
    dist_timeout_s: float = Field(300.0, gt=0, description="collective timeout; a dead peer fails after this")
    routing_replay: bool = Field(
        False,
        description="MoE only: reuse the experts chosen in the pre-update (behaviour-policy) forward in the "
        "training forwards of the rollout batch (GSPO paper section 5.3; the token-level baseline)",
    )
    moe_diagnostics: bool = Field(
        True, description="MoE only: log expert load (moe/load_*) and routing volatility (moe/routing_volatility*)"
    )
    zero3_param_persistence_threshold: int | None = Field(
        None,
        ge=0,
        description="ZeRO-3: parameters with fewer elements stay unpartitioned (None: DeepSpeed's default; "
        "0 partitions everything)",
    )

    @model_validator(mode="after")
    def _check(self) -> "LearnerConfig":
        check_loss_agg(self.algorithm, self.loss_agg, prefix="learner.")
        if self.dtype == "bfloat16" and self.zero_stage == 0:
            raise ValueError(
                "learner.dtype='bfloat16' with learner.zero_stage=0: DeepSpeed accumulates stage-0 bf16 gradients "
                "in bf16 (fp32 accumulation, data_types.grad_accum_dtype='fp32', needs ZeRO stage 1, 2 or 3); "
                "use learner.zero_stage >= 1 or learner.dtype='float32'"
            )
        return self


class WarmStartConfig(Section):
    """Supervised warm start (cold-start fine-tuning in miniature) run by the learner before RL."""

    steps: int = Field(0, ge=0, description="SFT optimizer steps before RL (0 = none)")
    batch_size: int = Field(64, ge=1, description="sequences per SFT step (all ranks together)")
    lr: float = Field(1e-3, gt=0, description="SFT learning rate (AdamW)")
    warmup_steps: int = Field(0, ge=0, description="SFT steps of linear learning-rate warm-up (0 = none)")
