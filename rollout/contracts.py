"""Contracts of the rollout service: the prompt it is given and the completion it returns.

Plain dataclasses of Python values; they cross Ray actor calls (pickled through the object store) and import
nothing from Ray, vLLM or DeepSpeed. Flow of one step::

    PromptRow --(rollout)--> Completion --(reward: reward.contracts)--> RewardResult
        --(driver: group advantages, padding)--> TrainBatch (learner.contracts) --(learner)--> metrics dict
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


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
        routed_experts: None, or (``rollout.return_routed_experts``) int16 numpy ``[P + R - 1, layers, k]``:
            the expert ids each MoE layer of the engine ran for input position ``t`` (prompt then response
            tokens; the last sampled token is never fed back, so it has none), in the engine's layer order.
        token_versions: None (every token sampled by ``weight_version``), or, for a partial rollout that spanned
            weight syncs, the version that sampled each response token (length R; ``weight_version`` is then
            the oldest of them).
        response_mask: None (every response token was sampled by an engine), or, for a multi-turn episode, 1
            where the engine sampled the token and 0 where the environment's reply put it (length R): the loss,
            GSPO's length |y_i| and every per-token metric count the 1s only. ``response_logprobs`` holds 0.0 at
            the 0s.
        turn_starts: None (a single answer, or an episode without per-turn data), or, for a multi-turn episode,
            the index in ``response_token_ids`` where each sampled assistant turn starts (length K >= 1, non-decreasing,
            first 0, each <= R): turn k owns tokens ``turn_starts[k] .. turn_starts[k+1] - 1`` (the last turn: to
            R), its sampled tokens then the environment's reply after them. Set together with ``turn_rewards``.
        turn_rewards: None, or the environment's per-turn reward after each turn (``StepResult.reward``; length K,
            finite floats, 0.0 where it gave none). Not part of the episode's reward (``RewardResult.score``):
            ``gspo_token`` credits each turn with its reward-to-go, other algorithms add their sum to the
            episode's return (``cluster.driver.batching.rollout_advantages``).
    """

    prompt_uid: str
    sample_index: int
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]
    response_text: str
    finish_reason: str
    weight_version: int
    routed_experts: Any = None
    token_versions: list[int] | None = None
    response_mask: list[int] | None = None
    turn_starts: list[int] | None = None
    turn_rewards: list[float] | None = None

    def __post_init__(self) -> None:
        if problem := self.turn_problem():
            raise ValueError(problem)

    def turn_problem(self) -> str | None:
        """Why ``turn_starts`` / ``turn_rewards`` do not fit this completion (see the attributes), or None."""
        starts, rewards = self.turn_starts, self.turn_rewards
        if starts is None and rewards is None:
            return None
        name = f"completion {self.prompt_uid}#{self.sample_index}"
        if starts is None or rewards is None or len(starts) != len(rewards):
            return (f"{name}: turn_starts ({None if starts is None else len(starts)}) and turn_rewards "
                    f"({None if rewards is None else len(rewards)}) must be given together, one per turn")
        r = len(self.response_token_ids)
        if not starts or starts[0] != 0 or any(b < a for a, b in zip(starts, starts[1:])) or starts[-1] > r:
            return f"{name}: turn_starts {starts!r} must be ascending, start at 0 and stay within its {r} tokens"
        if not all(math.isfinite(x) for x in rewards):
            return f"{name}: turn_rewards {rewards!r} must be finite (0.0 where the environment gave none)"
        return None

    @property
    def sampled_tokens(self) -> int:
        """How many response tokens an engine sampled (all of them unless ``response_mask`` says otherwise)."""
        return len(self.response_token_ids) if self.response_mask is None else int(sum(self.response_mask))

    @property
    def truncated(self) -> bool:
        """True when the response was cut at the length limit."""
        return self.finish_reason == "length"


@dataclass
class TurnRequest:
    """One assistant turn to sample for an episode (``RolloutEngine.sample_turns``).

    Attributes:
        episode_id: the episode's id (``<prompt uid>#<sample index>``).
        context_ids: every token id of the episode so far, exactly as trained: the prompt's, then each earlier
            turn's sampled ids and each environment reply's ids (never a re-tokenized history).
        max_tokens: the turn's token limit (what is left of ``rollout.max_response_tokens`` and
            ``rollout.max_model_len``), >= 1.
        stop: strings that end the turn right after them (a tool call's closing tag; kept in the output).
        seed: None, or the turn's sampler seed (reproducible episodes).
        branch: which of the episode's trajectories the turn extends (0; an agent program's history that forked
            starts branch 1, 2, ...): kept in the engine's token record, so the token check tells a branch that
            trains from one that does not.
    """

    episode_id: str
    context_ids: list[int]
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    branch: int = 0


@dataclass
class SampledTurn:
    """One sampled assistant turn (``RolloutEngine.sample_turns``).

    Attributes:
        episode_id: ``TurnRequest.episode_id``.
        token_ids: the sampled ids (length T >= 0), exactly as the engine sampled them; they end with an EOS id,
            with the token that completed a stop string (``stop_reason``), or at the limit.
        logprobs: post-temperature behaviour log-probs of ``token_ids`` (nats, length T), as ``Completion``'s.
        text: ``token_ids`` decoded (special tokens removed), cut after a stop string.
        finish_reason: ``"stop"`` (an EOS id or a stop string) or ``"length"``.
        stop_reason: the stop string that ended the turn, the EOS id (int), or None (EOS not among the stop
            strings, or cut at the limit).
        weight_version: the engine's weight version when the turn was sampled (the oldest, when it spans a load).
        token_versions: None (every token sampled by ``weight_version``), or, for a turn open across an in-flight
            weight load (``sync.in_flight``), the version that sampled each of ``token_ids`` (length T).
        routed_experts: None, or (``rollout.return_routed_experts``) int16 numpy ``[C + T - 1, layers, k]``: the
            experts the engine ran for every input position of the episode so far (context ``C`` and this
            turn's ``T`` ids, the last one never fed back), each from the forward that computed it; the last
            turn's covers the whole episode (``Completion.routed_experts``).
    """

    episode_id: str
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    stop_reason: str | int | None
    weight_version: int
    routed_experts: Any = None
    token_versions: list[int] | None = None


@dataclass(frozen=True)
class BucketLoad:
    """An engine's answer to one weight bucket (``RolloutEngine.update_weights``): the seconds it took, or, when
    the collective receive failed before any tensor of the bucket was loaded, the error's text (the weight-sync
    session stays open, so the same bucket may come again through the object store)."""

    seconds: float = 0.0
    error: str = ""  # '' when the bucket was loaded

    @property
    def loaded(self) -> bool:
        """True when the bucket was loaded."""
        return not self.error


def error_text(err: BaseException) -> str:
    """An error in one line for logs, metrics and sync reports: its type and the first line of its text (300
    characters at most; ``(no message)`` for an error without text, e.g. ``TimeoutError()``). The learner's twin is
    ``learner.weight_sync.error_text`` (services do not import each other at run time)."""
    lines = str(err).splitlines()
    return f"{type(err).__name__}: {lines[0][:300] if lines else '(no message)'}"
