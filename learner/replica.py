"""One rank's replica of the policy under DeepSpeed, and the operations the learner's steps are built from.

``Replica`` holds this rank's DeepSpeed engine (the policy being trained), the optional frozen reference
model, the MoE router tap, and offers: collectives over the ranks (all-reduce of floats, all-gather of
objects, aligned pass counts), forwards (logits, the no-gradient log-prob pass, the zero-weighted pass that
keeps ranks in step), the optimizer step with the exact scaling described in ``learner.service``, and the
exact snapshot / restore of the training state used by the health guard.

Ranks must run the same number of forward/backward passes (ZeRO-2 reduces and ZeRO-3 gathers inside them), so
a rank with fewer micro-batches in a minibatch runs zero-weighted passes on a dummy input to keep step.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from learner import state
from learner.attention import SDPA_FP32
from learner.contracts import SFTBatch, TrainBatch
from learner.ds_config import policy_clips_itself
from learner.elastic_threads import ElasticThreads, attach_layer_hooks
from learner.lora import set_dropout
from learner.logprobs import entropy_from_logits, token_log_probs
from learner.microbatch import MicroBatch, batch_problem, micro_slices
from learner.moe import RouterTap, rollout_replay_ids
from learner.objectives import loss_normalisers
from learner.packing import PackedRows

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class Replica:
    """This rank's policy (DeepSpeed engine) and the collective / forward / optimizer operations on it.

    Args:
        engine: the DeepSpeed engine (``deepspeed.initialize``'s first result), in eval mode (no dropout; with
            ``learner.gradient_checkpointing`` its checkpointed decoder layers alone are in training mode, which
            is what turns checkpointing on, see ``learner.rank_setup.keep_checkpointing_on``).
        cfg: the ``learner`` config section.
        rank, world_size: this rank and the number of data-parallel ranks.
        device: this rank's torch device.
        temperature: the rollout sampling temperature (> 0); log-probs come from ``logits / temperature``.
        ref_model: frozen reference policy for the KL penalty, or None.
        tap: the MoE router tap (``learner.moe.RouterTap``), or None for a dense model / no diagnostics.
    """

    def __init__(self, engine, cfg, *, rank: int, world_size: int, device: torch.device, temperature: float,
                 ref_model=None, tap: RouterTap | None = None):
        self.engine, self.cfg = engine, cfg
        self.rank, self.world_size = rank, world_size
        self.device, self.temperature = device, float(temperature)
        self.ref_model, self.tap = ref_model, tap
        self.zero3 = cfg.zero_stage == 3
        self.optimizer_steps = 0
        self.rollout_batches = 0  # rollout batches trained since this rank started (learner.mismatch_monitor_every)
        self.capture: dict[str, Any] | None = None  # gradient capture for verification (capture_gradients)
        self._dummy = torch.zeros((1, 2), dtype=torch.long, device=device)
        self.elastic = (ElasticThreads(cfg.threads_per_rank, cfg.max_threads_per_rank)
                        if cfg.max_threads_per_rank is not None and device.type == "cpu" else None)
        self._layer_hooks = (attach_layer_hooks(getattr(engine, "module", engine), self.elastic)
                             if self.elastic is not None else [])
        self._last_snapshot: dict[str, Any] | None = None  # the last guarded step's snapshot: its buffers are reused
        self._flat_ok: dict[int, bool] = {}  # flat_packing's verdict per model (by id)

    def start_update(self) -> None:
        """At the start of an update: elastic threads back to ``threads_per_rank`` and a fresh interval."""
        if self.elastic is not None:
            self.elastic.start()

    def before_micro_batch(self) -> None:
        """Before a forward/backward: let the elastic threads take the cores other processes left idle."""
        if self.elastic is not None:
            self.elastic.adjust()

    def before_backward(self) -> None:
        """Between a micro-batch's forward and its backward: the elastic threads decide again (a backward
        lasts about twice its forward; the decoder layers' hooks decide within it too)."""
        if self.elastic is not None:
            self.elastic.adjust()

    # -- collectives --------------------------------------------------------------------------------------
    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """All-reduce a list of floats (float64) over the ranks; ``op`` is ``"sum"``, ``"max"`` or ``"min"``."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(t, op=_REDUCE_OPS[op])
        return t.tolist()

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def aligned_counts(self, counts: list[int], collective: bool = True) -> list[int]:
        """Per group, the largest number of passes any rank runs (all ranks must run as many)."""
        if not collective or self.world_size == 1 or not counts:
            return list(counts)
        return [int(x) for x in self.all_reduce([float(c) for c in counts], op="max")]

    def check_normalisers(self, minibatches: list[TrainBatch], num_sequences: list[int], num_tokens: list[int]) -> None:
        """All-reduce this rank's counts and check the driver's global normalisers against them. Collective.

        Raises:
            ValueError: lists of different lengths, a bad shard on any rank, or normalisers that do not match.
        """
        if not (len(minibatches) == len(num_sequences) == len(num_tokens)):
            raise ValueError(
                f"minibatches ({len(minibatches)}), num_sequences ({len(num_sequences)}) and num_tokens "
                f"({len(num_tokens)}) must have one entry per minibatch"
            )
        local, problem = [], None
        for m, mb in enumerate(minibatches):
            problem = problem or batch_problem(mb, f"minibatches[{m}]")
            s, t = loss_normalisers(mb.response_mask)
            local += [float(s), float(t), float(len(mb))]
        # One flag per rank in the same all-reduce: a bad shard stops every rank, none waits for a peer.
        tot = self.all_reduce(local + [1.0 if problem else 0.0])
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

    # -- forwards -----------------------------------------------------------------------------------------
    def slices(self, batch: TrainBatch | SFTBatch) -> list[tuple[int, int]]:
        """This rank's micro-batch row ranges of ``batch`` (``learner.microbatch.micro_slices`` with the
        config's ``micro_batch_size`` and ``max_tokens_per_micro_batch``): every pass over a batch cuts it so."""
        return micro_slices(batch.attention_mask, self.cfg.micro_batch_size, self.cfg.max_tokens_per_micro_batch)

    def logits(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[B, T-1, V]`` logits predicting ``input_ids[:, 1:]`` (the padded forward; under ``autocast``). LoRA
        dropout (``learner.lora.dropout``) is on in the passes that build a gradient only (``learner.lora.set_dropout``)."""
        self.lora_dropout(model)
        with self.autocast():
            out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.logits[:, :-1]

    def flat_packing(self, model) -> bool:
        """Whether a packed forward of ``model`` runs flat (``learner.packing_layout='flat'``): only with SDPA
        attention, no sliding-window layer (a module whose ``sliding_window`` is set) and no gradient
        checkpointing (its recompute in the backward would run outside the flat forward's attention)."""
        if self.cfg.packing_layout != "flat" or self.cfg.gradient_checkpointing:
            return False
        module = getattr(model, "module", model)
        cache = self._flat_ok
        if id(module) not in cache:
            cache[id(module)] = (getattr(module.config, "_attn_implementation", None) in ("sdpa", SDPA_FP32)
                                 and not any(getattr(m, "sliding_window", None) for m in module.modules()))
        return cache[id(module)]

    def lora_dropout(self, model) -> None:
        """With ``learner.lora.dropout``: the adapters' dropout on when this pass builds a gradient, else off."""
        if self.cfg.lora.dropout:
            set_dropout(model, torch.is_grad_enabled())

    def autocast(self):
        """``learner.autocast``: torch's bf16 autocast on this rank's device for a forward, or no context."""
        if self.cfg.autocast == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def log_probs(self, model, mb: MicroBatch, temperature: float | None = None,
                  entropy_den: float | None = None) -> tuple[torch.Tensor, float]:
        """Log-probs of ``mb.targets`` at ``mb.mask`` from ``logits / temperature`` (default: the rollout's), and
        with ``entropy_den`` the entropy sum ``entropy_from_logits(..., num_tokens=entropy_den)`` (else 0.0).

        With ``learner.pack_sequences`` (and at least one masked target) the rows run packed
        (``learner.packing``: sequences end to end in rows no longer than the longest), so almost no FLOP goes
        to padding; else the padded forward. Returns float32 ``[b, w-1]`` (packed: 0 outside ``mb.mask``;
        padded: every position's value) and a float."""
        temp = self.temperature if temperature is None else float(temperature)
        if self.cfg.pack_sequences and bool(mb.mask.any()):
            packed = PackedRows(mb.attention_mask, mb.mask)
            self.lora_dropout(model)
            with self.autocast():
                logits = packed.wanted_logits(model, mb.input_ids, flat=self.flat_packing(model))  # [1, M, V]
            lp = packed.unpack(token_log_probs(logits, packed.target_ids(mb.input_ids), temp))
            mask = torch.ones(logits.shape[:2], dtype=torch.bool, device=logits.device)
        else:
            logits = self.logits(model, mb.input_ids, mb.attention_mask)
            lp, mask = token_log_probs(logits, mb.targets, temp), mb.mask
        ent = 0.0
        if entropy_den is not None:
            ent = float(entropy_from_logits(logits, mask, temperature=temp, num_tokens=entropy_den))
        return lp, ent

    def dummy_pass(self, with_grad: bool) -> None:
        """A pass that keeps this rank in step with ranks that have more micro-batches (zero gradient)."""
        if with_grad:
            logits = self.logits(self.engine, self._dummy, torch.ones_like(self._dummy))
            self.engine.backward(logits.float().sum() * 0.0, scale_wrt_gas=False)
        else:
            with torch.no_grad():
                self.logits(self.engine, self._dummy, torch.ones_like(self._dummy))

    @torch.no_grad()
    def inference_pass(self, batch: TrainBatch, collective: bool, entropy_den: float | None = None,
                       routes: list[torch.Tensor] | None = None):
        """Log-probs at the current weights of every micro-batch of ``batch`` (no gradient).

        Returns ``(micros, log_probs, entropy_sum)``: the micro-batches, their ``[b, w-1]`` float32 log-probs
        (0 outside the response mask) and, when ``entropy_den`` is given, sum over micro-batches of
        ``entropy_from_logits(..., num_tokens=entropy_den)``. With ``routes`` (a list) and an MoE model, the
        experts the routers chose for each micro-batch's tokens are appended to it (``[layers, b*w, k]`` on the
        CPU); with ``learner.routing_replay='rollout'`` the forward runs the engine's experts (R3) and ``routes``
        still gets the routers' own choice.
        """
        slices = self.slices(batch)
        (n_passes,) = self.aligned_counts([len(slices)], collective)
        micros, lps, ent = [], [], 0.0
        for k in range(n_passes):
            self.before_micro_batch()
            if k >= len(slices):
                self.dummy_pass(with_grad=False)
                continue
            mb = MicroBatch(batch, *slices[k], self.device, "response_mask")
            if routes is not None and self.tap is not None:
                replay = self.rollout_replay(mb) if self.cfg.routing_replay == "rollout" else None
                with self.tap.capture(replay=replay) as record:
                    logits = self.logits(self.engine, mb.input_ids, mb.attention_mask)
                routes.append(record.router_tensor().cpu())
                lp = token_log_probs(logits, mb.targets, self.temperature)
                if entropy_den is not None:
                    ent += float(entropy_from_logits(logits, mb.mask, temperature=self.temperature,
                                                     num_tokens=entropy_den))
            else:
                lp, e = self.log_probs(self.engine, mb, entropy_den=entropy_den)
                ent += e
            micros.append(mb)
            lps.append(torch.where(mb.mask, lp, 0.0))
        return micros, lps, ent

    def rollout_replay(self, mb: MicroBatch) -> torch.Tensor:
        """R3: the engine's experts for ``mb`` as replay ids ``[layers, b*w, k]`` (``learner.moe.rollout_replay_ids``).

        Raises:
            ValueError: the batch carries no engine routing (``rollout.return_routed_experts`` off), or one whose
                layer count differs from the learner's MoE layers.
        """
        if mb.rollout_routes is None:
            raise ValueError("learner.routing_replay='rollout' but the batch carries no engine routing: set "
                             "rollout.return_routed_experts=true")
        ids = rollout_replay_ids(mb.rollout_routes, self.tap.top_k)
        if ids.shape[0] != len(self.tap.layers):
            raise ValueError(f"the engine reported routing for {ids.shape[0]} MoE layers, the learner has "
                             f"{len(self.tap.layers)}")
        return ids

    # -- optimizer ----------------------------------------------------------------------------------------
    def optimizer_step(self) -> float:
        """Apply the accumulated gradients (one DeepSpeed step) and return the pre-clip global grad norm."""
        if self.capture is not None:
            self._record_gradients()
        norm = self._clip_stage0() if policy_clips_itself(self.cfg) else None
        state.reset_cpu_adam_cache(self.engine)  # CPU Adam (offload): no step history outside optimizer.state
        self.engine.step()
        self.optimizer_steps += 1
        if norm is None:
            value = self.engine.get_global_grad_norm()
            norm = float(value) if value is not None else float("nan")
        return norm

    def _clip_stage0(self) -> float:
        """ZeRO-0 in float32 (``learner.ds_config.policy_clips_itself``): the global gradient norm and the clip,
        here, after the boundary all-reduce. The norm is taken once, in DeepSpeed's own arithmetic (its
        ``clip_grad_norm_``: per-tensor 2-norms, squared, summed, square root), so the clip coefficient and the
        run stay bit for bit what they were with DeepSpeed's clip (rounding alone moved ``make train``'s
        digits); the gradients are scaled only when the clip bites, by torch's ``clip_grads_with_norm_``
        (``learner.grad_clip / (norm + 1e-6)``), where DeepSpeed took the norm again and multiplied every
        gradient, by 1 when the clip did not bite (2.5% of a small-workload update on one thread). Returns the
        pre-clip norm."""
        params = [p for p in self.engine.module.parameters() if p.grad is not None]
        if not params:
            return 0.0
        total = torch.stack([p.grad.detach().float().norm(2) for p in params]).pow(2).sum().float().pow(0.5)
        if float(self.cfg.grad_clip / (total + 1e-6)) < 1.0:
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.grad_clip, total, foreach=True)
        return float(total)

    def _record_gradients(self) -> None:
        from deepspeed.utils import safe_get_full_grad

        grads = {}
        for name, p in self.engine.module.named_parameters():
            g = safe_get_full_grad(p)
            grads[name] = None if g is None else g.detach().float().cpu().clone()
        self.capture.setdefault("steps", []).append(grads)

    def base_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer underneath DeepSpeed's wrappers (torch's AdamW, or CPU Adam with offload)."""
        return state.base_optimizer(self.engine)

    # -- exact snapshot / restore (health guard) -----------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """A CPU copy of everything an optimizer step changes on this rank (``learner.state.snapshot``),
        plus the optimizer-step count and the number of captured gradients."""
        # the last step's snapshot is done with (restored from or dropped): its buffers take this one
        snap = state.snapshot(self.engine, into=self._last_snapshot)
        self._last_snapshot = snap
        snap["optimizer_steps"] = self.optimizer_steps
        snap["captured"] = len((self.capture or {}).get("steps", []))
        return snap

    def restore(self, snap: dict[str, Any]) -> None:
        """Put back a ``snapshot`` (bit-identical weights, optimizer state and counters). Local."""
        state.restore(self.engine, snap)
        self.optimizer_steps = snap["optimizer_steps"]
        if self.capture is not None and "steps" in self.capture:
            del self.capture["steps"][snap["captured"] :]
