"""The learner's steps: one RL update on a rollout batch (GSPO and the options beside it), one SFT step.

``RolloutBatchStep(replica, ...).run()`` is the RL update, in named phases:

1. ``pre_update_pass``: learner log-probs at the current weights (the behaviour policy for
   ``old_logprob_source="recompute"``, and under ``auto`` once a check step found the engine's too far from
   them: ``learner.old_logprobs``), the train-vs-rollout log-prob difference, the policy's entropy and,
   on MoE models, the experts every token is routed to (expert load, routing volatility, Routing Replay).
   It runs only when something needs it (``learner.pre_update_pass``, ``LearnerConfig.pre_update_pass_needs``);
   skipped, ``rollout_checks`` only counts non-finite rollout log-probs for the guard, and the metrics the
   pass produces (``actor/entropy``, ``actor/train_rollout_logprob_diff``, ``moe/*``) are absent. With
   ``learner.fuse_first_minibatch`` (``fuses_first_minibatch``) it skips the first minibatch, whose training
   forwards run at those same weights (no optimizer step comes before them): their detached log-probs are its
   behaviour log-probs and feed its metrics, which are all-reduced after training;
2. the health guard's pre-update check (``learner.health.GuardDecision``) and, when the guard is on, an
   exact snapshot of the training state;
3. ``train``: ``ppo_epochs`` passes over the minibatches, one optimizer step each (micro-batches with the
   global normalisers, ``learner.objectives.policy_loss``, optional KL to the reference policy);
4. ``metrics``: every statistic aggregated exactly over micro-batches, minibatches, epochs and ranks;
5. the guard's verdict: a refused step is undone bit for bit.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from learner.contracts import BY_LENGTH_KEY, RolloutTrainResult, SFTBatch, SFTStepResult, TrainBatch
from learner.critic import Critic
from learner.health import GuardDecision
from learner.logprobs import token_log_probs
from learner.microbatch import MicroBatch, length_order
from learner.token_digests import trained_turn_digests
from learner.moe import (expert_counts, load_metrics, response_positions, rollout_replay_ids, topk_set_changes,
                         volatility_metrics)
from learner.config import PRE_UPDATE_GUARD_KEYS
from learner.old_logprobs import CHECK, RECOMPUTE, ROLLOUT, STEP_SOURCES, gap_too_large, mean_gap
from learner.kl import kl_penalty
from learner.objectives import LOG_RATIO_CLAMP, Objective, SequenceCounts, policy_loss, sequence_log_ratio
from learner.policy_metrics import combine_policy_metrics
from learner.replica import Replica
from learner.rollout_correction import mismatch_metrics, mismatch_sums, rollout_correction

log = logging.getLogger(__name__)

_EMPTY_POLICY_METRICS = {
    "clip_fraction": 0.0, "clip_fraction_low": 0.0, "clip_fraction_high": 0.0, "ratio_mean": 1.0,
    "ratio_min": 1.0, "ratio_max": 1.0, "log_ratio_abs_max": 0.0, "num_tokens": 0.0,
}


def _rollout_nonfinite(mb: TrainBatch) -> float:
    """Non-finite rollout (behaviour) log-probs on ``mb``'s response tokens."""
    return float((~torch.isfinite(mb.old_log_probs) & mb.response_mask.bool()).sum())


@dataclass
class _PassSums:
    """This rank's sums of the pre-update pass's metrics over the micro-batches accounted so far."""

    load: torch.Tensor  # [layers, experts] float64 expert counts on response tokens (MoE diagnostics)
    diff: list[float] = field(default_factory=lambda: [0.0, 0.0])  # sum |lp - rollout lp|, response tokens
    ent: float = 0.0
    nonfinite: float = 0.0
    mismatch: list[float] = field(default_factory=lambda: [0.0, 0.0])  # top-k sets differing from the engine's, compared
    mm_sum: list[float] = field(default_factory=lambda: [0.0] * 5)  # learner/rollout_correction.mismatch_sums, summed
    mm_max: list[float] = field(default_factory=lambda: [0.0, 0.0])  # ... and maxed
    fresh: list[float] = field(default_factory=lambda: [0.0, 0.0])  # check step: diff sums on the current version's rows


@dataclass
class _Totals:
    """This rank's running sums over the optimizer steps of one rollout batch."""

    loss_sum: float = 0.0
    kl_sum: float = 0.0
    seq_sum: float = 0.0
    seq_count: float = 0.0
    seq_min: float = math.inf
    seq_max: float = -math.inf
    grad_norms: list[float] = field(default_factory=list)
    step_losses: list[float] = field(default_factory=list)  # loss of each optimizer step (this rank's part)
    parts: list[dict[str, float]] = field(default_factory=list)  # policy_loss metrics of every micro-batch
    vol_local: list[list[float]] = field(default_factory=list)  # per measured pass: [changed used, changed own, compared]
    vol_updates: list[int] = field(default_factory=list)  # optimizer steps before each measured pass
    # response length -> [sequences, sum of s_i, clipped units, units], over every optimizer step
    by_length: dict[int, list[float]] = field(default_factory=dict)


class RolloutBatchStep:
    """One RL update on a rollout batch; see ``learner.service.LearnerRank.train_rollout_batch`` for the
    arguments, the result returned and the errors raised. Collective: every rank runs it on its shard."""

    def __init__(self, replica: Replica, minibatches: list[TrainBatch], num_sequences: list[int],
                 num_tokens: list[int], guard: dict[str, float] | None, objective: Objective, critic: Critic | None = None,
                 monitor: bool | None = None, behaviour: str | None = None, current_version: int | None = None):
        self.r, self.cfg = replica, replica.cfg
        self.monitor = monitor  # the driver's decision for the mismatch monitor; None = this rank's own count
        self.source = self.step_source(behaviour)  # rollout | recompute | check (learner.old_logprobs)
        self.recompute = self.source == RECOMPUTE  # behaviour log-probs from the pass; a check step may set it
        # check step: the rows whose gap decides are those sampled wholly by the weights the learner holds now
        # (``LearnerRank.current_version``; None: the batch's newest version, over all ranks)
        self.fresh_version = -1.0 if current_version is None else float(current_version)
        self.version_given = current_version is not None
        self.guard = GuardDecision(guard)
        replica.check_normalisers(minibatches, num_sequences, num_tokens)
        if self.cfg.group_by_length:  # longest rows first: micro-batches of like length pad little
            minibatches = [mb.select(length_order(mb.attention_mask)) for mb in minibatches]
        self.minibatches, self.num_sequences, self.num_tokens = minibatches, num_sequences, num_tokens
        self.objective = objective
        self.tap = replica.tap
        self.moe_diag = self.tap is not None and self.cfg.moe_diagnostics
        self.run_pre_update = self.pre_update_decision()
        self.t = _Totals()
        self.pre_lps: list[list[torch.Tensor]] = [[] for _ in minibatches]  # per minibatch and micro-batch
        self.routes: list[list[torch.Tensor]] = []
        # per minibatch and micro-batch: (weights, kept)
        self.corrections: list[list[tuple[torch.Tensor | None, torch.Tensor]]] = [[] for _ in minibatches]
        self.nonfinite = 0.0
        self.critic = critic  # PPO's value model (learner/critic.py), or None
        self.token_adv: list[list[torch.Tensor]] = []  # PPO: GAE advantages per minibatch and micro-batch
        self.fused = self.fuses_first_minibatch()
        n_layers, n_experts = (len(self.tap.layers), self.tap.num_experts) if self.tap is not None else (0, 0)
        self.sums = _PassSums(load=torch.zeros((n_layers, n_experts), dtype=torch.float64))
        self.entropy_den = max(float(sum(int(t) for t in num_tokens)), 1.0)
        self.trained_turns: list[tuple[int, int, str]] = []  # (context_len, sampled_len, digest) per trained turn

    def run(self) -> RolloutTrainResult:
        """The phases in order; returns the step's result (the same on every rank), built from its metrics dict by
        ``RolloutTrainResult.from_metrics``."""
        self.r.start_update()
        out = self.pre_update_pass() if self.run_pre_update else self.rollout_checks()
        if self.source == CHECK:  # the whole batch's gap is known before any update: choose the behaviour log-probs
            out.update(self.check_gap())
        out["actor/old_logprob_recomputed"] = float(self.recompute)
        if self.critic is not None:  # PPO: values, GAE and whitening before any update
            self.token_adv, critic_metrics = self.critic.prepare(self)
            out.update(critic_metrics)
        refused = self.guard.refuse_before_update(out, self.nonfinite)
        counts = self.r.aligned_counts([len(self.r.slices(mb)) for mb in self.minibatches])
        snapshot = self.r.snapshot() if self.guard.on and not refused else None
        trains = not refused and (self.critic is None or self.critic.policy_trains())  # the same on every rank
        if trains:
            self.train(counts)
        if self.fused:  # the first minibatch's part came from its training forwards, or comes now if none ran
            if not trains:  # (not by this rank's pre_lps[0]: a rank whose shard of it is empty must join too)
                self.account_minibatch(0)
            out.update(self.pass_metrics())
        out.update(self.metrics())
        if self.guard.on:
            out.update(self.guard_verdict(out, snapshot))
        if self.critic is not None and not refused and not out.get("health/skipped"):
            out.update(self.critic.train(self))  # only when the policy's update is kept
        return RolloutTrainResult.from_metrics(out)

    # -- phase 1 ------------------------------------------------------------------------------------------
    def step_source(self, behaviour: str | None) -> str:
        """This step's behaviour log-probs' source (``learner.old_logprobs.STEP_SOURCES``): the caller's
        (the driver's, ``learner.old_logprobs.step_source``), or without one ``learner.old_logprob_source``,
        ``auto`` read as ``rollout`` (the switch is the driver's state, checkpointed there).

        Raises:
            ValueError: a ``behaviour`` not in ``STEP_SOURCES``.
        """
        if behaviour is None:
            return RECOMPUTE if self.cfg.old_logprob_source == RECOMPUTE else ROLLOUT
        if behaviour not in STEP_SOURCES:
            raise ValueError(f"behaviour={behaviour!r} is not one of {STEP_SOURCES}")
        return behaviour

    def check_gap(self) -> dict[str, Any]:
        """A check step's decision, after the pass: the gap over the response tokens of the rows sampled wholly
        by the weights the learner holds (``fresh_version``: a row's version is its oldest token's, so with
        partial rollouts or a rollout sampled ahead a row of an older version, whose gap would hold that
        version's policy change, is left out), all-reduced, against ``learner.max_rollout_logprob_gap``; above
        it (``gap_too_large``) this step trains on the recomputed log-probs. No such row: nothing measured, no
        switch. The flag is max-reduced, so every rank takes the same decision. Returns
        ``actor/old_logprob_gap`` and ``actor/old_logprob_gap_tokens`` (the tokens it was measured on).
        Collective."""
        abs_sum, count = self.r.all_reduce(self.sums.fresh)
        gap = mean_gap(abs_sum, count)
        (flag,) = self.r.all_reduce([float(gap_too_large(gap, self.cfg.max_rollout_logprob_gap))], "max")
        self.recompute = flag > 0
        return {"actor/old_logprob_gap": gap, "actor/old_logprob_gap_tokens": count}

    def pre_update_decision(self) -> bool:
        """Whether this step runs the pre-update pass: ``learner.pre_update_pass`` ``always``; ``auto`` when
        ``pre_update_pass_needs`` names a setting (recompute, Routing Replay, MoE diagnostics on an MoE model,
        a guard pre-check) or when the mismatch monitor is due (``monitor_due``); ``never`` otherwise.

        Raises:
            ValueError: ``never`` with a guard pre-check threshold (the config refuses the other settings).
        """
        needs = self.cfg.pre_update_pass_needs(self.guard.guard, is_moe=self.tap is not None)
        if self.source != ROLLOUT and not needs:  # auto's check, or its switch to the learner's log-probs
            needs = [f"learner.old_logprob_source='auto' ({self.source} on this step)"]
        if self.cfg.pre_update_pass == "never" and needs:
            raise ValueError(
                "learner.pre_update_pass='never', but " + ", ".join(needs) + " need(s) the pre-update pass; use "
                "learner.pre_update_pass='auto' or remove those thresholds"
            )
        monitor = self.monitor_due()  # counted on every batch
        return self.cfg.pre_update_pass == "always" or bool(needs) or monitor

    def monitor_due(self) -> bool:
        """``auto`` with ``learner.mismatch_monitor_every`` N > 0: whether the mismatch monitor's pass runs on
        this batch. The caller's decision when it passed ``monitor`` (the driver: RL steps 1, N+1, 2N+1, ...,
        see ``cluster.driver.trainer.monitor_step``); otherwise this rank's rollout batch 1, N+1, 2N+1, ...
        since it started (counted here, the same on every rank: each counts the collective calls it took part
        in)."""
        n, self.r.rollout_batches = self.r.rollout_batches, self.r.rollout_batches + 1
        if self.monitor is None:
            return self.cfg.monitor_at(n)
        return self.monitor and self.cfg.monitor_at(0)  # the caller's decision, where the monitor is on at all

    def rollout_checks(self) -> dict[str, Any]:
        """Instead of the pre-update pass: with the guard on, count the non-finite rollout log-probs on response
        tokens over all ranks (a non-finite learner log-prob is caught in training as ``nonfinite_loss`` and
        undone). No forward, no metrics. Collective when the guard is on."""
        if self.guard.on:
            (self.nonfinite,) = self.r.all_reduce([sum(_rollout_nonfinite(mb) for mb in self.minibatches)])
        return {}

    def wants_routes(self) -> bool:
        """Whether the pre-update pass records the routers' experts (an MoE model with MoE diagnostics, Routing
        Replay, or engine routing in the batch to compare with); otherwise its forwards, and the training
        forwards after it, may run packed."""
        return self.tap is not None and (self.moe_diag or self.cfg.routing_replay != "off"
                                         or any(mb.rollout_routes is not None for mb in self.minibatches))

    def fuses_first_minibatch(self) -> bool:
        """Whether the pre-update pass leaves the first minibatch to its training forwards
        (``learner.fuse_first_minibatch``): only when the pass runs and nothing needs that minibatch's results
        before it trains: no routes recorded (``wants_routes``), no PPO critic, no health-guard pre-check on the
        pass's metrics, and no LoRA dropout (the training forward would be another policy than the pass's)."""
        guard = self.guard.guard or {}
        return (self.run_pre_update and self.cfg.fuse_first_minibatch and self.source != CHECK
                and not self.wants_routes()
                and self.critic is None and not any(k in guard for k in PRE_UPDATE_GUARD_KEYS)
                and not self.cfg.lora.dropout)

    def pre_update_pass(self) -> dict[str, Any]:
        """Forward every minibatch (not the first when ``self.fused``) at the current weights and account its
        metrics. Returns entropy, log-prob difference and (MoE) expert-load metrics, all-reduced; when fused,
        ``{}`` (``pass_metrics`` after training), with the guard's non-finite count of the minibatches
        forwarded plus the first one's rollout log-probs all-reduced into ``self.nonfinite``. Collective."""
        if self.source == CHECK and not self.version_given:  # the rows of the newest version on any rank
            mine = [float(mb.weight_versions.max()) for mb in self.minibatches if mb.weight_versions.numel()]
            (self.fresh_version,) = self.r.all_reduce([max(mine, default=-1.0)], "max")
        for m in range(1 if self.fused else 0, len(self.minibatches)):
            self.account_minibatch(m)
        if not self.fused:
            return self.pass_metrics()
        if self.guard.on:
            (self.nonfinite,) = self.r.all_reduce([self.sums.nonfinite + _rollout_nonfinite(self.minibatches[0])])
        return {}

    def account_minibatch(self, m: int) -> None:
        """The pre-update forwards of minibatch ``m`` (no gradient, in minibatch order): its log-probs in
        ``pre_lps[m]``, routes (when ``wants_routes``) appended to ``routes``, its corrections and metric sums
        accounted. Collective."""
        mb_routes: list[torch.Tensor] | None = [] if self.wants_routes() else None
        micros, lps, ent = self.r.inference_pass(self.minibatches[m], collective=True,
                                                 entropy_den=self.entropy_den, routes=mb_routes)
        self.sums.ent += ent
        self.pre_lps[m] = lps
        if mb_routes is not None:  # recorded: the training forwards run under the tap (padded)
            self.routes.append(mb_routes)
        for k, (micro, lp) in enumerate(zip(micros, lps)):
            self.account_micro(m, micro, lp, mb_routes[k] if mb_routes is not None else None)

    def account_micro(self, m: int, micro: MicroBatch, lp: torch.Tensor, routes: torch.Tensor | None) -> None:
        """Account one micro-batch of minibatch ``m``, its behaviour log-probs ``lp`` (float32 ``[b, w-1]``,
        detached, 0 outside ``micro.mask``): the log-prob difference to the engine's, the mismatch correction
        (appended to ``corrections[m]``), the mismatch sums, non-finite values (guard on) and, with the routers'
        ``routes`` (``[layers, b*w, k]``), expert counts and the routing mismatch against the engine's."""
        s, tap = self.sums, self.tap
        s.diff[0] += float(torch.where(micro.mask, (lp - micro.old_log_probs).abs(), 0.0).double().sum())
        s.diff[1] += float(micro.mask.sum())
        if self.source == CHECK:
            lo, hi = micro.rows
            rows = self.minibatches[m].weight_versions[lo:hi].to(micro.mask.device) == self.fresh_version
            fresh = micro.mask & rows[:, None]
            s.fresh[0] += float(torch.where(fresh, (lp - micro.old_log_probs).abs(), 0.0).double().sum())
            s.fresh[1] += float(fresh.sum())
        weights, kept, dropped = rollout_correction(lp, micro.old_log_probs, micro.mask, self.cfg.rollout_correction,
                                                    self.cfg.rollout_correction_low, self.cfg.rollout_correction_high)
        self.corrections[m].append((weights, kept))
        sums = mismatch_sums(lp, micro.old_log_probs, micro.mask, dropped)
        s.mm_sum = [a + b for a, b in zip(s.mm_sum, sums[:2] + sums[4:])]
        s.mm_max = [max(a, b) for a, b in zip(s.mm_max, sums[2:4])]
        if self.guard.on:
            bad = ~(torch.isfinite(lp) & torch.isfinite(micro.old_log_probs))
            s.nonfinite += float((bad & micro.mask).sum())
        if routes is None:
            return
        positions = response_positions(micro.mask).cpu()
        if self.moe_diag:
            s.load += expert_counts(routes, positions, tap.num_experts)
        if micro.rollout_routes is not None:
            changed, compared = topk_set_changes(routes, rollout_replay_ids(micro.rollout_routes, tap.top_k), positions)
            s.mismatch[0], s.mismatch[1] = s.mismatch[0] + changed, s.mismatch[1] + compared

    def pass_metrics(self) -> dict[str, Any]:
        """The pass's metrics from ``self.sums``, all-reduced (sets ``self.nonfinite``). Collective."""
        s, tap = self.sums, self.tap
        pre = self.r.all_reduce([*s.diff, s.ent, s.nonfinite, *s.mismatch] + s.load.reshape(-1).tolist())
        diff_sum, diff_count, ent_sum, self.nonfinite = pre[:4]
        out: dict[str, Any] = {
            "actor/entropy": ent_sum,
            "actor/train_rollout_logprob_diff": diff_sum / diff_count if diff_count else 0.0,
        }
        if pre[5] > 0:
            out["moe/rollout_routing_mismatch"] = pre[4] / pre[5]
        mm = self.r.all_reduce(s.mm_sum)
        out.update(mismatch_metrics(mm[:2] + [0.0, 0.0] + mm[2:], self.r.all_reduce(s.mm_max, "max")))
        if self.moe_diag:
            counts = torch.tensor(pre[6:], dtype=torch.float64).reshape(s.load.shape)
            out.update(load_metrics(counts, tap.layers))
        return out

    # -- phase 3 ------------------------------------------------------------------------------------------
    def train(self, counts: list[int]) -> None:
        """``ppo_epochs`` passes over the minibatches, one optimizer step each; stops early when the guard says."""
        for epoch in range(self.cfg.ppo_epochs):
            for m, batch in enumerate(self.minibatches):
                if self.train_minibatch(m, batch, counts[m], first_epoch=epoch == 0):
                    return

    def train_minibatch(self, m: int, batch: TrainBatch, n_passes: int, first_epoch: bool = True) -> bool:
        """Accumulate the gradient of minibatch ``m`` over ``n_passes`` micro-batch passes (zero-weighted
        passes beyond this rank's share) and take one optimizer step. Returns True when the guard stops. In the
        first epoch each micro-batch's sampled turns are digested for the token check (``trained_turns``)."""
        engine, t = self.r.engine, self.t
        slices = self.r.slices(batch)
        updates = len(t.grad_norms)  # optimizer steps applied in this call so far
        measure = self.moe_diag and updates >= 1
        vol = [0.0, 0.0, 0.0]
        bad_loss, step_loss = False, 0.0
        for k in range(n_passes):
            self.r.before_micro_batch()
            engine.set_gradient_accumulation_boundary(k == n_passes - 1)
            if k >= len(slices):
                self.r.dummy_pass(with_grad=True)
                continue
            mb = MicroBatch(batch, *slices[k], self.r.device, "response_mask")
            if first_epoch:  # what this micro-batch trains, digested as the engines digest what they sampled
                self.trained_turns += trained_turn_digests(mb.input_ids, mb.mask)
            loss, finite = self.micro_batch_backward(m, k, mb, measure, vol)
            step_loss += loss
            bad_loss = bad_loss or not finite
        norm = self.r.optimizer_step()
        t.grad_norms.append(norm)
        t.step_losses.append(step_loss)
        if measure:
            t.vol_local.append(vol)
            t.vol_updates.append(updates)
        return self.guard.stop_after_optimizer_step(bad_loss, norm, self.r.all_reduce)

    def micro_batch_backward(self, m: int, k: int, mb: MicroBatch, measure: bool, vol: list[float]) -> tuple[float, bool]:
        """Forward, loss and backward of micro-batch ``k`` of minibatch ``m``. Returns (the policy loss, whether
        the total loss is finite)."""
        cfg, t = self.cfg, self.t
        behaviour_pass = m == 0 and self.fused and k == len(self.pre_lps[0])  # fused, first epoch
        lp, ent = self.forward(m, k, mb, measure, vol, entropy_den=self.entropy_den if behaviour_pass else None)
        if behaviour_pass:  # at the behaviour weights: its own behaviour log-probs and pass metrics
            self.pre_lps[0].append(torch.where(mb.mask, lp.detach(), 0.0))
            self.sums.ent += ent
            self.account_micro(0, mb, self.pre_lps[0][k], None)
        old = self.pre_lps[m][k] if self.recompute else mb.old_log_probs
        norms = dict(num_sequences=self.num_sequences[m], num_tokens=self.num_tokens[m])
        # mismatch correction (off: weights None, kept = the response mask); normalisers stay the minibatch's
        weights, kept = self.corrections[m][k] if cfg.rollout_correction != "off" else (None, mb.mask)
        adv = self.token_adv[m][k] if self.token_adv else mb.advantages  # PPO: GAE advantages [b, w-1]
        result = policy_loss(lp, old, adv, kept, self.objective, token_weights=weights, **norms)
        loss, metrics = result.loss, result.metrics
        value = float(loss.detach())
        t.loss_sum += value
        if self.r.ref_model is not None:
            with torch.no_grad():
                ref_lp, _ = self.r.log_probs(self.r.ref_model, mb)
            kl = kl_penalty(lp, ref_lp, mb.mask, cfg.kl_estimator, loss_agg=self.objective.loss_agg, **norms)
            t.kl_sum += float(kl.detach())
            loss = loss + cfg.kl_coef * kl
        finite = math.isfinite(float(loss.detach()))
        if self.guard.on:  # a non-finite learner log-prob the clamps would hide (e.g. -inf) fails the step too
            finite = finite and bool(torch.isfinite(lp.detach()[mb.mask]).all())
        # DeepSpeed averages gradients over the ranks: x world_size turns that into the sum.
        self.r.before_backward()
        self.r.engine.backward(loss * self.r.world_size, scale_wrt_gas=False)
        t.parts.append(metrics)
        self.sequence_ratio_stats(lp.detach(), old, mb.mask, result.per_sequence)
        return value, finite

    def forward(self, m: int, k: int, mb: MicroBatch, measure: bool, vol: list[float],
                entropy_den: float | None = None) -> tuple[torch.Tensor, float]:
        """Training forward of micro-batch ``k`` of minibatch ``m``: the ``[b, w-1]`` log-probs (``Replica.log_probs``:
        packed with ``learner.pack_sequences``; with ``entropy_den`` also its entropy sum, else 0.0), or, when the
        pre-update pass recorded routes, a padded forward under the router tap with Routing Replay when configured
        (R2: the pre-update pass's experts; R3: the engine's) that adds the routing changes against the routers'
        own pre-update choice to ``vol`` when ``measure`` (entropy 0.0: the pass measured it)."""
        r, tap = self.r, self.tap
        if tap is None or not self.routes:
            return r.log_probs(r.engine, mb, entropy_den=entropy_den)
        before = self.routes[m][k]
        mode = self.cfg.routing_replay
        replay = before if mode == "learner" else r.rollout_replay(mb) if mode == "rollout" else None
        with tap.capture(replay=replay) as record:
            logits = r.logits(r.engine, mb.input_ids, mb.attention_mask)
        if measure:
            sel = response_positions(mb.mask).cpu()
            used, _ = topk_set_changes(record.used_tensor().cpu(), before, sel)
            own, compared = topk_set_changes(record.router_tensor().cpu(), before, sel)
            vol[0], vol[1], vol[2] = vol[0] + used, vol[1] + own, vol[2] + compared
        return token_log_probs(logits, mb.targets, r.temperature), 0.0

    @torch.no_grad()
    def sequence_ratio_stats(self, lp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor,
                             per_seq: SequenceCounts) -> None:
        """Accumulate GSPO's sequence ratio ``s_i`` (Eq. 7) of the sequences with response tokens, and per
        response length the sequences, ``s_i`` and the clip counts of ``per_seq`` (``policy_loss``)."""
        has = mask.any(-1)
        if not bool(has.any()):
            return
        s = torch.exp(sequence_log_ratio(lp, old, mask).double().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))[has]
        t = self.t
        rows = zip(per_seq.length[has].tolist(), s.tolist(), per_seq.clipped[has].tolist(),
                   per_seq.units[has].tolist())
        for length, ratio, clipped, units in rows:
            acc = t.by_length.setdefault(int(length), [0.0, 0.0, 0.0, 0.0])
            acc[0], acc[1], acc[2], acc[3] = acc[0] + 1, acc[1] + ratio, acc[2] + clipped, acc[3] + units
        t.seq_sum += float(s.sum())
        t.seq_count += float(s.numel())
        t.seq_min = min(t.seq_min, float(s.min()))
        t.seq_max = max(t.seq_max, float(s.max()))

    # -- phase 4 ------------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """The step's statistics, aggregated exactly over ranks. Collective."""
        r, t, cfg = self.r, self.t, self.cfg
        steps = len(t.grad_norms)
        step_losses = r.all_reduce(t.step_losses) if t.step_losses else []
        sums = r.all_reduce([t.loss_sum, t.kl_sum, t.seq_sum, t.seq_count] + [v for row in t.vol_local for v in row])
        loss_sum, kl_sum, seq_sum, seq_count = sums[:4]
        vol_tot = [sums[4 + 3 * i : 7 + 3 * i] for i in range(len(t.vol_local))]
        seq_min = r.all_reduce([t.seq_min], "min")[0]
        seq_max = r.all_reduce([t.seq_max], "max")[0]
        gathered = r.all_gather_objects((t.parts, t.by_length))
        all_parts = [p for rank_parts, _ in gathered for p in rank_parts]
        by_length: dict[int, list[float]] = {}
        for _, rank_lengths in gathered:  # exact sums over ranks
            for length, vals in rank_lengths.items():
                acc = by_length.setdefault(length, [0.0, 0.0, 0.0, 0.0])
                by_length[length] = [a + v for a, v in zip(acc, vals)]
        pm = combine_policy_metrics(all_parts) if all_parts else _EMPTY_POLICY_METRICS
        out: dict[str, Any] = {
            "loss/policy": loss_sum / max(steps, 1),
            "loss/policy_minibatches": [float(x) for x in step_losses],  # per optimizer step, summed over ranks
            **{f"actor/{k}": pm[k] for k in ("clip_fraction", "clip_fraction_low", "clip_fraction_high",
                                             "ratio_mean", "ratio_min", "ratio_max", "log_ratio_abs_max")},
            "actor/seq_ratio_mean": seq_sum / seq_count if seq_count else 1.0,
            "actor/seq_ratio_min": seq_min if seq_count else 1.0,
            "actor/seq_ratio_max": seq_max if seq_count else 1.0,
            "actor/grad_norm": sum(t.grad_norms) / len(t.grad_norms) if t.grad_norms else 0.0,
            "actor/grad_norm_max": max(t.grad_norms) if t.grad_norms else 0.0,
            "actor/lr": float(r.base_optimizer().param_groups[0]["lr"]),
            "actor/num_optimizer_steps": float(steps),
            "actor/num_response_tokens": float(pm["num_tokens"]) / max(cfg.ppo_epochs, 1),
            # per response length: [sequences, sum of s_i, clipped units, units] (cluster.driver.length_slices)
            BY_LENGTH_KEY: dict(sorted(by_length.items())),
        }
        if r.ref_model is not None:
            out["loss/kl"] = kl_sum / max(steps, 1)
        if r.elastic is not None:  # torch threads over the update's time, the mean over the ranks
            n, total = r.all_reduce([1.0, r.elastic.mean_threads()])
            out["perf/learner_threads_mean"] = total / n
        if self.moe_diag:
            out.update(volatility_metrics(vol_tot, t.vol_updates))
        return out

    # -- phase 5 ------------------------------------------------------------------------------------------
    def guard_verdict(self, out: dict[str, Any], snapshot: dict[str, Any] | None) -> dict[str, Any]:
        """Apply the guard's verdict: a refused step's optimizer steps are undone from ``snapshot``."""
        steps = len(self.t.grad_norms)
        skip, health = self.guard.verdict(out, self.t.grad_norms, snapshot is not None,
                                          self.r.all_reduce)
        if skip and snapshot is not None:
            self.r.restore(snapshot)
        if skip:
            out["actor/num_optimizer_steps"] = 0.0
            log.warning("health guard: step skipped (%s)", health["health/reasons"])
        return {
            "health/skipped": health["health/skipped"],
            "health/steps_undone": float(steps) if skip else 0.0,
            "health/failed_checks": health["health/failed_checks"],
            "health/reasons": health["health/reasons"],
            "health/nonfinite_log_probs": float(self.nonfinite),
        }


def sft_step(r: Replica, batch: SFTBatch, num_tokens: int) -> SFTStepResult:
    """One optimizer step of token-mean cross-entropy; see ``LearnerRank.sft_step``. Collective."""
    (tot,) = r.all_reduce([float(batch.loss_mask.sum())])
    if int(tot) != int(num_tokens):
        raise ValueError(f"num_tokens={num_tokens!r} but the ranks' SFT shards hold {int(tot)} loss tokens")
    den = max(float(num_tokens), 1.0)
    slices = r.slices(batch)
    (n_passes,) = r.aligned_counts([len(slices)])
    loss_sum = 0.0
    for k in range(n_passes):
        r.engine.set_gradient_accumulation_boundary(k == n_passes - 1)
        if k >= len(slices):
            r.dummy_pass(with_grad=True)
            continue
        mb = MicroBatch(batch, *slices[k], r.device, "loss_mask")
        lp, _ = r.log_probs(r.engine, mb, temperature=1.0)
        loss = -torch.where(mb.mask, lp, 0.0).sum() / den
        loss_sum += float(loss.detach())
        r.engine.backward(loss * r.world_size, scale_wrt_gas=False)
    norm = r.optimizer_step()
    (loss_total,) = r.all_reduce([loss_sum])
    return SFTStepResult(loss=loss_total, grad_norm=norm, lr=float(r.base_optimizer().param_groups[0]["lr"]),
                         num_tokens=int(num_tokens))
