"""Contracts of the learner service: the padded batches it trains on, and what its steps and syncs return.

Tensors on the CPU; they cross Ray actor calls through the object store (see ``rollout.contracts`` for the
flow of one step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class TrainBatch:
    """A padded batch for the learner. N sequences, each ``prompt + response``, right-padded to length L.

    Targets are aligned with the model's next-token predictions: position ``t`` of every ``[N, L-1]``
    tensor describes token ``input_ids[:, t + 1]``, predicted from the logits at position ``t``.

    Attributes:
        input_ids: int64 ``[N, L]``, prompt then response tokens then padding (``pad_token_id``).
        attention_mask: int64 ``[N, L]``, 1 on real tokens, 0 on padding.
        response_mask: bool ``[N, L-1]``, True where the target token is a response token that counts in
            the loss.
        old_log_probs: float32 ``[N, L-1]``, behaviour-policy log-probs of the target tokens (from the
            rollout engine); 0 outside ``response_mask``.
        advantages: float32 ``[N]``, one advantage per sequence (group-relative); or float32 ``[N, L-1]``, one
            per target token (aligned with ``response_mask``: position ``t`` is token ``t + 1``'s advantage; 0 on
            prompt and padding targets), only for ``gspo_token`` on multi-turn episodes with per-turn rewards
            (``learner.advantages.turn_token_advantages``; the losses take ``[B, T]`` advantages except ``gspo``).
        rewards: float32 ``[N]`` (NaN = invalid sample): each sequence's return, its reward plus any per-turn
            rewards of its episode (``cluster.driver.batching.rollout_advantages``); for metrics and PPO's critic.
        prompt_uids: length-N list of ``PromptRow.uid``.
        weight_versions: int64 ``[N]``, weight version that generated each sequence.
        rollout_routes: None, or int16 ``[N, L, layers, k]``: the experts the rollout engine's MoE layers ran
            for input position ``t`` (``Completion.routed_experts``), -1 where it ran none (padding, and the
            last token of each row, which is sampled but never fed back). For R3 replay.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    prompt_uids: list[str]
    weight_versions: torch.Tensor
    rollout_routes: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, index: torch.Tensor | list[int]) -> "TrainBatch":
        """The sub-batch of rows ``index`` (a 1-D index tensor or list), same field meanings."""
        idx = torch.as_tensor(index, dtype=torch.long)
        return TrainBatch(
            input_ids=self.input_ids[idx],
            attention_mask=self.attention_mask[idx],
            response_mask=self.response_mask[idx],
            old_log_probs=self.old_log_probs[idx],
            advantages=self.advantages[idx],
            rewards=self.rewards[idx],
            prompt_uids=[self.prompt_uids[i] for i in idx.tolist()],
            weight_versions=self.weight_versions[idx],
            rollout_routes=None if self.rollout_routes is None else self.rollout_routes[idx],
        )


@dataclass
class SFTBatch:
    """A padded supervised batch (warm start): cross-entropy on the response part only.

    Attributes:
        input_ids: int64 ``[N, L]``; attention_mask: int64 ``[N, L]``;
        loss_mask: bool ``[N, L-1]``, True where the target token ``input_ids[:, t+1]`` is trained on.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


#: The key of the per-length sums in the RL step's metrics as the learner builds them (``learner.step``) and in the
#: ratio audit's ``metrics.json``; ``RolloutTrainResult.by_response_length`` carries them, out of ``metrics``.
BY_LENGTH_KEY = "actor/by_response_length"


@dataclass(frozen=True)
class RolloutTrainResult:
    """What one RL update on a rollout batch did (``LearnerRank.train_rollout_batch``): the same on every rank,
    aggregated exactly over micro-batches, minibatches, epochs and ranks.

    The typed fields are what the driver acts on; ``metrics`` is the step's logged record, written to
    ``metrics.jsonl`` under these names as it stands (the values of ``loss``, ``optimizer_steps``, ``grad_norm``
    and the health fields are in it too, under ``loss/policy``, ``actor/num_optimizer_steps``,
    ``actor/grad_norm`` and ``health/*``). ``from_metrics`` builds both from the step's dict, so they agree.

    Attributes:
        loss: ``loss/policy``: the mean over the optimizer steps that ran of the minibatch's policy loss
            (dimensionless; 0.0 when no step ran).
        optimizer_steps: ``actor/num_optimizer_steps``: optimizer steps applied and kept (0 when the health guard
            refused the update).
        grad_norm: ``actor/grad_norm``: the mean over the optimizer steps that ran of the pre-clip global L2 norm
            of the gradient (0.0 when no step ran).
        skipped: ``health/skipped``: the health guard refused the step and the update was undone (False without a
            guard).
        failed_checks: ``health/failed_checks`` split at its commas: the names of the failing checks in the order
            they failed (``("nonfinite_log_probs",)``, ``("max_grad_norm",)``, ...); ``()`` when none failed or
            without a guard.
        reasons: ``health/reasons``: ``"; "``-joined ``name: metric=value > limit``; ``""`` when none.
        by_response_length: response length (tokens, EOS included) -> ``[sequences, sum of GSPO's sequence ratio
            s_i, clipped units, units]`` summed over the optimizer steps (units as in ``actor/clip_fraction``:
            sequences for GSPO, tokens for GRPO), for the driver's length slices (``cluster.driver.length_slices``);
            not logged.
        metrics: the open-ended logged metrics (``loss/*``, ``actor/*``, ``mismatch/*``, ``moe/*``, ``health/*``,
            PPO's ``critic/*``, ``perf/*``), names and meanings as ``LearnerRank.train_rollout_batch`` documents
            them: floats (losses and ratios dimensionless, ``actor/entropy`` and log-prob differences in nats,
            ``actor/num_response_tokens`` in tokens, counts as floats), besides ``loss/policy_minibatches`` (a
            list: the loss of each optimizer step), ``moe/expert_load`` and ``moe/layers`` (lists) and the
            ``health/failed_checks`` and ``health/reasons`` strings.
    """

    loss: float
    optimizer_steps: int
    grad_norm: float
    skipped: bool = False
    failed_checks: tuple[str, ...] = ()
    reasons: str = ""
    by_response_length: dict[int, list[float]] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_metrics(cls, metrics: dict[str, Any]) -> "RolloutTrainResult":
        """The result of a step whose metrics are ``metrics`` (``learner.step.RolloutBatchStep``'s dict, left
        unchanged): the per-length sums (``BY_LENGTH_KEY``) leave the logged record; the typed fields are read
        from it (absent health keys: no guard).

        Raises:
            KeyError: ``metrics`` lacks ``loss/policy``, ``actor/num_optimizer_steps`` or ``actor/grad_norm``.
        """
        logged = {k: v for k, v in metrics.items() if k != BY_LENGTH_KEY}
        checks = str(logged.get("health/failed_checks", ""))
        return cls(
            loss=float(logged["loss/policy"]),
            optimizer_steps=int(logged["actor/num_optimizer_steps"]),
            grad_norm=float(logged["actor/grad_norm"]),
            skipped=bool(logged.get("health/skipped", 0.0)),
            failed_checks=tuple(c for c in checks.split(",") if c),
            reasons=str(logged.get("health/reasons", "")),
            by_response_length=dict(metrics.get(BY_LENGTH_KEY, {})),
            metrics=logged,
        )

    def record(self) -> dict[str, Any]:
        """``metrics`` with the per-length sums under ``BY_LENGTH_KEY``: everything the learner returned, as the
        ratio audit's ``metrics.json`` keeps it (``cluster.driver.audit_dump.save_outputs``)."""
        return {**self.metrics, BY_LENGTH_KEY: dict(self.by_response_length)}


@dataclass(frozen=True)
class SFTStepResult:
    """What one supervised step did (``LearnerRank.sft_step``): the same on every rank.

    Attributes:
        loss: the token-mean cross-entropy of the whole step over all ranks, at temperature 1 (nats per loss
            token).
        grad_norm: the pre-clip global L2 norm of the step's gradient.
        lr: the learning rate of the first parameter group at the step.
        num_tokens: the loss tokens of the step over all ranks (the loss's normaliser).
    """

    loss: float
    grad_norm: float
    lr: float
    num_tokens: int


@dataclass
class PendingLoad:
    """The engines' side of a sync that learner rank 0 did not wait for (``sync.load_beside_learner``): the Ray
    object refs of each engine's calls, in the order they run on it. The driver waits for them before the engines
    sample again (``cluster.runtime.services.EngineFleet.settle``).

    Attributes:
        calls: engine index -> refs of ``start_weight_update``, each unanswered ``update_weights`` and
            ``finish_weight_update``, in that order.
        loads: engine index -> positions in ``calls[i]`` of the ``update_weights`` refs, bucket by bucket (their
            answers are ``rollout.contracts.BucketLoad``: the seconds of that engine's load).
    """

    calls: dict[int, list[Any]] = field(default_factory=dict)
    loads: dict[int, list[int]] = field(default_factory=dict)


@dataclass
class SyncReport:
    """What one weight sync did (``learner.weight_sync.sync_weights``, rank 0's view).

    Attributes:
        bytes: weight bytes loaded, summed over the engines that acknowledged each bucket.
        seconds: the sync's wall time on rank 0 (gather, conversion, sending, loads, start and finish; with
            ``pending``, up to the last bucket's put).
        buckets: buckets sent.
        engine_load_s: for each bucket the seconds the slowest acknowledging engine spent loading it, summed.
        transport: what carried the last bucket: ``"object_store"`` or ``"collective"``.
        fallback: why the collective transfer stopped mid-sync ('' if it did not).
        failed_engines: index in the engine list -> error text, for engines that died, failed or did not
            answer within ``sync.engine_timeout_s``: they got no further calls and are to be replaced.
        pending: with ``sync.load_beside_learner``, the engine calls rank 0 sent but did not wait for (``bytes``
            then counts their buckets as loaded and ``engine_load_s`` leaves them out); None otherwise.
        version: the weight version the engines were told (``LearnerRank.sync_weights``: the caller's, or the
            learner's own count when the caller passed None); -1 where unknown.
    """

    bytes: int = 0
    seconds: float = 0.0
    buckets: int = 0
    engine_load_s: float = 0.0
    transport: str = "object_store"
    fallback: str = ""
    failed_engines: dict[int, str] = field(default_factory=dict)
    pending: PendingLoad | None = None
    version: int = -1

    def metrics(self, wall_s: float) -> dict[str, float]:
        """The step metrics ``sync/*`` of this sync, ``wall_s`` being the driver's wall time for it (the
        learner's sync plus any engine replacement)."""
        return {"sync/bytes": float(self.bytes), "sync/seconds": wall_s,
                "sync/gb_per_s": self.bytes / wall_s / 1e9 if wall_s > 0 else 0.0,
                "sync/buckets": float(self.buckets), "sync/engine_load_s": float(self.engine_load_s),
                # 1 when the bytes went by broadcast to the end (sync.transport=collective), 0 otherwise
                "sync/collective": float(self.transport == "collective")}
