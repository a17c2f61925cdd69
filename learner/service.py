"""The learner service: one DeepSpeed data-parallel rank that trains the policy with the algorithm core.

``LearnerRank`` is a plain class; the driver wraps it with ``ray.remote(LearnerRank).options(...)`` and starts
one instance per rank, each in its own process. All ranks receive the same calls in the same order (their own
shard of the data); most methods are collective (they communicate with the other ranks) and must be called on
every rank.

Exact gradient accumulation. A rollout batch is cut by the driver into minibatches; each rank gets its shard
of every minibatch plus the minibatch's global normalisers (sequences and response tokens over all ranks).
Every micro-batch's loss is computed by ``learner.objectives.policy_loss`` with those global normalisers, so
the micro-batch losses of all ranks SUM to the whole minibatch's loss. DeepSpeed's own scaling is then undone
exactly (DeepSpeed 0.19.8 source, ``deepspeed/runtime/engine.py`` and ``zero/stage_1_and_2.py``):

- ``gradient_accumulation_steps`` is 1 in the DeepSpeed config and ``engine.backward(..., scale_wrt_gas=False)``
  is used, so no loss or gradient is divided by an accumulation count; the accumulation boundary is set
  explicitly (``set_gradient_accumulation_boundary``) on the last micro-batch of a minibatch, and
  ``engine.step()`` runs once per minibatch.
- every ZeRO stage (and stage 0's ``allreduce_bucket``) AVERAGES the gradients over the data-parallel ranks
  (multiplies the all-reduced sum by ``1 / dp_world_size``); each micro-batch loss is therefore multiplied by
  ``world_size`` before ``backward``, which turns the average back into the sum.

The parts, each readable alone: ``learner.replica`` (this rank's engine: collectives, forwards, optimizer
step, exact snapshot/restore), ``learner.step`` (the RL update in named phases, and the SFT step),
``learner.health`` (the guard's checks and its decision), ``learner.state`` (full parameters, snapshot and
restore, digests), ``learner.checkpoint`` (save and load), ``learner.weight_sync`` (weights for the engines),
``learner.moe`` (routing diagnostics, Routing Replay), ``learner.rank_setup`` (building a rank). This module is
the Ray-facing call surface.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import torch

from learner import checkpoint, lora, state, weight_sync
from learner.config import LearnerConfig, WarmStartConfig
from learner.contracts import RolloutTrainResult, SFTBatch, SFTStepResult, SyncReport, TrainBatch
from learner.critic import Critic
from learner.objectives import resolve_objective
from learner.rank_setup import build_partitioned, build_replica, init_distributed, learner_device, select_accelerator
from learner.step import RolloutBatchStep, sft_step


class LearnerRank:
    """One data-parallel DeepSpeed rank of the learner (plain class; the driver makes it a Ray actor).

    Args:
        model_path: Hugging Face model folder (weights, config, tokenizer).
        cfg: the ``learner`` config section.
        rank, world_size: this rank and the number of data-parallel ranks.
        master_addr, master_port: rendezvous of the process group (bind address of rank 0); ``master_port=0``
            lets a single rank's store bind any free port itself (nothing can take it between probe and bind).
        seed: seeds Python, NumPy and torch on this rank.
        temperature: the rollout sampling temperature (> 0); log-probs are computed from
            ``logits / temperature``, the distribution the engines sampled from.
        warm_start: the ``warm_start`` section (kept for reference; the driver sets its learning rates with
            ``set_lr``).
        local_rank: device index on this node (None: ``rank`` on the CPU, 0 on a GPU, where Ray shows each
            rank one device).
        partitioned_build: build the model under ``deepspeed.zero.Init`` (None: ``build_partitioned``, i.e.
            ZeRO-3 on GPUs; True on the CPU exercises the GPU's ZeRO-3 start there,
            ``cluster.tools.gpu_learner_check``).

    The device comes from the config (``learner_device``: GPUs when ``learner.num_gpus_per_rank > 0``), never
    from the environment's ``DS_ACCELERATOR``.

    Raises:
        ValueError: ``rank`` outside ``[0, world_size)``, ``temperature <= 0``, or ``partitioned_build`` without
            ZeRO-3.
        RuntimeError: a GPU learner in a process that sees no CUDA device.
    """

    def __init__(
        self,
        model_path: str,
        cfg: LearnerConfig,
        *,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        seed: int,
        temperature: float,
        warm_start: WarmStartConfig | None = None,
        local_rank: int | None = None,
        partitioned_build: bool | None = None,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank!r} must be in [0, world_size={world_size!r})")
        if not temperature > 0:
            raise ValueError(f"temperature={temperature!r} must be > 0")
        if partitioned_build and cfg.zero_stage != 3:
            raise ValueError(f"partitioned_build=True needs learner.zero_stage=3 (got {cfg.zero_stage})")
        self.device_type = learner_device(cfg)
        select_accelerator(self.device_type)
        if local_rank is None:
            local_rank = 0 if self.device_type == "cuda" else rank
        if partitioned_build is None:
            partitioned_build = build_partitioned(cfg, self.device_type == "cuda")
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.temperature = float(temperature)
        self.warm_start = warm_start
        self.model_path = str(model_path)
        self.zero3 = cfg.zero_stage == 3
        # rank 0's collective weight-transfer group with the engines (sync.transport=collective), kept across syncs
        self.transfer_group: weight_sync.TransferGroup | None = None
        self.synced_version, self.weights_changed = 0, False  # the weights' version for the engines: current_version
        self.trained_turns: list[tuple[int, int, str]] = []  # the last rollout batch's, for take_trained_turns
        self.objective = resolve_objective(cfg.algorithm, cfg.clip_low, cfg.clip_high, cfg.loss_agg, cfg.loss_options)
        init_distributed(cfg, rank, world_size, local_rank, master_addr, master_port)
        checkpoint.seed_all(seed)
        self.partitioned_build = bool(partitioned_build)
        self.replica = build_replica(self.model_path, cfg, rank, world_size, self.temperature, partitioned_build)
        self.engine = self.replica.engine
        self.ref_model = self.replica.ref_model
        # PPO's value model (learner/critic.py): a second DeepSpeed engine on this rank, built at its first use
        self.critic = Critic(cfg, world_size, self.replica.device) if cfg.algorithm == "ppo" else None

    def enable_lora(self) -> bool:
        """Switch this rank to LoRA RL (``learner.lora``, ``learner/lora.py``): the current weights (after any warm
        start) become the frozen base, a fresh peft adapter and a fresh optimizer over it alone replace the
        DeepSpeed engine. Collective (the weights are gathered under ZeRO-3). Idempotent.

        Returns:
            True when the switch happened now; False when LoRA is off or already on.
        """
        if not lora.enabled(self.cfg.lora) or lora.is_peft(self.engine.module):
            return False
        weights = {n: t for n, t in state.full_params(self.engine, self.zero3, keep=True)}
        old, self.replica = self.replica, None
        if old.tap is not None:
            old.tap.remove()
        del old
        self.engine = self.ref_model = None
        gc.collect()  # the old engine's flat fp32 partitions and optimizer state before the new one is built
        self.replica = build_replica(self.model_path, self.cfg, self.rank, self.world_size, self.temperature,
                                      self.partitioned_build, weights=weights)
        self.engine = self.replica.engine
        self.ref_model = self.replica.ref_model
        return True

    def lora_enabled(self) -> bool:
        """Whether this rank trains a LoRA adapter now (after ``enable_lora``)."""
        return lora.is_peft(self.engine.module)

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps applied by this rank since it started (restored by ``load_checkpoint``)."""
        return self.replica.optimizer_steps

    @optimizer_steps.setter
    def optimizer_steps(self, value: int) -> None:
        self.replica.optimizer_steps = int(value)

    # ---------------------------------------------------------------------------------------------------
    # training

    def train_rollout_batch(
        self,
        minibatches: list[TrainBatch],
        num_sequences: list[int],
        num_tokens: list[int],
        *,
        guard: dict[str, float] | None = None,
        monitor: bool | None = None,
        behaviour: str | None = None,
    ) -> RolloutTrainResult:
        """Train on one rollout batch: ``cfg.ppo_epochs`` passes over the minibatches, one optimizer step each.

        Collective: every rank calls it with its own shard of the same minibatches (and the same ``guard``).

        Args:
            minibatches: ``minibatches[m]`` is this rank's part of minibatch ``m`` (``TrainBatch``, right padded).
            num_sequences: ``num_sequences[m]``: sequences of minibatch ``m`` over all ranks (the GSPO
                normaliser; ``learner.objectives.loss_normalisers`` counts those with response tokens).
            num_tokens: ``num_tokens[m]``: response tokens of minibatch ``m`` over all ranks.
            guard: health guard (``learner.health``): None = off; a dict of optional thresholds
                ``max_grad_norm``, ``max_clip_fraction``, ``max_logprob_diff``, ``min_entropy``,
                ``max_load_imbalance`` (an empty dict checks only for non-finite values). When a check fails
                the whole step's update is skipped: weights, optimizer state (moments, step counts, DeepSpeed's
                fp32 partitions) and step counters end bit-identical to before the call, on every rank.
                Checks on the pre-update pass (log-prob difference, entropy, load imbalance, non-finite
                log-probs) refuse before any optimizer step; the others are decided after the optimizer steps
                (training stops at the first step whose loss or grad norm fails) and the state is restored
                from an in-memory copy taken at the start (CPU memory: one copy of this rank's parameters,
                fp32 master partition and optimizer state).
            monitor: whether the mismatch monitor's pre-update pass runs on this batch (``learner.
                mismatch_monitor_every`` > 0 with ``pre_update_pass='auto'``; the driver decides by RL step);
                None = every N-th batch this rank has trained. The same on every rank.
            behaviour: where this step's behaviour log-probs come from (``learner.old_logprobs``): ``rollout``
                (the engine's), ``recompute`` (the pre-update pass's) or ``check`` (``old_logprob_source='auto'``
                on a check step: the pass runs over the whole batch first, unfused, and the gap against
                ``learner.max_rollout_logprob_gap`` picks one of the two for this step); the driver decides by
                RL step and its checkpointed switch. None = ``learner.old_logprob_source``, ``auto`` as
                ``rollout``. The same on every rank.

        Returns:
            A ``RolloutTrainResult``, the same on every rank: its typed fields (loss, optimizer steps, grad norm,
            the guard's verdict, the per-length sums) and, in its ``metrics``, the logged metrics below,
            aggregated exactly over micro-batches, minibatches, epochs and ranks: ``loss/policy`` (and
            ``loss/kl`` when ``kl_coef > 0``): mean over optimizer steps of the minibatch loss;
            ``actor/clip_fraction`` (``_low``, ``_high``): share of sequences (GSPO) or tokens
            (GRPO) clipped; ``actor/ratio_mean|min|max``: the importance ratios the objective used;
            ``actor/seq_ratio_mean|min|max``: GSPO's sequence ratio ``s_i`` (Eq. 7) for every algorithm;
            ``actor/entropy`` (pre-update pass only: absent when ``learner.pre_update_pass`` skips it, as are
            the train-rollout difference and every ``moe/*`` metric): mean token entropy (nats) of the pre-update
            policy over the response tokens;
            ``actor/train_rollout_logprob_diff``: mean |learner log-prob at the pre-update weights - rollout
            log-prob| over response tokens; ``actor/grad_norm`` (mean over steps, pre-clip) and
            ``actor/grad_norm_max``; ``actor/lr``; ``actor/num_optimizer_steps`` (steps applied: 0 when the
            guard skipped the update); ``actor/old_logprob_recomputed``: 1.0 when the objective took the
            learner's recomputed behaviour log-probs, 0.0 the engine's; on a check step ``actor/old_logprob_gap``:
            the gap (nats per token) that decided it, over the rows sampled wholly by the weights this rank holds
            (``current_version``), and ``actor/old_logprob_gap_tokens``, their response tokens. Values are those of the steps that ran (0 steps: loss 0, ratios 1).
            ``loss/policy_minibatches``: the loss of each optimizer step (a list). The per-length sums for
            metrics sliced by length are the result's ``by_response_length``, not a metric.

            MoE models (``cfg.moe_diagnostics``), see ``_moe_metrics``: ``moe/load_imbalance``,
            ``moe/load_imbalance_max``, ``moe/load_cv``, ``moe/layer{L}/load_imbalance``, ``moe/expert_load``
            (list of lists, layers x experts, shares), ``moe/routing_volatility``,
            ``moe/routing_volatility_per_update``, ``moe/routing_volatility_unreplayed``,
            ``moe/routing_volatility_passes``.

            With a guard: ``health/skipped`` (0.0 or 1.0), ``health/failed_checks`` (comma-joined check names,
            ``""`` when none), ``health/reasons`` (``"; "``-joined ``name: metric=value > limit``),
            ``health/steps_undone`` (optimizer steps that ran and were rolled back),
            ``health/nonfinite_log_probs`` (count of non-finite learner or rollout log-probs on response
            tokens).

        Raises:
            ValueError: inconsistent list lengths, normalisers that do not match the data, a response mask
                on padding, or an invalid guard.
        """
        if self.critic is not None:
            self.critic.ensure_built(self.engine, self.zero3)
        step = RolloutBatchStep(self.replica, minibatches, num_sequences, num_tokens, guard, self.objective,
                                self.critic, monitor, behaviour, self.current_version())
        result = step.run()
        self.trained_turns = step.trained_turns
        self.weights_changed |= not result.skipped  # a refused update put the weights back
        return result

    def take_trained_turns(self) -> list[tuple[int, int, str]]:
        """The sampled turns this rank trained in its last ``train_rollout_batch`` (its first epoch, as its
        micro-batches held them), for the token check: ``(context_len, sampled_len, digest)`` per turn
        (``learner.token_digests.trained_turn_digests``); empty when no optimizer step ran. Cleared by the call.
        Not collective."""
        out, self.trained_turns = self.trained_turns, []
        return out

    def sft_step(self, batch: SFTBatch, num_tokens: int) -> SFTStepResult:
        """One optimizer step of token-mean cross-entropy on ``batch`` (this rank's shard).

        ``loss = -(1/num_tokens) sum_{loss tokens} log p(token)`` at temperature 1, with ``num_tokens`` the loss
        tokens of the step over all ranks, so the micro-batch and rank parts sum to the whole batch's loss
        (same exact scaling as ``train_rollout_batch``). Collective.

        Returns:
            ``SFTStepResult``: the loss of the whole step (all ranks, nats per loss token), the pre-clip global
            gradient norm, the lr and ``num_tokens``.

        Raises:
            ValueError: ``num_tokens`` differs from the loss tokens over all ranks, or a loss mask on padding.
        """
        out = sft_step(self.replica, batch, num_tokens)
        self.weights_changed = True
        return out

    def set_lr(self, lr: float, scaled: bool = True) -> None:
        """Set the learning rate of every parameter group, times the group's ``lr_scale`` (the routers'
        ``learner.router_lr_scale``) when ``scaled`` (RL; the warm start passes False); takes effect at the
        next optimizer step.

        Raises:
            ValueError: ``lr`` not a finite number > 0.
        """
        import math

        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"lr={lr!r} must be a finite number > 0")
        for group in self.replica.base_optimizer().param_groups:
            group["lr"] = float(lr) * (group.get("lr_scale", 1.0) if scaled else 1.0)
        for group in getattr(self.engine.optimizer, "param_groups", []):
            group["lr"] = float(lr) * (group.get("lr_scale", 1.0) if scaled else 1.0)

    def get_lr(self) -> float:
        """The learning rate of the first parameter group (the non-router parameters)."""
        return float(self.replica.base_optimizer().param_groups[0]["lr"])

    def reset_optimizer_state(self) -> None:
        """Forget AdamW's moments and step counts (between the warm start and RL); weights are unchanged."""
        self.replica.base_optimizer().state.clear()
        self.engine.optimizer.zero_grad()

    def capture_gradients(self, enabled: bool = True) -> None:
        """Debug/verification hook: when enabled, every optimizer step first records the full (all-rank,
        pre-clip) gradient of every parameter, readable with ``captured_gradients`` (collective while on)."""
        self.replica.capture = {} if enabled else None

    def captured_gradients(self) -> list[dict[str, torch.Tensor]]:
        """The gradients recorded by ``capture_gradients``, one dict (HF names -> float32 CPU tensor) per
        optimizer step since it was enabled."""
        return list((self.replica.capture or {}).get("steps", []))

    # ---------------------------------------------------------------------------------------------------
    # log-probs, weights, digests

    def compute_log_probs(self, batch: TrainBatch) -> torch.Tensor:
        """Log-probs of the target tokens at the current weights, from ``logits / temperature``.

        Collective under ZeRO-3 (parameters are gathered during the forward); local otherwise.

        Returns:
            float32 ``[N, L-1]`` on the CPU, 0 outside ``batch.response_mask``.
        """
        out = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
        micros, lps, _ = self.replica.inference_pass(batch, collective=self.zero3)
        for mb, lp in zip(micros, lps):
            lo, hi = mb.rows
            out[lo:hi, : mb.width - 1] = lp.float().cpu()
        return out

    def sync_weights(self, engines: list, version: int | None, bucket_mb: float = 64.0, max_in_flight: int = 2,
                     engine_timeout_s: float | None = None, transport: str = "object_store",
                     defer: bool = False) -> SyncReport | None:
        """Stream the current weights to the rollout engines (``learner.weight_sync.sync_weights``) through
        ``transport`` (``object_store`` or ``collective``); with ``defer`` return once every bucket is put, the
        engines' last calls in the report's ``pending``. ``version`` None: this rank's ``current_version`` (a
        sync queued behind a training step sends its result). Collective; rank 0 returns the ``SyncReport``.

        Raises:
            ValueError: ``bucket_mb`` not > 0, ``max_in_flight`` < 1, an unknown ``transport`` or ``defer`` with
                the collective transport.
        """
        version = self.current_version() if version is None else int(version)
        report = weight_sync.sync_weights(self, engines, version, bucket_mb, max_in_flight, engine_timeout_s,
                                          transport, defer)
        self.synced_version, self.weights_changed = version, False
        if report is not None:
            report.version = version
        return report

    def current_version(self) -> int:
        """The last synced version, plus 1 when an applied update, a warm-start step or a checkpoint load changed
        the weights since (the driver syncs each change as the next version: ``cluster.driver.trainer``)."""
        return self.synced_version + int(self.weights_changed)

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights in checkpoint names (CPU copies) on rank 0, ``{}`` on the others. Collective."""
        return weight_sync.checkpoint_state_dict(self)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every full parameter and persistent buffer (transformers names, CPU copies). Collective."""
        return {n: t for n, t in state.full_params(self.engine, self.zero3, keep=True)}

    def state_checksum(self) -> float:
        """Sum of all parameters in float64 (full, gathered under ZeRO-3); the same on every rank. Collective."""
        return sum(float(t.double().sum()) for _, t in state.full_params(self.engine, self.zero3, keep=True))

    def state_digest(self) -> str:
        """SHA-256 of every full parameter's bytes, in order: equal digests mean bit-identical weights.
        Collective."""
        return state.weights_digest(state.full_params(self.engine, self.zero3, keep=True))

    def optimizer_state_digest(self) -> str:
        """SHA-256 of this rank's optimizer state (``learner.state.optimizer_state_digest``). Local."""
        return state.optimizer_state_digest(self.engine)

    def local_param_fraction(self) -> float:
        """Share of the model's parameter elements held locally (about 1 / world_size under ZeRO-3). Local."""
        return state.local_param_fraction(self.engine)

    # ---------------------------------------------------------------------------------------------------
    # checkpoints and process

    def save_checkpoint(self, path: str) -> None:
        """Write what resuming needs into ``path`` (``learner.checkpoint`` gives the layout). Collective; the
        driver renames the folder atomically."""
        checkpoint.save(self, path)
        if self.critic is not None:
            self.critic.ensure_built(self.engine, self.zero3)
            self.critic.save(path)

    def load_checkpoint(self, path: str) -> None:
        """Restore weights, optimizer state, lr and this rank's RNG states from ``save_checkpoint``'s folder.
        Collective.

        Raises:
            FileNotFoundError: ``path`` holds no learner checkpoint.
        """
        checkpoint.load(self, path)
        self.weights_changed = True
        if self.critic is not None:
            self.critic.ensure_built(self.engine, self.zero3)
            self.critic.load(path)

    def critic_digest(self) -> dict[str, Any] | None:
        """PPO: digests of the critic's weights (collective under ZeRO-3) and this rank's optimizer state, with
        its counters (``learner.critic.Critic.digest``); None without a critic or before its first use."""
        if self.critic is None or self.critic.engine is None:
            return None
        return self.critic.digest(self.zero3)

    def devices(self) -> dict[str, Any]:
        """Where this rank's training state lives (``learner.state.device_report``), and the process group's
        backend and whether the model was built partitioned: ``{"params": [...], "master": [...],
        "optimizer_state": [...], "backend": "nccl" | "gloo", "partitioned_build": bool}``."""
        import torch.distributed as dist

        return {**state.device_report(self.engine), "backend": dist.get_backend() if dist.is_initialized() else None,
                "partitioned_build": self.partitioned_build}

    def pid(self) -> int:
        """This rank's process id."""
        return os.getpid()

    def shutdown(self) -> None:
        """Leave the weight-transfer group (rank 0, ``sync.transport=collective``) and the process group (the
        process itself is ended by its owner)."""
        import torch.distributed as dist

        group, self.transfer_group = self.transfer_group, None
        if group is not None:
            group.close()

        if dist.is_initialized():
            dist.destroy_process_group()
