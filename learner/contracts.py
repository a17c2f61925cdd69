"""Contracts of the learner service: the padded batches it trains on.

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
        advantages: float32 ``[N]``, one advantage per sequence (group-relative).
        rewards: float32 ``[N]`` (NaN = invalid sample), for metrics.
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
