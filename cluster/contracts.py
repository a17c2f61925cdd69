"""Data contracts passed between the services (driver, rollout, reward, learner).

Every object that crosses a service boundary (a Ray actor call) is one of these dataclasses. They hold
plain Python values or CPU tensors only, so they pickle cheaply through the Ray object store, and they
import nothing from Ray, vLLM or DeepSpeed.

Flow of one step::

    PromptRow --(rollout)--> Completion --(reward)--> RewardResult
        --(driver: group advantages, padding)--> TrainBatch --(learner)--> metrics dict
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class PromptRow:
    """One dataset row, ready for rollout and verification.

    Attributes:
        uid: stable identifier of the row (unique within its dataset split), used to check that every prompt
            of a step is trained on exactly once.
        prompt: the prompt text given to the model (already formatted).
        prompt_token_ids: token ids of ``prompt`` (no padding), as the rollout engine receives them.
        answer: the reference answer the verifier compares against (text).
        verifier: name of the verifier that scores this row (for example ``"exact"``, ``"math"``, ``"code"``).
        meta: any extra fields of the row the verifier needs (for example unit tests for ``code``).
    """

    uid: str
    prompt: str
    prompt_token_ids: list[int]
    answer: str
    verifier: str = "exact"
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Completion:
    """One sampled response to one prompt, produced by a rollout engine.

    Attributes:
        prompt_uid: ``PromptRow.uid`` of the prompt.
        sample_index: index of this completion within its group, in ``[0, group_size)``.
        prompt_token_ids: the prompt's token ids (length P).
        response_token_ids: the sampled token ids (length R, R >= 0; includes the EOS token when the
            response stopped on it).
        response_logprobs: behaviour-policy log-probabilities of each sampled token, float, length R, in
            post-temperature form: ``log softmax(logits / temperature)[token]`` (natural log, nats).
        response_text: the decoded response (special tokens removed).
        finish_reason: ``"stop"`` (EOS or a stop string) or ``"length"`` (cut at the response limit).
        weight_version: version of the weights that generated it (0 = initial weights, +1 per sync).
    """

    prompt_uid: str
    sample_index: int
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]
    response_text: str
    finish_reason: str
    weight_version: int

    @property
    def truncated(self) -> bool:
        """True when the response was cut at the length limit."""
        return self.finish_reason == "length"


@dataclass
class RewardRequest:
    """One completion to score: the response text and the row it answers."""

    response: str
    row: PromptRow
    num_response_tokens: int = 0
    truncated: bool = False


@dataclass
class RewardResult:
    """The verdict on one completion.

    Attributes:
        score: the reward (float). NaN marks an invalid sample (verifier failure where training should not
            treat it as wrong); it gets advantage 0 and is left out of its group's statistics.
        correct: whether the primary verifier judged the answer right (for the accuracy metric).
        status: ``"ok"``, ``"timeout"`` or ``"error"``.
        detail: short reason for a non-ok status, or extra fields a verifier returned.
        elapsed_s: wall-clock seconds spent verifying.
    """

    score: float
    correct: bool = False
    status: str = "ok"
    detail: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def valid(self) -> bool:
        """False when the score is NaN (an invalid sample)."""
        return not math.isnan(self.score)


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
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    prompt_uids: list[str]
    weight_versions: torch.Tensor

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
