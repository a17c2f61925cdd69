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

Ranks must run the same number of forward/backward passes (ZeRO-2 reduces and ZeRO-3 gathers inside them), so
a rank with fewer micro-batches in a minibatch runs zero-weighted passes on a dummy input to keep step.

MoE models (``learner.moe``): forward hooks on the routers record, in the pre-update pass that runs anyway,
the experts every token is routed to; from them come the expert-load metrics, the routing volatility of the
later training forwards, and (``learner.routing_replay``) the experts replayed in those forwards.

Health guard (``train_rollout_batch(..., guard=...)``, checks in ``learner.health``): every decision is taken
from all-reduced values, so all ranks skip or apply a step together; a skipped step leaves weights and optimizer
state bit-identical (in-memory CPU snapshot taken before the first optimizer step, restored on failure).
"""

from __future__ import annotations

import copy
import datetime
import importlib
import hashlib
import json
import logging
import math
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from cluster.contracts import SFTBatch, TrainBatch
from learner.config import LearnerConfig, WarmStartConfig
from learner.health import GUARD_CHECKS, failed_checks, validate_guard
from learner.logprobs import entropy_from_logits, token_log_probs
from learner.moe import RouterTap, expert_counts, find_routers, load_statistics, response_positions, topk_set_changes
from learner.objectives import (
    LOG_RATIO_CLAMP,
    combine_policy_metrics,
    kl_penalty,
    loss_normalisers,
    policy_loss,
    resolve_objective,
    sequence_log_ratio,
)

log = logging.getLogger(__name__)

DS_TAG = "deepspeed"  # tag of the DeepSpeed checkpoint folder inside a learner checkpoint
HF_SUBDIR = "hf"
RNG_SUBDIR = "rng"
STATE_FILE = "learner_state.json"
# Files of a Hugging Face model folder that belong to the tokenizer (copied next to the saved weights).
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


_EMPTY_POLICY_METRICS = {
    "clip_fraction": 0.0, "clip_fraction_low": 0.0, "clip_fraction_high": 0.0, "ratio_mean": 1.0,
    "ratio_min": 1.0, "ratio_max": 1.0, "log_ratio_abs_max": 0.0, "num_tokens": 0.0,
}


def _batch_problem(batch: TrainBatch, name: str) -> str | None:
    """Why ``batch`` cannot be trained on (shapes, dtypes, a response mask on padding), or None."""
    n, length = tuple(batch.input_ids.shape) if batch.input_ids.dim() == 2 else (-1, -1)
    if n < 0:
        return f"{name}.input_ids must be [N, L], got shape {tuple(batch.input_ids.shape)}"
    checks = [
        ("attention_mask", batch.attention_mask, (n, length)),
        ("response_mask", batch.response_mask, (n, length - 1)),
        ("old_log_probs", batch.old_log_probs, (n, length - 1)),
        ("advantages", batch.advantages, (n,)),
    ]
    for field, tensor, shape in checks:
        if tuple(tensor.shape) != shape:
            return f"{name}.{field} has shape {tuple(tensor.shape)}, expected {shape}"
    if n and length < 2:
        return f"{name} has sequence length {length}; at least 2 tokens are needed (prompt + response)"
    if bool((batch.response_mask.bool() & (batch.attention_mask[:, 1:] == 0)).any()):
        return f"{name}.response_mask marks target tokens where attention_mask is 0 (padding)"
    if not bool(torch.isfinite(batch.advantages).all()):
        return f"{name}.advantages holds NaN or inf"
    return None


class _Micro:
    """One micro-batch on this rank, trimmed to its longest real sequence (right padding)."""

    __slots__ = ("input_ids", "attention_mask", "targets", "mask", "old_log_probs", "advantages", "rows", "width")

    def __init__(self, batch: TrainBatch | SFTBatch, lo: int, hi: int, device: torch.device, field: str):
        am = batch.attention_mask[lo:hi]
        cols = torch.nonzero(am.sum(0) > 0)
        width = max(int(cols.max()) + 1 if cols.numel() else 1, 2)
        mask = getattr(batch, field)[lo:hi]
        if bool(mask[:, width - 1 :].any()):
            raise ValueError(f"{field} marks target tokens on padding (beyond the attention mask) in rows {lo}:{hi}")
        self.rows = (lo, hi)
        self.width = width
        self.input_ids = batch.input_ids[lo:hi, :width].to(device)
        self.attention_mask = am[:, :width].to(device)
        self.targets = self.input_ids[:, 1:]
        self.mask = mask[:, : width - 1].to(device).bool()
        if isinstance(batch, TrainBatch):
            self.old_log_probs = batch.old_log_probs[lo:hi, : width - 1].to(device, torch.float32)
            self.advantages = batch.advantages[lo:hi].to(device, torch.float32)
        else:
            self.old_log_probs = self.advantages = None


class LearnerRank:
    """One data-parallel DeepSpeed rank of the learner (plain class; the driver makes it a Ray actor).

    Args:
        model_path: Hugging Face model folder (weights, config, tokenizer).
        cfg: the ``learner`` config section.
        rank, world_size: this rank and the number of data-parallel ranks.
        master_addr, master_port: rendezvous of the process group (bind address of rank 0).
        seed: seeds Python, NumPy and torch on this rank.
        temperature: the rollout sampling temperature (> 0); log-probs are computed from
            ``logits / temperature``, the distribution the engines sampled from.
        warm_start: the ``warm_start`` section (kept for reference; the driver sets its learning rates with
            ``set_lr``).
        local_rank: device index on this node (None: ``rank`` on the CPU, 0 on a GPU, where Ray shows each
            rank one device).

    Raises:
        ValueError: ``rank`` outside ``[0, world_size)`` or ``temperature <= 0``.
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
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank!r} must be in [0, world_size={world_size!r})")
        if not temperature > 0:
            raise ValueError(f"temperature={temperature!r} must be > 0")
        use_gpu = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "") != "cpu"
        if not use_gpu:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if local_rank is None:
            local_rank = 0 if use_gpu else rank
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(local_rank),
            LOCAL_SIZE=os.environ.get("LOCAL_SIZE", str(world_size)),
            MASTER_ADDR=str(master_addr),
            MASTER_PORT=str(master_port),
        )
        torch.set_num_threads(cfg.threads_per_rank)

        import deepspeed
        from deepspeed.accelerator import get_accelerator
        from transformers import AutoModelForCausalLM

        from learner.ds_config import build_ds_config

        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.temperature = float(temperature)
        self.warm_start = warm_start
        self.model_path = str(model_path)
        self.clip_low, self.clip_high, self.loss_agg = resolve_objective(
            cfg.algorithm, cfg.clip_low, cfg.clip_high, cfg.loss_agg
        )
        if use_gpu:
            get_accelerator().set_device(local_rank)
        elif not cfg.cpu_shm_allreduce:
            # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op at every init_distributed
            # that finds no valid build cache (30 s idle, minutes on a busy machine); plain gloo is as fast
            # for the tensors of a tiny model. Opt back in with learner.cpu_shm_allreduce=true.
            # (importlib: `import deepspeed.comm.torch as m` binds the real torch, an attribute of deepspeed.comm)
            ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
            ds_torch_comm.build_shm_op = lambda: None
        deepspeed.init_distributed(
            dist_backend="nccl" if use_gpu else "gloo",
            auto_mpi_discovery=False,
            verbose=False,
            timeout=datetime.timedelta(seconds=cfg.dist_timeout_s),
            rank=rank,
            world_size=world_size,
        )
        self._seed_all(seed)
        self.device = torch.device(get_accelerator().current_device_name())
        dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype)
        model.config.use_cache = False
        if cfg.routing_replay and not find_routers(model):
            raise ValueError(
                f"learner.routing_replay=true needs an MoE model; {self.model_path!r} has no expert router"
            )
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=cfg.lr,
            betas=tuple(cfg.adam_betas),
            weight_decay=cfg.weight_decay,
        )
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=build_ds_config(cfg, world_size), dist_init_required=False
        )
        self.engine.eval()  # no dropout anywhere: training, recompute and reference passes see one policy
        self.ref_model = None
        if cfg.kl_coef > 0:
            self.ref_model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype).to(self.device)
            self.ref_model.config.use_cache = False
            self.ref_model.eval().requires_grad_(False)
        self._dummy = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        self.optimizer_steps = 0
        # MoE: forward hooks on the routers (expert load, routing volatility, Routing Replay); None if dense.
        self._tap: RouterTap | None = None
        if cfg.routing_replay or cfg.moe_diagnostics:
            tap = RouterTap(self.engine.module)
            if tap.is_moe:
                self._tap = tap
            else:
                tap.remove()
        if cfg.routing_replay and (self._tap is None or not self._tap.can_replay):
            raise ValueError(f"learner.routing_replay=true: the routers of {self.model_path!r} do not support replay")

    # ---------------------------------------------------------------------------------------------------
    # small helpers

    @staticmethod
    def _seed_all(seed: int) -> None:
        random.seed(seed)
        torch.manual_seed(seed)
        try:
            import numpy as np

            np.random.seed(seed % (1 << 32))
        except ImportError:  # pragma: no cover - numpy is installed with torch
            pass

    @property
    def _zero3(self) -> bool:
        return self.cfg.zero_stage == 3

    def _dist(self):
        import torch.distributed as dist

        return dist

    def _all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """All-reduce a list of floats (float64) over the ranks."""
        dist = self._dist()
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        return t.tolist()

    def _all_gather_objects(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        self._dist().all_gather_object(out, obj)
        return out

    def _base_optimizer(self) -> torch.optim.Optimizer:
        """The torch AdamW underneath DeepSpeed's wrappers (ZeRO, bf16)."""
        opt = self.engine.optimizer
        while not isinstance(opt, torch.optim.Optimizer) or type(opt).__module__.startswith("deepspeed"):
            inner = getattr(opt, "optimizer", None)
            if inner is None or inner is opt:
                break
            opt = inner
        return opt

    def _micro_slices(self, n: int, size: int) -> list[tuple[int, int]]:
        return [(lo, min(lo + size, n)) for lo in range(0, n, size)]

    def _aligned_counts(self, counts: list[int], collective: bool = True) -> list[int]:
        """Per group, the largest number of passes any rank runs (all ranks must run as many)."""
        if not collective or self.world_size == 1 or not counts:
            return list(counts)
        return [int(x) for x in self._all_reduce([float(c) for c in counts], op="max")]

    def _logits(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[B, T-1, V]`` logits predicting ``input_ids[:, 1:]``."""
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.logits[:, :-1]

    def _dummy_pass(self, with_grad: bool) -> None:
        """A pass that keeps this rank in step with ranks that have more micro-batches (zero gradient)."""
        if with_grad:
            logits = self._logits(self.engine, self._dummy, torch.ones_like(self._dummy))
            self.engine.backward(logits.float().sum() * 0.0, scale_wrt_gas=False)
        else:
            with torch.no_grad():
                self._logits(self.engine, self._dummy, torch.ones_like(self._dummy))

    @torch.no_grad()
    def _inference_pass(
        self,
        batch: TrainBatch,
        collective: bool,
        entropy_den: float | None = None,
        routes: list[torch.Tensor] | None = None,
    ):
        """Log-probs at the current weights of every micro-batch of ``batch`` (no gradient).

        Returns ``(micros, log_probs, entropy_sum)``: the micro-batches, their ``[b, w-1]`` float32 log-probs
        (0 outside the response mask) and, when ``entropy_den`` is given, sum over micro-batches of
        ``entropy_from_logits(..., num_tokens=entropy_den)``. With ``routes`` (a list) and an MoE model, the
        experts each micro-batch's tokens were routed to are appended to it (``[layers, b*w, k]`` on the CPU).
        """
        mbs = self.cfg.micro_batch_size
        slices = self._micro_slices(len(batch), mbs)
        (n_passes,) = self._aligned_counts([len(slices)], collective)
        micros, lps, ent = [], [], 0.0
        for k in range(n_passes):
            if k >= len(slices):
                self._dummy_pass(with_grad=False)
                continue
            mb = _Micro(batch, *slices[k], self.device, "response_mask")
            if routes is not None and self._tap is not None:
                with self._tap.capture() as record:
                    logits = self._logits(self.engine, mb.input_ids, mb.attention_mask)
                routes.append(record.used_tensor().cpu())
            else:
                logits = self._logits(self.engine, mb.input_ids, mb.attention_mask)
            lp = token_log_probs(logits, mb.targets, self.temperature)
            if entropy_den is not None:
                ent += float(entropy_from_logits(logits, mb.mask, temperature=self.temperature, num_tokens=entropy_den))
            micros.append(mb)
            lps.append(torch.where(mb.mask, lp, 0.0))
        return micros, lps, ent

    def _check_normalisers(self, minibatches: list[TrainBatch], num_sequences: list[int], num_tokens: list[int]):
        """All-reduce this rank's counts and check the driver's global normalisers against them."""
        if not (len(minibatches) == len(num_sequences) == len(num_tokens)):
            raise ValueError(
                f"minibatches ({len(minibatches)}), num_sequences ({len(num_sequences)}) and num_tokens "
                f"({len(num_tokens)}) must have one entry per minibatch"
            )
        local, problem = [], None
        for m, mb in enumerate(minibatches):
            problem = problem or _batch_problem(mb, f"minibatches[{m}]")
            s, t = loss_normalisers(mb.response_mask)
            local += [float(s), float(t), float(len(mb))]
        # One flag per rank in the same all-reduce: a bad shard stops every rank, none waits for a peer.
        tot = self._all_reduce(local + [1.0 if problem else 0.0])
        if tot[-1]:
            raise ValueError(problem or f"another learner rank refused its input ({int(tot[-1])} rank(s))")
        for m in range(len(minibatches)):
            nonempty, tokens, rows = tot[3 * m : 3 * m + 3]
            if int(num_tokens[m]) != int(tokens):
                raise ValueError(
                    f"num_tokens[{m}]={num_tokens[m]!r} but the ranks' shards of minibatch {m} hold {int(tokens)} "
                    "response tokens"
                )
            if not nonempty <= int(num_sequences[m]) <= rows:
                raise ValueError(
                    f"num_sequences[{m}]={num_sequences[m]!r} is outside [{int(nonempty)}, {int(rows)}] (sequences "
                    f"with response tokens, all sequences) of minibatch {m} over the ranks"
                )

    # ---------------------------------------------------------------------------------------------------
    # training

    def train_rollout_batch(
        self,
        minibatches: list[TrainBatch],
        num_sequences: list[int],
        num_tokens: list[int],
        *,
        guard: dict[str, float] | None = None,
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

        Returns:
            The same dict on every rank, aggregated exactly over micro-batches, minibatches, epochs and ranks:
            ``loss/policy`` (and ``loss/kl`` when ``kl_coef > 0``): mean over optimizer steps of the
            minibatch loss; ``actor/clip_fraction`` (``_low``, ``_high``): share of sequences (GSPO) or tokens
            (GRPO) clipped; ``actor/ratio_mean|min|max``: the importance ratios the objective used;
            ``actor/seq_ratio_mean|min|max``: GSPO's sequence ratio ``s_i`` (Eq. 7) for every algorithm;
            ``actor/entropy``: mean token entropy (nats) of the pre-update policy over the response tokens;
            ``actor/train_rollout_logprob_diff``: mean |learner log-prob at the pre-update weights - rollout
            log-prob| over response tokens; ``actor/grad_norm`` (mean over steps, pre-clip) and
            ``actor/grad_norm_max``; ``actor/lr``; ``actor/num_optimizer_steps`` (steps applied: 0 when the
            guard skipped the update). Values are those of the steps that ran (0 steps: loss 0, ratios 1).

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
        cfg = self.cfg
        guard = validate_guard(guard)
        self._check_normalisers(minibatches, num_sequences, num_tokens)
        n_mb = len(minibatches)
        total_tokens = float(sum(int(t) for t in num_tokens))
        tap = self._tap
        n_layers = len(tap.layers) if tap is not None else 0
        moe_diag = tap is not None and cfg.moe_diagnostics

        # Pre-update pass: learner log-probs at the current weights (behaviour policy for "recompute"), the
        # train-vs-rollout log-prob difference, the entropy of the current policy and (MoE) the experts every
        # token is routed to (expert load, the reference of the routing volatility, Routing Replay).
        diff_sum, diff_count, ent_sum, nonfinite = 0.0, 0.0, 0.0, 0.0
        pre_lps: list[list[torch.Tensor]] = []
        routes: list[list[torch.Tensor]] = []
        load_counts = torch.zeros((n_layers, tap.num_experts if tap is not None else 0), dtype=torch.float64)
        for mb in minibatches:
            mb_routes: list[torch.Tensor] | None = [] if tap is not None else None
            micros, lps, ent = self._inference_pass(
                mb, collective=True, entropy_den=max(total_tokens, 1.0), routes=mb_routes
            )
            ent_sum += ent
            pre_lps.append(lps)
            routes.append(mb_routes or [])
            for k, (micro, lp) in enumerate(zip(micros, lps)):
                diff_sum += float(torch.where(micro.mask, (lp - micro.old_log_probs).abs(), 0.0).double().sum())
                diff_count += float(micro.mask.sum())
                if guard is not None:
                    bad = ~(torch.isfinite(lp) & torch.isfinite(micro.old_log_probs))
                    nonfinite += float((bad & micro.mask).sum())
                if moe_diag:
                    load_counts += expert_counts(mb_routes[k], response_positions(micro.mask).cpu(), tap.num_experts)
        pre = self._all_reduce([diff_sum, diff_count, ent_sum, nonfinite] + load_counts.reshape(-1).tolist())
        diff_sum, diff_count, ent_sum, nonfinite = pre[:4]
        out: dict[str, Any] = {
            "actor/entropy": ent_sum,
            "actor/train_rollout_logprob_diff": diff_sum / diff_count if diff_count else 0.0,
        }
        if moe_diag:
            out.update(self._moe_load_metrics(torch.tensor(pre[4:], dtype=torch.float64).reshape(load_counts.shape)))
        failures: list[tuple[str, str]] = []
        if guard is not None:
            if nonfinite:
                failures.append(("nonfinite_log_probs", f"{int(nonfinite)} non-finite log-probs on response tokens"))
            # A NaN metric caused by those non-finite log-probs is not reported a second time.
            failures += [f for f in failed_checks(guard, out, "pre")
                         if not (nonfinite and not math.isfinite(float(out[GUARD_CHECKS[f[0]][0]])))]

        counts = self._aligned_counts([len(self._micro_slices(len(mb), cfg.micro_batch_size)) for mb in minibatches])
        parts: list[dict[str, float]] = []
        seq_sum, seq_count, seq_min, seq_max = 0.0, 0.0, math.inf, -math.inf
        loss_sum, kl_sum, grad_norms = 0.0, 0.0, []
        step_losses: list[float] = []  # this rank's loss of each optimizer step (sum over its micro-batches)
        # Routing volatility, per training pass over a minibatch after >= 1 update: [changed (experts used),
        # changed (router's own choice), compared] on this rank, and the updates since the pre-update pass.
        vol_local: list[list[float]] = []
        vol_updates: list[int] = []
        snapshot = self._snapshot_training_state() if guard is not None and not failures else None
        stop = bool(failures)
        for _epoch in range(cfg.ppo_epochs):
            if stop:
                break
            for m, batch in enumerate(minibatches):
                slices = self._micro_slices(len(batch), cfg.micro_batch_size)
                updates = len(grad_norms)  # optimizer steps applied in this call so far
                measure = moe_diag and updates >= 1
                vol = [0.0, 0.0, 0.0]
                bad_loss = 0.0
                step_loss = 0.0
                for k in range(counts[m]):
                    self.engine.set_gradient_accumulation_boundary(k == counts[m] - 1)
                    if k >= len(slices):
                        self._dummy_pass(with_grad=True)
                        continue
                    mb = _Micro(batch, *slices[k], self.device, "response_mask")
                    old = pre_lps[m][k] if cfg.old_logprob_source == "recompute" else mb.old_log_probs
                    if tap is not None:
                        replay = routes[m][k] if cfg.routing_replay else None
                        with tap.capture(replay=replay) as record:
                            logits = self._logits(self.engine, mb.input_ids, mb.attention_mask)
                        if measure:
                            sel = response_positions(mb.mask).cpu()
                            used, _ = topk_set_changes(record.used_tensor().cpu(), routes[m][k], sel)
                            own, compared = topk_set_changes(record.router_tensor().cpu(), routes[m][k], sel)
                            vol = [vol[0] + used, vol[1] + own, vol[2] + compared]
                    else:
                        logits = self._logits(self.engine, mb.input_ids, mb.attention_mask)
                    lp = token_log_probs(logits, mb.targets, self.temperature)
                    loss, metrics = policy_loss(
                        lp,
                        old,
                        mb.advantages,
                        mb.mask,
                        algorithm=cfg.algorithm,
                        clip_low=self.clip_low,
                        clip_high=self.clip_high,
                        loss_agg=self.loss_agg,
                        num_sequences=num_sequences[m],
                        num_tokens=num_tokens[m],
                    )
                    loss_sum += float(loss.detach())
                    step_loss += float(loss.detach())
                    if self.ref_model is not None:
                        with torch.no_grad():
                            ref_logits = self._logits(self.ref_model, mb.input_ids, mb.attention_mask)
                            ref_lp = token_log_probs(ref_logits, mb.targets, self.temperature)
                        kl = kl_penalty(
                            lp,
                            ref_lp,
                            mb.mask,
                            cfg.kl_estimator,
                            loss_agg=self.loss_agg,
                            num_sequences=num_sequences[m],
                            num_tokens=num_tokens[m],
                        )
                        kl_sum += float(kl.detach())
                        loss = loss + cfg.kl_coef * kl
                    if not math.isfinite(float(loss.detach())):
                        bad_loss = 1.0
                    # DeepSpeed averages gradients over the ranks: x world_size turns that into the sum.
                    self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
                    parts.append(metrics)
                    with torch.no_grad():
                        has = mb.mask.any(-1)
                        if bool(has.any()):
                            s = torch.exp(
                                sequence_log_ratio(lp.detach(), old, mb.mask)
                                .double()
                                .clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
                            )[has]
                            seq_sum += float(s.sum())
                            seq_count += float(s.numel())
                            seq_min = min(seq_min, float(s.min()))
                            seq_max = max(seq_max, float(s.max()))
                norm = self._optimizer_step()
                grad_norms.append(norm)
                step_losses.append(step_loss)
                if measure:
                    vol_local.append(vol)
                    vol_updates.append(updates)
                if guard is not None:
                    # Stop at the first step whose loss or gradient is broken (the decision is collective).
                    limit = guard.get("max_grad_norm", math.inf)
                    local = [bad_loss, 0.0 if math.isfinite(norm) else 1.0, 0.0 if norm <= limit else 1.0]
                    flags = self._all_reduce(local, "max")
                    if any(flags):
                        if flags[0]:
                            failures.append(("nonfinite_loss", "a micro-batch loss is NaN or inf"))
                        stop = True
                        break

        steps = len(grad_norms)
        step_losses = self._all_reduce(step_losses) if step_losses else []
        sums = self._all_reduce([loss_sum, kl_sum, seq_sum, seq_count] + [v for row in vol_local for v in row])
        loss_sum, kl_sum, seq_sum, seq_count = sums[:4]
        vol_tot = [sums[4 + 3 * i : 7 + 3 * i] for i in range(len(vol_local))]
        seq_min = self._all_reduce([seq_min], "min")[0]
        seq_max = self._all_reduce([seq_max], "max")[0]
        all_parts = [p for rank_parts in self._all_gather_objects(parts) for p in rank_parts]
        pm = combine_policy_metrics(all_parts) if all_parts else _EMPTY_POLICY_METRICS
        out.update({
            "loss/policy": loss_sum / max(steps, 1),
            "loss/policy_minibatches": [float(x) for x in step_losses],  # per optimizer step, summed over ranks
            "actor/clip_fraction": pm["clip_fraction"],
            "actor/clip_fraction_low": pm["clip_fraction_low"],
            "actor/clip_fraction_high": pm["clip_fraction_high"],
            "actor/ratio_mean": pm["ratio_mean"],
            "actor/ratio_min": pm["ratio_min"],
            "actor/ratio_max": pm["ratio_max"],
            "actor/log_ratio_abs_max": pm["log_ratio_abs_max"],
            "actor/seq_ratio_mean": seq_sum / seq_count if seq_count else 1.0,
            "actor/seq_ratio_min": seq_min if seq_count else 1.0,
            "actor/seq_ratio_max": seq_max if seq_count else 1.0,
            "actor/grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
            "actor/grad_norm_max": max(grad_norms) if grad_norms else 0.0,
            "actor/lr": self.get_lr(),
            "actor/num_optimizer_steps": float(steps),
            "actor/num_response_tokens": float(pm["num_tokens"]) / max(cfg.ppo_epochs, 1),
        })
        if self.ref_model is not None:
            out["loss/kl"] = kl_sum / max(steps, 1)
        if moe_diag:
            out.update(self._moe_volatility_metrics(vol_tot, vol_updates))
        if guard is not None:
            if snapshot is not None:  # the optimizer ran: check the loss, gradients and clipping too
                if not math.isfinite(loss_sum) and not any(n == "nonfinite_loss" for n, _ in failures):
                    failures.append(("nonfinite_loss", f"loss/policy={loss_sum / max(steps, 1)}"))
                if any(not math.isfinite(g) for g in grad_norms):
                    failures.append(("nonfinite_grad_norm", f"actor/grad_norm_max={max(grad_norms)}"))
                failures += [f for f in failed_checks(guard, out, "post")
                             if not (f[0] == "max_grad_norm" and not math.isfinite(out["actor/grad_norm_max"]))]
            # Every rank reaches the same verdict from the same all-reduced values; the extra all-reduce makes
            # the decision collective even if a value differed in the last bit between ranks.
            skip = self._all_reduce([1.0 if failures else 0.0], "max")[0] > 0
            if skip and snapshot is not None:
                self._restore_training_state(snapshot)
            if skip:
                out["actor/num_optimizer_steps"] = 0.0
                log.warning("health guard: step skipped (%s)", "; ".join(f"{n}: {r}" for n, r in failures))
            out["health/skipped"] = 1.0 if skip else 0.0
            out["health/steps_undone"] = float(steps) if skip else 0.0
            out["health/failed_checks"] = ",".join(n for n, _ in failures)
            out["health/reasons"] = "; ".join(f"{n}: {r}" for n, r in failures)
            out["health/nonfinite_log_probs"] = float(nonfinite)
        return out

    # ---------------------------------------------------------------------------------------------------
    # MoE diagnostics

    def _moe_load_metrics(self, counts: torch.Tensor) -> dict[str, Any]:
        """Expert-load metrics from the all-reduced ``[layers, E]`` counts of the pre-update pass.

        Counted: every (token, top-k slot) routing decision at the input positions whose output predicts a
        response token (``learner.moe.response_positions``), over all ranks and minibatches of the step.
        ``moe/expert_load[l][e]``: share of layer ``l``'s assignments that went to expert ``e`` (rows sum to 1;
        ``l`` indexes the MoE layers in order, ``moe/layers`` gives their decoder layer numbers);
        ``moe/layer{L}/load_imbalance``: max share / mean share (1 = even, E/k = collapsed);
        ``moe/load_imbalance``: mean over layers, ``moe/load_imbalance_max``: the worst layer;
        ``moe/load_cv``: mean over layers of the coefficient of variation of the shares.
        """
        stats = load_statistics(counts)
        out: dict[str, Any] = {
            "moe/load_imbalance": stats["imbalance_mean"],
            "moe/load_imbalance_max": stats["imbalance_max"],
            "moe/load_cv": stats["cv_mean"],
        }
        for layer, imb in zip(self._tap.layers, stats["imbalance"]):
            out[f"moe/layer{layer}/load_imbalance"] = imb
        out["moe/expert_load"] = stats["share"]
        out["moe/layers"] = list(self._tap.layers)
        return out

    @staticmethod
    def _moe_volatility_metrics(vol_tot: list[list[float]], vol_updates: list[int]) -> dict[str, float]:
        """Routing volatility of the step from the all-reduced per-pass counts.

        What it measures: take the experts every response position (see ``_moe_load_metrics``) was routed to in
        each MoE layer during the pre-update forward (the behaviour policy when the rollout is on-policy: the
        weights the rollout was generated with). Every later training forward over the same tokens (minibatch
        ``m`` of epoch ``e`` runs after ``u = e * M + m`` optimizer steps of this call) is compared with it; a
        (token, layer) pair counts as changed when its top-k expert SET differs (order ignored). Passes with
        ``u = 0`` (the first minibatch of the first epoch: same weights) are left out.

        - ``moe/routing_volatility``: mean over the measured passes of changed / compared (pairs pooled over
          ranks, tokens and layers within a pass), for the experts the training forward actually USED (0
          under Routing Replay by construction);
        - ``moe/routing_volatility_unreplayed``: the same for the router's OWN top-k choice at the current
          weights (what it would pick without replay; equal to the above without replay);
        - ``moe/routing_volatility_per_update``: mean over the passes of (router's own changed share) / u, a
          per-update rate comparable across num_minibatches (the paper's "about 10% per update");
        - ``moe/routing_volatility_passes``: number of measured passes (0 with one minibatch and one epoch:
          the three figures are then 0 and mean nothing).
        """
        shares_used = [c[0] / c[2] for c in vol_tot if c[2] > 0]
        shares_own = [c[1] / c[2] for c in vol_tot if c[2] > 0]
        per_update = [c[1] / c[2] / u for c, u in zip(vol_tot, vol_updates) if c[2] > 0]
        n = len(shares_used)
        return {
            "moe/routing_volatility": sum(shares_used) / n if n else 0.0,
            "moe/routing_volatility_unreplayed": sum(shares_own) / n if n else 0.0,
            "moe/routing_volatility_per_update": sum(per_update) / n if n else 0.0,
            "moe/routing_volatility_passes": float(n),
        }

    # ---------------------------------------------------------------------------------------------------
    # health guard: exact snapshot and restore of the training state

    def _training_state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of this rank that an optimizer step writes, each once: the module's parameters (the
        local partition ``ds_tensor`` under ZeRO-3, plus the full data of parameters currently held gathered,
        e.g. persistent small ones), DeepSpeed's fp32 master partitions (ZeRO-1/2 ``single_partition_of_fp32_groups``,
        ZeRO-3 ``fp32_partitioned_groups_flat``, bf16 ``fp32_groups_flat_partition``) and the torch
        optimizer's parameters. Optimizer state (moments, steps) is handled separately."""
        seen: set[int] = set()
        out: list[torch.Tensor] = []

        def add(t) -> None:
            if torch.is_tensor(t) and t.numel() > 0 and id(t) not in seen:
                seen.add(id(t))
                out.append(t)

        for p in self.engine.module.parameters():
            if hasattr(p, "ds_tensor"):
                add(p.ds_tensor)
            add(p.data if p.data.numel() > 0 else None)
        ds_opt = self.engine.optimizer
        for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition"):
            for t in getattr(ds_opt, attr, None) or []:
                add(t)
        for group in self._base_optimizer().param_groups:
            for p in group["params"]:
                add(p)
        return out

    def _snapshot_training_state(self) -> dict[str, Any]:
        """A CPU copy of everything an optimizer step changes on this rank (see ``_restore_training_state``)."""

        def keep(v):
            return v.detach().to("cpu", copy=True) if torch.is_tensor(v) else copy.deepcopy(v)

        opt = self._base_optimizer()
        tensors = self._training_state_tensors()
        return {
            "tensors": [(t, keep(t)) for t in tensors],
            "opt_state": {key: {name: keep(v) for name, v in st.items()} for key, st in opt.state.items()},
            "groups": [{k: keep(v) for k, v in g.items() if k != "params"} for g in opt.param_groups],
            "counters": {a: getattr(self.engine, a) for a in ("global_steps", "global_samples", "micro_steps",
                                                              "skipped_steps") if hasattr(self.engine, a)},
            "optimizer_steps": self.optimizer_steps,
            "captured": len((getattr(self, "_capture", None) or {}).get("steps", [])),
        }

    @torch.no_grad()
    def _restore_training_state(self, snap: dict[str, Any]) -> None:
        """Put back a ``_snapshot_training_state``: parameters, fp32 partitions, optimizer state (entries
        created since are removed, so e.g. Adam re-initialises exactly as it would have), hyperparameters,
        DeepSpeed's step counters and ``optimizer_steps``. Local (every rank restores its own copy)."""
        for live, saved in snap["tensors"]:
            live.data.copy_(saved.to(live.device))
        opt = self._base_optimizer()
        saved_state = snap["opt_state"]
        for key in [k for k in opt.state if k not in saved_state]:
            del opt.state[key]
        for key, saved in saved_state.items():
            live = opt.state.setdefault(key, {})
            for name in [n for n in live if n not in saved]:
                del live[name]
            for name, value in saved.items():
                cur = live.get(name)
                if torch.is_tensor(value) and torch.is_tensor(cur) and cur.shape == value.shape and cur.dtype == value.dtype:
                    cur.copy_(value.to(cur.device))
                elif torch.is_tensor(value):
                    live[name] = value.clone()
                else:
                    live[name] = copy.deepcopy(value)
        for group, saved in zip(opt.param_groups, snap["groups"]):
            group.update(saved)
        for attr, value in snap["counters"].items():
            setattr(self.engine, attr, value)
        self.optimizer_steps = snap["optimizer_steps"]
        if getattr(self, "_capture", None) is not None and "steps" in self._capture:
            del self._capture["steps"][snap["captured"] :]

    def capture_gradients(self, enabled: bool = True) -> None:
        """Debug/verification hook: when enabled, every optimizer step first records the full (all-rank,
        pre-clip) gradient of every parameter, readable with ``captured_gradients`` (collective while on)."""
        self._capture = {} if enabled else None

    def captured_gradients(self) -> list[dict[str, torch.Tensor]]:
        """The gradients recorded by ``capture_gradients``, one dict (HF names -> float32 CPU tensor) per
        optimizer step since it was enabled."""
        return list((self._capture or {}).get("steps", []))

    def _record_gradients(self) -> None:
        from deepspeed.utils import safe_get_full_grad

        grads = {}
        for name, p in self.engine.module.named_parameters():
            g = safe_get_full_grad(p)
            grads[name] = None if g is None else g.detach().float().cpu().clone()
        self._capture.setdefault("steps", []).append(grads)

    def _optimizer_step(self) -> float:
        """Apply the accumulated gradients (one DeepSpeed step) and return the pre-clip global grad norm."""
        if getattr(self, "_capture", None) is not None:
            self._record_gradients()
        norm = None
        if self.cfg.zero_stage == 0 and self.cfg.dtype == "float32":
            # Stage 0 without bf16 clips with torch's clip_grad_norm_ and does not keep the norm: compute it
            # here, after the boundary all-reduce and before the clip.
            grads = [p.grad.detach().double() for p in self.engine.module.parameters() if p.grad is not None]
            norm = float(torch.sqrt(sum((g * g).sum() for g in grads))) if grads else 0.0
        self.engine.step()
        self.optimizer_steps += 1
        if norm is None:
            value = self.engine.get_global_grad_norm()
            norm = float(value) if value is not None else float("nan")
        return norm

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
        local_tokens = float(batch.loss_mask.sum())
        (tot,) = self._all_reduce([local_tokens])
        if int(tot) != int(num_tokens):
            raise ValueError(f"num_tokens={num_tokens!r} but the ranks' SFT shards hold {int(tot)} loss tokens")
        den = max(float(num_tokens), 1.0)
        slices = self._micro_slices(len(batch), self.cfg.micro_batch_size)
        (n_passes,) = self._aligned_counts([len(slices)])
        loss_sum = 0.0
        for k in range(n_passes):
            self.engine.set_gradient_accumulation_boundary(k == n_passes - 1)
            if k >= len(slices):
                self._dummy_pass(with_grad=True)
                continue
            mb = _Micro(batch, *slices[k], self.device, "loss_mask")
            lp = token_log_probs(self._logits(self.engine, mb.input_ids, mb.attention_mask), mb.targets, 1.0)
            loss = -torch.where(mb.mask, lp, 0.0).sum() / den
            loss_sum += float(loss.detach())
            self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
        norm = self._optimizer_step()
        (loss_total,) = self._all_reduce([loss_sum])
        return {"loss/sft": loss_total, "grad_norm": norm, "lr": self.get_lr()}

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every parameter group (takes effect at the next optimizer step).

        Raises:
            ValueError: ``lr`` not a finite number > 0.
        """
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"lr={lr!r} must be a finite number > 0")
        for group in self._base_optimizer().param_groups:
            group["lr"] = float(lr)
        for group in getattr(self.engine.optimizer, "param_groups", []):
            group["lr"] = float(lr)

    def get_lr(self) -> float:
        """The learning rate of the first parameter group."""
        return float(self._base_optimizer().param_groups[0]["lr"])

    def reset_optimizer_state(self) -> None:
        """Forget AdamW's moments and step counts (between the warm start and RL); weights are unchanged."""
        opt = self._base_optimizer()
        opt.state.clear()
        self.engine.optimizer.zero_grad()

    # ---------------------------------------------------------------------------------------------------
    # log-probs and weights

    def compute_log_probs(self, batch: TrainBatch) -> torch.Tensor:
        """Log-probs of the target tokens at the current weights, from ``logits / temperature``.

        Collective under ZeRO-3 (parameters are gathered during the forward); local otherwise.

        Returns:
            float32 ``[N, L-1]`` on the CPU, 0 outside ``batch.response_mask``.
        """
        out = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
        micros, lps, _ = self._inference_pass(batch, collective=self._zero3)
        for mb, lp in zip(micros, lps):
            lo, hi = mb.rows
            out[lo:hi, : mb.width - 1] = lp.float().cpu()
        return out

    def _full_params(self, on_all_ranks: bool):
        """Yield ``(name, full tensor on the CPU or None)`` for every parameter and persistent buffer, HF
        (in-memory) names. Collective under ZeRO-3: every rank must consume the whole generator."""
        import deepspeed

        module = self.engine.module
        keep = on_all_ranks or self.rank == 0
        for name, p in module.named_parameters():
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None, enabled=self._zero3):
                yield name, (p.detach().to("cpu", copy=True) if keep else None)
        state_keys = set(module.state_dict().keys()) if keep else set()
        for name, b in module.named_buffers():
            if name in state_keys:
                yield name, b.detach().to("cpu", copy=True)

    def _full_state_dict(self, on_all_ranks: bool = False) -> dict[str, torch.Tensor]:
        return {n: t for n, t in self._full_params(on_all_ranks) if t is not None}

    def export_weights(self, bucket_mb: float, as_refs: bool = True, checkpoint_format: bool = True) -> list:
        """The full weights for the rollout engines, in buckets of about ``bucket_mb`` MiB. Collective.

        Args:
            bucket_mb: target bucket size in MiB (> 0); a tensor larger than that gets a bucket of its own.
            as_refs: True: each bucket goes into the Ray object store (``ray.put`` on rank 0, which owns the
                objects: fetch them before the actor dies); False: the bucket dicts themselves (no Ray needed).
            checkpoint_format: True: names and layout of the Hugging Face checkpoint files (what
                ``save_pretrained`` writes and vLLM loads, e.g. one tensor per expert); False: the
                transformers in-memory names (fused expert tensors).

        Returns:
            On rank 0 a list of ``ray.ObjectRef`` (or of ``dict[str, Tensor]`` on the CPU), in parameter
            order, together holding every weight once; ``[]`` on the other ranks.

        Raises:
            ValueError: ``bucket_mb`` not > 0.
        """
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb={bucket_mb!r} must be > 0")
        state = self._full_state_dict()
        if self.rank != 0:
            return []
        if checkpoint_format:
            state = self._to_checkpoint_format(state)
        limit = bucket_mb * (1 << 20)
        buckets: list[dict[str, torch.Tensor]] = []
        current: dict[str, torch.Tensor] = {}
        size = 0
        for name, t in state.items():
            nbytes = t.numel() * t.element_size()
            if current and size + nbytes > limit:
                buckets.append(current)
                current, size = {}, 0
            current[name] = t
            size += nbytes
        if current:
            buckets.append(current)
        if not as_refs:
            return buckets
        import ray

        return [ray.put(b) for b in buckets]

    def _to_checkpoint_format(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers in-memory names -> checkpoint names (reverses its load-time weight conversions)."""
        from transformers.core_model_loading import revert_weight_conversion

        out = revert_weight_conversion(self.engine.module, dict(state))
        return {k: v.contiguous() for k, v in out.items()}

    def state_checksum(self) -> float:
        """Sum of all parameters in float64 (full, gathered under ZeRO-3); the same on every rank. Collective."""
        total = 0.0
        for _, t in self._full_params(on_all_ranks=True):
            total += float(t.double().sum())
        return total

    def local_param_fraction(self) -> float:
        """Elements of the parameters held locally (outside any gather) / elements of the full model: 1.0
        without ZeRO-3, about 1 / world_size with it. Local."""
        local = full = 0
        for p in self.engine.module.parameters():
            full += int(getattr(p, "ds_numel", p.numel()))
            local += int(p.ds_tensor.numel()) if hasattr(p, "ds_tensor") else p.numel()
        return local / max(full, 1)

    def state_digest(self) -> str:
        """SHA-256 of every full parameter's bytes, in order: equal digests mean bit-identical weights.
        Collective."""
        h = hashlib.sha256()
        for name, t in self._full_params(on_all_ranks=True):
            h.update(name.encode())
            h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def optimizer_state_digest(self) -> str:
        """SHA-256 of this rank's optimizer state (moments and step counts of its partition): equal digests
        before and after a save/load round trip mean the state was restored. Local."""
        h = hashlib.sha256()
        opt = self._base_optimizer()
        for gi, group in enumerate(opt.param_groups):
            h.update(f"{gi}:{group['lr']!r}".encode())
        # ZeRO-3 swaps its flat partitions into param_groups only during step(): walk the state itself.
        for key, state in opt.state.items():
            h.update(repr(tuple(key.shape)).encode() if torch.is_tensor(key) else repr(key).encode())
            for name, value in sorted(state.items()):
                h.update(name.encode())
                if torch.is_tensor(value):
                    h.update(value.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
                else:
                    h.update(repr(value).encode())
        return h.hexdigest()

    # ---------------------------------------------------------------------------------------------------
    # checkpoints

    def save_checkpoint(self, path: str) -> None:
        """Write what resuming needs into ``path`` (collective; the driver renames the folder atomically).

        ``path/deepspeed/``: DeepSpeed's checkpoint (model, optimizer partitions, lr) from every rank;
        ``path/rng/rank_<r>.pt``: each rank's Python, NumPy and torch RNG states; ``path/learner_state.json``;
        ``path/hf/``: on rank 0, the full model in Hugging Face format (safetensors, checkpoint names) plus a
        copy of the tokenizer files, loadable by transformers and vLLM.
        """
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        self.engine.save_checkpoint(str(out), tag=DS_TAG, client_state={"optimizer_steps": self.optimizer_steps})
        rng_dir = out / RNG_SUBDIR
        rng_dir.mkdir(exist_ok=True)
        torch.save(self._rng_state(), rng_dir / f"rank_{self.rank}.pt")
        state = self._full_state_dict()
        if self.rank == 0:
            hf = out / HF_SUBDIR
            self.engine.module.save_pretrained(str(hf), state_dict=state, safe_serialization=True)
            src = Path(self.model_path)
            for name in _TOKENIZER_FILES:
                if (src / name).is_file():
                    shutil.copy2(src / name, hf / name)
            (out / STATE_FILE).write_text(
                json.dumps({"world_size": self.world_size, "zero_stage": self.cfg.zero_stage,
                            "optimizer_steps": self.optimizer_steps}, indent=1) + "\n"
            )
        if self.world_size > 1:
            self._dist().barrier()

    def load_checkpoint(self, path: str) -> None:
        """Restore weights, optimizer state, lr and this rank's RNG states from ``save_checkpoint``'s folder.
        Collective.

        Raises:
            FileNotFoundError: ``path`` holds no learner checkpoint.
        """
        src = Path(path)
        if not (src / DS_TAG).is_dir():
            raise FileNotFoundError(f"path={path!r} holds no learner checkpoint (no {DS_TAG}/ folder)")
        load_path, client_state = self.engine.load_checkpoint(
            str(src), tag=DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if load_path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint in {path!r}")
        self.optimizer_steps = int((client_state or {}).get("optimizer_steps", self.optimizer_steps))
        rng_file = src / RNG_SUBDIR / f"rank_{self.rank}.pt"
        if rng_file.is_file():
            self._set_rng_state(torch.load(rng_file, weights_only=False))
        else:
            log.warning("no RNG state for rank %d in %s; RNG not restored", self.rank, path)

    @staticmethod
    def _rng_state() -> dict[str, Any]:
        state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        try:
            import numpy as np

            state["numpy"] = np.random.get_state()
        except ImportError:  # pragma: no cover
            pass
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    @staticmethod
    def _set_rng_state(state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
        if "numpy" in state:
            import numpy as np

            np.random.set_state(state["numpy"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])

    # ---------------------------------------------------------------------------------------------------
    # process

    def pid(self) -> int:
        """This rank's process id."""
        return os.getpid()

    def shutdown(self) -> None:
        """Leave the process group (the process itself is ended by its owner)."""
        dist = self._dist()
        if dist.is_initialized():
            dist.destroy_process_group()
