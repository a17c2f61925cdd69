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
``learner.moe`` (routing diagnostics, Routing Replay). This module is the Ray-facing call surface.
"""

from __future__ import annotations

import datetime
import gc
import importlib
import os
from typing import Any

import torch

from learner import checkpoint, lora, state, weight_sync
from learner.config import LearnerConfig, WarmStartConfig
from learner.contracts import SFTBatch, SyncReport, TrainBatch
from learner.critic import Critic
from learner.moe import RouterTap, find_routers
from learner.objectives import resolve_objective
from learner.replica import Replica
from learner.step import RolloutBatchStep, sft_step


def learner_device(cfg: LearnerConfig) -> str:
    """The learner's device type from the config alone: ``"cuda"`` when each rank holds a GPU
    (``learner.num_gpus_per_rank > 0``), ``"cpu"`` otherwise. The environment does not decide it: a
    ``DS_ACCELERATOR=cpu`` inherited from a CPU default (a Makefile, a shell) must not move a GPU run's learner
    to the CPU; ``LearnerRank`` sets ``DS_ACCELERATOR`` from this value."""
    return "cuda" if cfg.num_gpus_per_rank > 0 else "cpu"


def _select_accelerator(device: str) -> None:
    """Point DeepSpeed's accelerator at ``device`` (``DS_ACCELERATOR``, read at its first use in the process).

    Raises:
        RuntimeError: ``device`` is ``"cuda"`` but torch sees no CUDA device, or DeepSpeed's accelerator was
            already chosen for another device in this process.
    """
    from deepspeed.accelerator import real_accelerator

    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("learner.num_gpus_per_rank > 0 but this learner process sees no CUDA device "
                           f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    os.environ["DS_ACCELERATOR"] = device
    chosen = real_accelerator.ds_accelerator
    if chosen is not None and chosen.device_name() != device:
        raise RuntimeError(f"DeepSpeed's accelerator in this process is already {chosen.device_name()!r}; the "
                           f"learner config asks for {device!r}")


def _init_distributed(cfg: LearnerConfig, rank: int, world_size: int, local_rank: int, master_addr: str,
                      master_port: int) -> None:
    """Environment for torch.distributed, the DeepSpeed accelerator, and the process group (gloo on the CPU,
    NCCL on GPUs: ``learner_device``)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    on_gpu = learner_device(cfg) == "cuda"

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
        LOCAL_SIZE=os.environ.get("LOCAL_SIZE", str(world_size)),
        MASTER_ADDR=str(master_addr), MASTER_PORT=str(master_port),
    )
    torch.set_num_threads(cfg.threads_per_rank)
    if on_gpu:
        get_accelerator().set_device(local_rank)
    elif not cfg.cpu_shm_allreduce:
        # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op at every init_distributed
        # that finds no valid build cache (30 s idle, minutes on a busy machine); plain gloo is as fast
        # for the tensors of a tiny model. Opt back in with learner.cpu_shm_allreduce=true.
        # (importlib: `import deepspeed.comm.torch as m` binds the real torch, an attribute of deepspeed.comm)
        ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
        ds_torch_comm.build_shm_op = lambda: None
    deepspeed.init_distributed(
        dist_backend="nccl" if on_gpu else "gloo",
        auto_mpi_discovery=False,
        verbose=False,
        timeout=datetime.timedelta(seconds=cfg.dist_timeout_s),
        rank=rank,
        world_size=world_size,
    )


def build_partitioned(cfg: LearnerConfig, on_gpu: bool) -> bool:
    """Whether a rank builds its model partitioned (``HfDeepSpeedConfig`` before ``from_pretrained``, i.e. under
    ``deepspeed.zero.Init``): ZeRO-3 on GPUs. The CPU runs keep their full-copy build (their numbers are
    unchanged; a tiny model's copy costs nothing)."""
    return cfg.zero_stage == 3 and on_gpu


def param_groups(model: torch.nn.Module, cfg: LearnerConfig) -> list[dict]:
    """The optimizer's parameter groups: everything trainable at ``learner.lr`` and, when
    ``learner.router_lr_scale != 1`` on an MoE model, the expert routers' parameters in a second group with
    ``lr = learner.lr x router_lr_scale`` (``lr_scale`` kept in the group for ``set_lr``). One group otherwise,
    exactly as before the key existed.

    Raises:
        ValueError: ``router_lr_scale != 1`` on a model without expert routers.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.router_lr_scale == 1.0:
        return [{"params": params, "lr_scale": 1.0}]
    routers = {id(p) for _, _, m in find_routers(model) for p in m.parameters() if p.requires_grad}
    if not routers:
        raise ValueError(f"learner.router_lr_scale={cfg.router_lr_scale} needs an MoE model (no expert router found)")
    return [{"params": [p for p in params if id(p) not in routers], "lr_scale": 1.0},
            {"params": [p for p in params if id(p) in routers], "lr": cfg.lr * cfg.router_lr_scale,
             "lr_scale": cfg.router_lr_scale}]


def build_optimizer(model: torch.nn.Module, cfg: LearnerConfig) -> torch.optim.Optimizer:
    """The client optimizer handed to ``deepspeed.initialize``: AdamW over ``param_groups(model, cfg)`` at
    ``learner.lr``, ``adam_betas``, ``weight_decay`` (eps 1e-8 in both). ``offload_optimizer='none'``: torch's
    AdamW (``fused`` per ``learner.fused_optimizer``); ``'cpu'``: DeepSpeed's CPU Adam in AdamW mode (decoupled
    weight decay), the optimizer DeepSpeed requires next to ZeRO-Offload (``zero_force_ds_cpu_optimizer``).

    Raises:
        ValueError: ``router_lr_scale != 1`` on a model without expert routers (``param_groups``).
        RuntimeError: DeepSpeed's ``cpu_adam`` op fails to build or load (it is JIT-compiled with the C++
            toolchain on first use and cached under ``~/.cache/torch_extensions``).
    """
    groups = param_groups(model, cfg)
    if cfg.offload_optimizer == "cpu":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=cfg.lr, betas=tuple(cfg.adam_betas), weight_decay=cfg.weight_decay,
                                adamw_mode=True)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.adam_betas), weight_decay=cfg.weight_decay,
                             fused=cfg.fused_optimizer or None)


def _keep_checkpointing_on(model: torch.nn.Module) -> int:
    """Put the checkpointed decoder layers of an ``eval()`` model back in training mode, and only them.

    transformers checkpoints a layer when ``layer.gradient_checkpointing and layer.training``
    (``GradientCheckpointingLayer.__call__``), so an eval-mode model never checkpoints. Setting the flag of
    those layer modules alone (not ``train()``, which recurses) turns checkpointing back on while every other
    module, the attention and any dropout included, stays in eval mode: no dropout, the same policy as the
    pre-update and reference passes. Under ``torch.no_grad`` the checkpoint wrapper stores nothing.

    Returns:
        The number of layers switched (0 when the model has no checkpointed layer).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    for layer in layers:
        layer.training = True
    return len(layers)


def _build_replica(model_path: str, cfg: LearnerConfig, rank: int, world_size: int, temperature: float,
                   partitioned: bool, weights: dict[str, torch.Tensor] | None = None) -> Replica:
    """The policy under DeepSpeed (``build_optimizer``'s AdamW, the config's ZeRO stage and offload), the reference
    model when ``kl_coef > 0`` and the MoE router tap, wrapped as this rank's ``Replica``. ``partitioned``: build
    the model under ``deepspeed.zero.Init`` (ZeRO-3 only). ``weights`` (full tensors by transformers name): the
    policy starts from them instead of the folder's, wrapped with ``learner.lora``'s adapter (``enable_lora``)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from transformers import AutoModelForCausalLM

    from learner.ds_config import build_ds_config

    device = torch.device(get_accelerator().current_device_name())
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    ds_config = build_ds_config(cfg, world_size, on_gpu=learner_device(cfg) == "cuda", policy=True)
    # ZeRO-3 on GPUs: the model is built partitioned (HfDeepSpeedConfig makes from_pretrained run under
    # deepspeed.zero.Init and load the checkpoint shard by shard), not one full copy per rank in host RAM.
    if partitioned:
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds = HfDeepSpeedConfig(ds_config)  # noqa: F841 - transformers holds a weak reference while it is alive
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model.config.use_cache = False
    if weights is not None:
        model = lora.start_from(model, weights, cfg.lora)
    if cfg.routing_replay != "off" and not find_routers(model):
        raise ValueError(f"learner.routing_replay={cfg.routing_replay!r} needs an MoE model; {model_path!r} has no "
                         "expert router")
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=build_optimizer(model, cfg), config=ds_config, dist_init_required=False
    )
    if partitioned:
        del hf_ds
    engine.eval()  # no dropout anywhere: training, recompute and reference passes see one policy
    if world_size == 1 and cfg.zero_stage == 0:
        # one rank has nothing to all-reduce; DeepSpeed would still flatten and copy every gradient per step
        engine.enable_backward_allreduce = False
    if cfg.gradient_checkpointing:
        _keep_checkpointing_on(engine.module)
    ref_model = None
    if cfg.kl_coef > 0:
        ref_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
        ref_model.config.use_cache = False
        ref_model.eval().requires_grad_(False)
    # MoE: forward hooks on the routers (expert load, routing volatility, Routing Replay); None if dense.
    tap = None
    if cfg.routing_replay != "off" or cfg.moe_diagnostics:
        tap = RouterTap(engine.module)
        if not tap.is_moe:
            tap.remove()
            tap = None
    if cfg.routing_replay != "off" and (tap is None or not tap.can_replay):
        raise ValueError(f"learner.routing_replay={cfg.routing_replay!r}: the routers of {model_path!r} do not "
                         "support replay")
    return Replica(engine, cfg, rank=rank, world_size=world_size, device=device, temperature=temperature,
                   ref_model=ref_model, tap=tap)


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
            ZeRO-3 on GPUs; True on the CPU exercises the GPU's ZeRO-3 start there, ``cluster.tools.gpu_learner_check``).

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
        _select_accelerator(self.device_type)
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
        self.objective = resolve_objective(cfg.algorithm, cfg.clip_low, cfg.clip_high, cfg.loss_agg, cfg.loss_options)
        _init_distributed(cfg, rank, world_size, local_rank, master_addr, master_port)
        checkpoint.seed_all(seed)
        self.partitioned_build = bool(partitioned_build)
        self.replica = _build_replica(self.model_path, cfg, rank, world_size, self.temperature, partitioned_build)
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
        self.replica = _build_replica(self.model_path, self.cfg, self.rank, self.world_size, self.temperature,
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
    ) -> dict[str, Any]:
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

        Returns:
            The same dict on every rank, aggregated exactly over micro-batches, minibatches, epochs and ranks:
            ``loss/policy`` (and ``loss/kl`` when ``kl_coef > 0``): mean over optimizer steps of the
            minibatch loss; ``actor/clip_fraction`` (``_low``, ``_high``): share of sequences (GSPO) or tokens
            (GRPO) clipped; ``actor/ratio_mean|min|max``: the importance ratios the objective used;
            ``actor/seq_ratio_mean|min|max``: GSPO's sequence ratio ``s_i`` (Eq. 7) for every algorithm;
            ``actor/entropy`` (pre-update pass only: absent when ``learner.pre_update_pass`` skips it, as are
            the train-rollout difference and every ``moe/*`` metric): mean token entropy (nats) of the pre-update
            policy over the response tokens;
            ``actor/train_rollout_logprob_diff``: mean |learner log-prob at the pre-update weights - rollout
            log-prob| over response tokens; ``actor/grad_norm`` (mean over steps, pre-clip) and
            ``actor/grad_norm_max``; ``actor/lr``; ``actor/num_optimizer_steps`` (steps applied: 0 when the
            guard skipped the update). Values are those of the steps that ran (0 steps: loss 0, ratios 1).
            ``actor/by_response_length``: ``{response length (tokens): [sequences, sum of s_i, clipped units,
            units]}`` summed over the optimizer steps (units as in the clip fraction), for metrics sliced by
            length (``cluster.driver.length_slices``).

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
        out = RolloutBatchStep(self.replica, minibatches, num_sequences, num_tokens, guard, self.objective,
                               self.critic, monitor).run()
        self.weights_changed |= not out.get("health/skipped")  # a refused update put the weights back
        return out

    def sft_step(self, batch: SFTBatch, num_tokens: int) -> dict[str, float]:
        """One optimizer step of token-mean cross-entropy on ``batch`` (this rank's shard).

        ``loss = -(1/num_tokens) sum_{loss tokens} log p(token)`` at temperature 1, with ``num_tokens`` the loss
        tokens of the step over all ranks, so the micro-batch and rank parts sum to the whole batch's loss
        (same exact scaling as ``train_rollout_batch``). Collective.

        Returns:
            ``{"loss/sft": loss of the whole step (all ranks), "grad_norm": pre-clip global norm, "lr": lr}``.

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
