"""Config section ``learner``: the DeepSpeed learner and the RL objective.

The algorithm names, the loss aggregations, the KL estimators and the rule that refuses a length-weighted
aggregation for GSPO live in the core, in its torch-free module ``learner/objective_names.py`` (re-exported by
``learner/objectives.py``); this schema takes them from there, so that loading a config imports no torch.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from learner.critic_config import CriticConfig
from learner.health import GUARD_CHECKS
from learner.objective_names import (
    CORRECTIONS,
    TOKEN_CORRECTIONS,
    ALGORITHMS,
    GSPO_LOSS_AGG,
    KL_ESTIMATORS,
    LOSS_AGGS,
    SEQUENCE_LEVEL_ALGORITHMS,
    check_loss_agg,
)
from learner.loss_settings import (
    BUILTIN_LOSSES,
    accepts_token_weights,
    build_settings,
    default_normalize_adv_std,
    is_user_loss,
)


# Health-guard thresholds checked on the pre-update pass's metrics (max_logprob_diff, min_entropy,
# max_load_imbalance: the "pre" phase of learner/health.py, pure Python like this module).
PRE_UPDATE_GUARD_KEYS = tuple(key for key, (_, _, phase) in GUARD_CHECKS.items() if phase == "pre")


class Section(BaseModel):
    """Base of the learner config sections: unknown keys are refused and values are validated on assignment
    (tests/unit/cluster/test_config.py checks that every section of the composed schema is strict)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=False)


Algorithm = str  # a built-in name of ALGORITHMS or "module.path:function" (checked in LearnerConfig._algorithm)
LossAgg = Literal[LOSS_AGGS]  # type: ignore[valid-type]
KlEstimator = Literal[KL_ESTIMATORS]  # type: ignore[valid-type]


# the attention projections of Llama / Qwen-style decoders. Not the MLP's gate/up/down_proj: on an MoE, peft 0.21
# maps those names onto the fused expert tensors too (its ParamWrapper), which the merge refuses (learner/lora.py)
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class LoraConfigSection(Section):
    """LoRA RL (``learner/lora.py``, peft): a frozen base plus a trainable low-rank adapter; the engines get the
    merged weights. ``rank`` 0 or null = off (full fine-tuning)."""

    rank: int | None = Field(None, ge=0, description="LoRA rank r of each adapted layer; 0 or null = LoRA off")
    alpha: float | None = Field(None, gt=0, description="LoRA alpha: the update is scaled by alpha / rank; "
                                "null = rank (scale 1)")
    target_modules: str | list[str] = Field(
        default_factory=lambda: list(DEFAULT_TARGETS),
        description="peft target_modules: names of linear modules (suffixes of their paths) or a peft keyword "
        "such as 'all-linear'. The default adapts the attention projections; a dense model's MLP can be added "
        "([q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]). Adapting an MoE's fused experts "
        "(peft maps gate/up/down_proj onto them) or its router is refused: the merge into the engines' weights "
        "handles plain linear layers only")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout on the adapter's input in training forwards "
                           "(never in the pre-update, reference or engine passes)")

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and (not value or not all(isinstance(v, str) and v for v in value)):
            raise ValueError(f"learner.lora.target_modules={value!r} must be a non-empty list of module names "
                             "or 'all-linear'")
        if isinstance(value, str) and not value:
            raise ValueError("learner.lora.target_modules='' names no module")
        return value


class LearnerConfig(Section):
    """Objective, optimiser and parallelism of the learner."""

    world_size: int = Field(1, ge=1, description="data-parallel DeepSpeed ranks (one Ray actor each)")
    num_cpus_per_rank: float = Field(1.0, gt=0, description="Ray CPUs reserved per learner rank")
    node_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources (name: amount) that each rank's placement bundle asks for beside its "
        "CPUs, so that it lands only on nodes started with them (`ray start --resources '{\"NAME\": N}'`, "
        "gspo-cluster up --node-resources NAME=N); e.g. {learner_node: 1} dedicates nodes to this role. "
        "{} = any node",
    )


    num_gpus_per_rank: float = Field(0.0, ge=0, description="Ray GPUs per learner rank (0 on CPU)")
    threads_per_rank: int = Field(1, ge=1, description="torch and OpenMP threads per rank (OMP_NUM_THREADS): the "
                                  "CPU learner's compute (1 is fastest on 2 cores), and on GPUs DeepSpeed's CPU Adam "
                                  "with offload_optimizer='cpu' (give it the rank's num_cpus_per_rank)")
    max_threads_per_rank: int | None = Field(
        None,
        ge=1,
        description="elastic threads on CPU: before each micro-batch and each decoder layer's forward and backward a "
        "rank takes the cores of its affinity mask that other processes left idle over the latest 0.2 s (e.g. a "
        "colocated engine done generating in the overlapped step), up to this many torch threads, and drops back "
        "to threads_per_rank when they are busy again (learner.elastic_threads); None = always threads_per_rank. "
        "For one rank per machine",
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="training dtype; bfloat16 accumulates gradients in fp32 and needs zero_stage >= 1"
    )
    algorithm: Algorithm = Field(
        "gspo", description=f"policy loss from the registry: {', '.join(ALGORITHMS)}, or a user's "
        "'module.path:function' (learner/loss_registry.py); clip range, loss_agg and loss_options default per "
        "algorithm (learner/README.md)"
    )
    loss_options: dict[str, float | int | bool | str | None] = Field(
        default_factory=dict,
        description="the loss's own settings beyond clip_low / clip_high / loss_agg, by name: sapo {tau_pos, "
        "tau_neg}, dr_grpo {norm_length} (set from rollout.max_response_tokens when unset), a user loss its "
        "own; a name the loss does not have is refused",
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
    micro_batch_size: int = Field(
        16, ge=1, description="sequences per forward/backward on one rank (when max_tokens_per_micro_batch is None)"
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        description="token budget of a micro-batch instead of micro_batch_size rows: consecutive rows of a rank's "
        "shard packed while rows x their longest real row <= the budget, each micro-batch padded only to its own "
        "longest row, a longer row alone; the gradient does not depend on the cut (global normalisers). "
        "None = micro_batch_size rows",
    )
    group_by_length: bool = Field(
        True,
        description="sort each rank's shard of a minibatch by sequence length (longest first) before cutting "
        "micro-batches, so rows of like length share a micro-batch and little compute goes to padding (the "
        "name of transformers' Trainer option); the gradient does not depend on the order (global normalisers; "
        "float summation order only). false = rows in the order the driver sent them",
    )
    fused_optimizer: bool = Field(
        True,
        description="torch's fused AdamW kernel (fused=True: one pass over each parameter; about 3.5x faster "
        "than the per-tensor loop on this CPU, bench/learner.py); false = torch's default implementation. "
        "Unused with offload_optimizer='cpu' (DeepSpeed's CPU Adam steps instead)",
    )
    offload_optimizer: Literal["none", "cpu"] = Field(
        "none",
        description="DeepSpeed ZeRO-Offload of the optimizer: 'cpu' keeps the fp32 master weights, Adam's moments "
        "and the fp32 gradient partitions in host RAM (pinned on GPUs) and steps them with DeepSpeed's CPU Adam "
        "(deepspeed.ops.adam.DeepSpeedCPUAdam, AdamW mode, the same lr, betas, weight decay and parameter groups; "
        "JIT-built by DeepSpeed on first use); needs zero_stage >= 1. 'none' = the torch AdamW on the device",
    )
    pre_update_pass: Literal["auto", "always", "never"] = Field(
        "auto",
        description="the no-gradient forward over the rollout batch before the first optimizer step: 'auto' runs "
        "it only when something needs it (old_logprob_source=recompute or auto's check steps and switch, "
        "routing_replay, moe_diagnostics on an MoE "
        "model, or a health-guard pre-check max_logprob_diff / min_entropy / max_load_imbalance); 'never' refuses "
        "those settings. Skipped, actor/entropy, actor/train_rollout_logprob_diff and the moe/ metrics are absent "
        "(learner/README.md)",
    )
    fuse_first_minibatch: bool = Field(
        True,
        description="when the pre-update pass runs, it skips the first minibatch: that minibatch trains before any "
        "optimizer step of its rollout batch, so its training forwards run at the behaviour weights and their "
        "detached log-probs are its behaviour log-probs (old_logprob_source=recompute: ratio 1 exactly) and its "
        "part of the pass's metrics. Saves one minibatch's forward per rollout batch. Not where the first "
        "minibatch's results are needed before it trains (routes under the MoE router tap, PPO's critic, a "
        "health-guard pre-check, LoRA dropout); false = the separate no-gradient forward for every minibatch",
    )
    pack_sequences: bool = Field(
        True,
        description="sequence packing (learner/packing.py): each micro-batch's sequences run end to end in rows no "
        "longer than its longest (position ids restart per sequence, attention confined to each; transformers' "
        "packed path), so only the rows' unused tails are padding (none with packing_layout=flat); the log-probs "
        "equal the padded forward's within float32 rounding. Forwards under the MoE router tap (moe_diagnostics, "
        "routing_replay) stay padded. false = the padded forward",
    )
    packing_layout: Literal["bins", "flat"] = Field(
        "bins",
        description="with pack_sequences: 'bins' runs the packed rows as [bins, longest row] (a bin's unused tail "
        "is padding that every layer runs on); 'flat' runs one row of the real tokens through every token-wise "
        "layer (projections, experts, norms, head) and lays it into the bins for attention alone, so only "
        "attention sees the tails (learner/packing.py, BinLayout). Measured on a 2-core CPU, 'flat' was 2-3% "
        "slower at 4.9% tails (small bench workload) and 1-13% slower at 0.4% (tiny): its gathers cost more "
        "than the tails (docs/benchmarks.md). 'flat' needs SDPA attention and no sliding-window layer and is not "
        "used with gradient_checkpointing; where it does not apply, 'bins' runs. Both equal the padded forward "
        "within float32 rounding",
    )
    autocast: Literal["off", "bfloat16"] = Field(
        "off",
        description="'bfloat16': the learner's forwards (and so their backwards) under torch.autocast in bf16 "
        "with float32 weights, optimizer and log-prob math; faster on CPUs with bf16 units (avx512_bf16, AMX) "
        "and GPUs, at a learner/engine log-prob gap against an fp32 engine (docs/benchmarks.md). An MoE's expert "
        "GEMMs stay float32: torch has no autocast rule for grouped_mm (pytorch issue 174763) and transformers "
        "casts their input to the weights' dtype. 'off' = float32",
    )
    mismatch_monitor_every: int = Field(
        10,
        ge=0,
        description="with pre_update_pass='auto' and nothing that needs the pass: run it anyway on RL steps 1, "
        "N+1, 2N+1, ... (the driver decides by global step, so a resumed run monitors the same steps; a caller "
        "that passes no decision gets every N-th batch the rank trains), so actor/train_rollout_logprob_diff (and "
        "actor/entropy, mismatch/*) are measured at 1/N of the pass's cost and a broken weight sync shows up, on "
        "dense and MoE models. In the one-step overlap (trainer.max_staleness >= 1) a monitored step's rollout is "
        "collected on-policy, after the previous sync, so the metric is the engine/learner gap alone; with partial "
        "rollouts it is not exact (samples carried over a sync, docs/partial_rollouts.md). These are also the "
        "check steps of old_logprob_source='auto' (under pre_update_pass 'auto' or 'always'); 0 = off (and 'auto' "
        "then reads as 'rollout', unchecked)",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="recompute each decoder layer's activations in the backward (transformers, non-reentrant) "
        "instead of keeping them: less memory, one more forward per training pass; refused with routing_replay",
    )
    lr: float = Field(1e-6, gt=0, description="RL learning rate (AdamW)")
    lr_warmup_steps: int = Field(
        0, ge=0, description="RL steps of linear learning-rate warm-up: RL step s (from 1) trains at lr x min(1, "
        "s / lr_warmup_steps); 0 = the constant lr. verl's GPU recipes warm up for 10 optimizer steps "
        "(actor.optim.lr_warmup_steps), OpenRLHF for a share of them (--lr_warmup_ratio); here a step's "
        "num_minibatches updates share its lr",
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay")
    router_lr_scale: float = Field(
        1.0, gt=0, description="MoE only: the expert routers' RL learning rate is learner.lr x this (the warm start keeps "
        "warm_start.lr for every parameter); "
        "> 1 makes routing move faster per update, for studying routing volatility")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW (beta1, beta2)")
    grad_clip: float = Field(1.0, gt=0, description="global gradient-norm clip")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty to the reference policy (paper: 0)")
    kl_estimator: KlEstimator = Field(
        "k3", description="estimator of the KL penalty (Schulman, 'Approximating KL divergence', 2020)"
    )
    normalize_adv_std: bool | None = Field(
        None, description="group z-score (true) or mean-only, Dr. GRPO (false); null = the algorithm's own (false "
        "for dr_grpo, true otherwise)")
    old_logprob_source: Literal["auto", "rollout", "recompute"] = Field(
        "auto",
        description="the behaviour (old) log-probs GSPO's ratio is taken against: 'rollout' the engine's, as it "
        "sampled; 'recompute' the learner's own forward before the update (the pre-update pass, every step); "
        "'auto' the engine's while the mismatch monitor (mismatch_monitor_every) finds the engine/learner gap "
        "within max_rollout_logprob_gap, and the learner's from the first monitored step that finds it above, for "
        "the rest of the run (that step trains on its recomputed ones too; logged once with the gap, the bound and "
        "the step, actor/old_logprob_recomputed 0/1; the driver decides and checkpoints the switch, "
        "learner/README.md). Without a monitored step (mismatch_monitor_every=0, pre_update_pass='never', or a "
        "rank called without the driver's decision) 'auto' is 'rollout'",
    )
    max_rollout_logprob_gap: float = Field(
        1e-4,
        gt=0,
        description="old_logprob_source='auto': the largest engine/learner gap, mean |learner - engine log-prob| "
        "per response token in nats on a monitored step, under which the engine's log-probs stay the behaviour "
        "log-probs. 1e-4 sits between float32 on both sides (measured 3e-7 to 7e-7 on the CPU for the tiny models, "
        "6.1e-6 for SmolLM2-135M upcycled into an MoE) and any bf16 side (1.2e-3 with a bf16-autocast learner, 0.033 with "
        "a bf16 engine and learner), 17x above the largest float32 gap and 12x below the smallest bf16 one; it is "
        "a third of GSPO's clip range (3e-4), so a gap under it cannot by itself push a sequence ratio out of the "
        "clip band",
    )
    cpu_shm_allreduce: bool = Field(
        False, description="CPU only: DeepSpeed's JIT-built shared-memory all-reduce instead of plain gloo"
    )
    dist_timeout_s: float = Field(300.0, gt=0, description="collective timeout; a dead peer fails after this")
    routing_replay: Literal["off", "learner", "rollout"] = Field(
        "off",
        description="MoE only: experts forced in the training forwards of a rollout batch. 'learner' (R2): those "
        "of the learner's own pre-update (behaviour-policy) forward (GSPO paper section 5.3); 'rollout' (R3, arXiv "
        "2510.11370): those the rollout engine ran when it sampled (rollout.return_routed_experts), also in the "
        "pre-update pass. Gate weights always come from the live router logits. true/false read as "
        "'learner'/'off'",
    )
    rollout_correction: Literal[CORRECTIONS] = Field(  # type: ignore[valid-type]
        "off",
        description="training-vs-inference mismatch correction from d_t = log pi_train(theta_old) - log pi_engine "
        "(learner/rollout_correction.py): 'token_tis' weight min(exp(d_t), rollout_correction_high); 'token_mis' "
        "drop tokens with exp(d_t) outside the band; 'seq_mis' drop sequences with exp(sum d_t) outside it; "
        "'seq_geo_rs' drop sequences with exp(mean d_t) outside it. token_* refused with gspo/gspo_token. The "
        "mismatch/* metrics are logged whenever the pre-update pass runs",
    )
    rollout_correction_low: float = Field(0.5, gt=0, description="lower bound of the correction's ratio band")
    rollout_correction_high: float = Field(
        2.0, gt=0, description="upper bound of the correction's ratio band; the weight cap C of 'token_tis'"
    )
    moe_diagnostics: bool = Field(
        True, description="MoE only: log expert load (moe/load_*) and routing volatility (moe/routing_volatility*)"
    )
    critic: CriticConfig = Field(
        default_factory=CriticConfig, description="PPO's value model and GAE (learner.algorithm='ppo' only)"
    )
    zero3_param_persistence_threshold: int | None = Field(
        None,
        ge=0,
        description="ZeRO-3: parameters with fewer elements stay unpartitioned (None: DeepSpeed's default; "
        "0 partitions everything)",
    )
    lora: LoraConfigSection = Field(default_factory=LoraConfigSection, description="LoRA RL (rank 0/null = off)")

    @field_validator("algorithm")
    @classmethod
    def _algorithm(cls, value: str) -> str:
        if value not in ALGORITHMS and not is_user_loss(value):
            raise ValueError(f"algorithm={value!r} is not one of {ALGORITHMS} or a user loss 'module.path:function'")
        return value

    def advantage_std(self) -> bool:
        """``normalize_adv_std`` resolved: the config's, or the algorithm's own when null."""
        if self.normalize_adv_std is not None:
            return self.normalize_adv_std
        return default_normalize_adv_std(self.algorithm)

    @field_validator("routing_replay", mode="before")
    @classmethod
    def _replay_bool(cls, value: object) -> object:
        """Configs written before the three modes said true/false: read them as 'learner'/'off' (YAML also
        reads a bare ``off`` as false)."""
        if isinstance(value, bool):
            return "learner" if value else "off"
        return value

    @field_validator("rollout_correction", mode="before")
    @classmethod
    def _correction_off(cls, value: object) -> object:
        """YAML reads a bare ``off`` as false: take it as 'off'."""
        return "off" if value is False else value

    @model_validator(mode="after")
    def _check(self) -> "LearnerConfig":
        check_loss_agg(self.algorithm, self.loss_agg, prefix="learner.")
        if self.algorithm in BUILTIN_LOSSES:  # a user loss's settings are checked when the driver imports it
            build_settings(self.algorithm, BUILTIN_LOSSES[self.algorithm], {"clip_low": self.clip_low, "clip_high":
                           self.clip_high, "loss_agg": self.loss_agg}, self.loss_options, prefix="learner.")
        if self.dtype == "bfloat16" and self.zero_stage == 0:
            raise ValueError(
                "learner.dtype='bfloat16' with learner.zero_stage=0: DeepSpeed accumulates stage-0 bf16 gradients "
                "in bf16 (fp32 accumulation, data_types.grad_accum_dtype='fp32', needs ZeRO stage 1, 2 or 3); "
                "use learner.zero_stage >= 1 or learner.dtype='float32'"
            )
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            raise ValueError(
                f"learner.offload_optimizer={self.offload_optimizer!r} with learner.zero_stage=0: DeepSpeed offloads "
                "only a ZeRO optimizer's partitions; use learner.zero_stage >= 1 or learner.offload_optimizer='none'"
            )
        if self.max_threads_per_rank is not None and self.max_threads_per_rank < self.threads_per_rank:
            raise ValueError(f"learner.max_threads_per_rank={self.max_threads_per_rank} is below "
                             f"learner.threads_per_rank={self.threads_per_rank}")
        if self.max_threads_per_rank is not None and self.num_gpus_per_rank > 0:
            raise ValueError(f"learner.max_threads_per_rank={self.max_threads_per_rank} is a CPU setting; on GPUs "
                             f"(learner.num_gpus_per_rank={self.num_gpus_per_rank}) leave it null")
        if self.pre_update_pass == "never" and (needs := self.pre_update_pass_needs(guard=None)):
            raise ValueError(
                "learner.pre_update_pass='never', but " + ", ".join(needs) + " need(s) the pre-update pass; "
                "use learner.pre_update_pass='auto' or change those keys"
            )
        if self.kl_coef > 0 and self.zero_stage == 3 and self.num_gpus_per_rank > 0:
            raise ValueError(
                f"learner.kl_coef={self.kl_coef} with learner.zero_stage=3 on GPUs (learner.num_gpus_per_rank="
                f"{self.num_gpus_per_rank}): the KL reference model would be an unsharded copy of the whole model on "
                "every rank, next to a policy ZeRO-3 partitions; use learner.kl_coef=0 (the GSPO paper's setting) or "
                "a ZeRO stage that keeps whole weights on every rank anyway (learner.zero_stage <= 2)"
            )
        if self.rollout_correction in TOKEN_CORRECTIONS and not accepts_token_weights(self.algorithm):
            raise ValueError(
                f"learner.rollout_correction={self.rollout_correction!r} with learner.algorithm={self.algorithm!r}: "
                "per-token weights or drops change GSPO's sequence-level aggregation; use 'seq_mis' or 'seq_geo_rs'"
            )
        if self.lora.rank and self.zero_stage == 3 and self.num_gpus_per_rank > 0:
            raise ValueError(f"learner.lora.rank={self.lora.rank} with learner.zero_stage=3 on GPUs: the switch to "
                             "LoRA rebuilds the model from full weights, which the partitioned GPU build does not "
                             "take yet (learner.rank_setup.build_partitioned); use learner.zero_stage <= 2")
        if self.lora.rank and self.router_lr_scale != 1.0:
            raise ValueError(f"learner.router_lr_scale={self.router_lr_scale} with learner.lora.rank={self.lora.rank}: "
                             "under LoRA the routers are frozen (only the adapter trains); leave router_lr_scale at 1")
        if self.rollout_correction_low > self.rollout_correction_high:
            raise ValueError(f"learner.rollout_correction_low={self.rollout_correction_low} > "
                             f"learner.rollout_correction_high={self.rollout_correction_high}: empty band")
        if self.gradient_checkpointing and self.routing_replay != "off":
            raise ValueError(
                f"learner.gradient_checkpointing=true with learner.routing_replay={self.routing_replay!r}: the "
                "backward recomputes "
                "each checkpointed layer's forward outside the router tap's capture, so the recomputed layers "
                "would route with the router's own choice instead of the replayed experts (a gradient of a "
                "different forward); turn one of them off"
            )
        return self

    def monitor_at(self, index: int) -> bool:
        """Whether the mismatch monitor's pass is due on the 0-based rollout batch (or RL step) ``index``:
        ``pre_update_pass='auto'``, ``mismatch_monitor_every`` N > 0 and ``index`` a multiple of N (the first
        one included)."""
        every = self.mismatch_monitor_every
        return self.pre_update_pass == "auto" and every > 0 and index % every == 0

    def gap_check_at(self, index: int) -> bool:
        """Whether ``old_logprob_source='auto'`` checks the engine/learner gap on the 0-based RL step ``index``:
        the mismatch monitor's steps (``index`` a multiple of ``mismatch_monitor_every`` N > 0, the first one
        included), under ``pre_update_pass`` ``auto`` or ``always`` (``never`` runs no pass to measure it)."""
        every = self.mismatch_monitor_every
        return (self.old_logprob_source == "auto" and self.pre_update_pass != "never" and every > 0
                and index % every == 0)

    def pre_update_pass_needs(self, guard: dict | None, is_moe: bool = True) -> list[str]:
        """The settings that need the pre-update pass, as config keys (``[]`` when nothing does).

        Args:
            guard: the health guard's threshold dict (``learner.health``; None = guard off): its keys
                ``max_logprob_diff``, ``min_entropy`` and ``max_load_imbalance`` check pre-update metrics and
                are reported as ``health.<key>``.
            is_moe: whether the model has expert routers (``moe_diagnostics`` and ``max_load_imbalance`` need
                the pass only then; unknown at config load, so True there).
        """
        needs = []
        if self.old_logprob_source == "recompute":
            needs.append("learner.old_logprob_source='recompute'")
        if self.routing_replay != "off":
            needs.append(f"learner.routing_replay={self.routing_replay!r}")
        if self.rollout_correction != "off":
            needs.append(f"learner.rollout_correction={self.rollout_correction!r}")
        if self.moe_diagnostics and is_moe:
            needs.append("learner.moe_diagnostics=true")
        for key in PRE_UPDATE_GUARD_KEYS:
            if guard and key in guard and (is_moe or key != "max_load_imbalance"):
                needs.append(f"health.{key}")
        return needs


class WarmStartConfig(Section):
    """Supervised warm start (cold-start fine-tuning in miniature) run by the learner before RL."""

    steps: int = Field(0, ge=0, description="SFT optimizer steps before RL (0 = none)")
    batch_size: int = Field(64, ge=1, description="sequences per SFT step (all ranks together)")
    lr: float = Field(1e-3, gt=0, description="SFT learning rate (AdamW)")
    warmup_steps: int = Field(0, ge=0, description="SFT steps of linear learning-rate warm-up (0 = none)")
