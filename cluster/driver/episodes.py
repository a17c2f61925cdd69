"""Multi-turn episodes as the driver records them, and what the agent loop (``cluster/driver/agent_loop.py``)
computes on them without Ray: the ``Episode`` record and the ``TurnLoop`` of turns under way, the chat
template's check (``check_template``), the debug switch's re-rendered history (``rerendered_context``; the
token check itself is ``cluster.driver.token_check``), an episode's R3 routing spliced
turn by turn (``spliced_routing``, ``fill_missing_routing``), a tool call's arguments and a row as the env
worker gets them (``tool_call_dicts``, ``_row_dict``) and a round's ``agent/*`` metrics (``episode_metrics``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

from reward.episode_status import CUT_TOKENS, FAILED, MAX_TURNS, RUNNING
from rollout.chat_delta import TurnEnd
from rollout.contracts import Completion, PromptRow, SampledTurn
from rollout.tool_calls import TAG_ARGUMENT_KEY, ToolCall

TRAJECTORY_FIELDS = ("prompt_ids", "response_ids", "mask", "logprobs", "versions", "sampled", "turn_starts",
                     "turn_rewards", "routed_experts", "branch")


@dataclass
class Episode:
    """One episode under way (the driver's record; ``EpisodeRunner`` owns it).

    ``response_ids`` / ``mask`` / ``logprobs`` / ``versions`` grow turn by turn: sampled ids (mask 1, the
    engine's log-probs and weight version) and the environment's reply ids (mask 0, log-prob 0.0, the version of
    the turn before). ``sampled`` keeps every turn's ids as the engine returned them. ``branch``: which of the
    episode's trajectories is under way (an agent program's history that forked starts branch 1, 2, ...); the
    engines keep it in their token records (``cluster.driver.token_check``).
    """

    episode_id: str
    row: PromptRow
    sample_index: int
    seed: int
    worker: int
    group: int = 0  # the row's index in its round: a group's episodes share an engine (and its prefix cache)
    prompt_ids: list[int] = field(default_factory=list)
    tools: list[dict] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)  # where each sampled turn starts in response_ids
    turn_rewards: list[float] = field(default_factory=list)  # the environment's per-turn reward (0.0: none)
    routed_experts: Any = None  # the last turn's engine routing: the whole episode's (R3), or None
    turns: int = 0
    tool_calls: int = 0
    tool_errors: Counter = field(default_factory=Counter)
    env_s: float = 0.0
    status: str = RUNNING  # reward.episode_status
    final_text: str = ""
    truncated: bool = False
    turn_end: TurnEnd | None = None
    worker_lost: bool = False  # its env worker's process died under it
    branch: int = 0

    def add(self, ids: list[int], logprobs: list[float] | None, version: int | list[int]) -> None:
        """Append sampled ids (with their log-probs) or, with ``logprobs`` None, an environment reply's ids;
        ``version``: one for all of them, or each id's (a turn open across an in-flight weight load).

        Raises:
            ValueError: a version list whose length is not ``len(ids)``.
        """
        if isinstance(version, list) and len(version) != len(ids):
            raise ValueError(f"{len(version)} token versions for {len(ids)} ids")
        self.response_ids += ids
        self.mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.versions += list(version) if isinstance(version, list) else [version] * len(ids)
        if logprobs is not None:
            self.sampled += ids

    def take_turn(self, turn: SampledTurn) -> None:
        """Append a sampled turn: its ids, log-probs and version (mask 1), where it starts, a per-turn reward of 0
        until the environment gives one, its R3 routing spliced in (``spliced_routing``) and how it ended."""
        self.turn_starts.append(len(self.response_ids))
        self.turn_rewards.append(0.0)
        self.add(turn.token_ids, turn.logprobs, turn.token_versions or turn.weight_version)
        self.routed_experts = spliced_routing(self.routed_experts, turn.routed_experts)
        self.turns += 1
        last = turn.token_ids[-1] if turn.token_ids else None
        self.turn_end = TurnEnd.from_sampling(turn.finish_reason, turn.stop_reason, last)

    def add_reply(self, ids: list[int]) -> None:
        """Append the ids of what answered the last turn (an environment's or an agent's messages; mask 0), at the
        version of the turn before (its last token's)."""
        self.add(ids, None, self.versions[-1] if self.versions else 0)

    def trajectory(self) -> dict[str, Any]:
        """The sequence so far (ids, mask, log-probs, versions, sampled ids, turn starts and rewards, routing), copied:
        ``restart`` puts it back (an agent episode's branches, ``cluster.driver.gateway_episodes``)."""
        return {k: (list(v) if isinstance(v, list) else v) for k in TRAJECTORY_FIELDS for v in [getattr(self, k)]}

    def restart(self, trajectory: dict[str, Any] | None = None, prompt_ids: list[int] | None = None,
                branch: int = 0) -> None:
        """Make ``trajectory`` (a ``trajectory()``) the episode's sequence, or with None a new one from
        ``prompt_ids`` with nothing sampled yet, numbered ``branch``."""
        fresh = {k: [] for k in TRAJECTORY_FIELDS} | {"routed_experts": None, "prompt_ids": list(prompt_ids or []),
                                                      "branch": branch}
        for k, v in (trajectory or fresh).items():
            setattr(self, k, v)
        if trajectory is None:
            self.turn_end = None

    def snapshot(self) -> tuple:
        """The episode's sequence (``trajectory``), its tools and how its last turn ended, for ``rewind``."""
        return self.trajectory(), list(self.tools), self.turn_end

    def rewind(self, snapshot: tuple) -> None:
        """Put the episode back as ``snapshot`` (a ``snapshot()``) found it."""
        trajectory, self.tools, self.turn_end = snapshot
        self.restart(trajectory)

    @property
    def sampled_versions(self) -> list[int]:
        """The weight version of each sampled token (mask 1), in order."""
        return [v for v, m in zip(self.versions, self.mask) if m]

    def completion(self) -> Completion:
        """The episode as the learner trains on it: the prompt ids, then every turn and reply, masked."""
        versions = self.sampled_versions or [0]
        return Completion(
            prompt_uid=self.row.uid, sample_index=self.sample_index, prompt_token_ids=list(self.prompt_ids or self.row.prompt_token_ids),
            response_token_ids=list(self.response_ids), response_logprobs=list(self.logprobs),
            response_text=self.final_text, finish_reason="length" if self.truncated else "stop",
            weight_version=min(versions), token_versions=list(self.versions), response_mask=list(self.mask),
            turn_starts=list(self.turn_starts) or None, turn_rewards=list(self.turn_rewards) or None,
            routed_experts=self.routed_experts)


@dataclass
class TurnLoop:
    """The turns under way between the engines and the env workers (``EpisodeRunner.pump`` advances it): one
    rollout's, or with partial rollouts what stays under way across weight syncs (``cluster.driver.
    partial_episodes``).

    ``ready``: episodes waiting for an engine; ``open_turns``: turns open per engine slot; ``calls``: queued
    ``advance_turns`` refs -> engine slot; ``stepping``: env ``step`` refs -> episode; ``starting``: env
    ``start`` refs -> episode (episodes whose environment starts while the engines sample); ``turn_seed``: turns
    requested per episode id (each turn's sampling seed); ``by_id``: every episode the loop has seen; ``on_engine``:
    episode id -> the engine slot its open turn is on; ``busy``: the engines' seconds in scheduler steps."""

    ready: list[Episode] = field(default_factory=list)
    open_turns: Counter = field(default_factory=Counter)
    calls: dict = field(default_factory=dict)
    stepping: dict = field(default_factory=dict)
    starting: dict = field(default_factory=dict)
    turn_seed: Counter = field(default_factory=Counter)
    by_id: dict[str, Episode] = field(default_factory=dict)
    on_engine: dict[str, int] = field(default_factory=dict)
    busy: float = 0.0

    def __post_init__(self):
        self.by_id.update({e.episode_id: e for e in self.ready})

    def drained(self) -> bool:
        """No engine call queued and no turn open: the engines may load new weights."""
        return not self.calls and not any(self.open_turns.values())

    def idle(self) -> bool:
        """Nothing under way and nothing ready."""
        return self.drained() and not self.ready and not self.stepping and not self.starting


def check_template(tokenizer) -> None:
    """Refuse, before any service starts, a chat template that cannot give exact-token deltas (one that is not
    prefix-stable, e.g. that drops earlier turns' reasoning, or whose reply text does not survive tokenize ->
    decode): ``rollout.chat_delta.prefix_stability_problem``. A tokenizer without a template renders replies
    as plain text and passes.

    Raises:
        ConfigError: the template's problem, naming it.
    """
    from cluster.config import ConfigError
    from rollout.chat_delta import prefix_stability_problem

    if getattr(tokenizer, "chat_template", None) and (problem := prefix_stability_problem(tokenizer, None)):
        raise ConfigError(f"env is set, but the model's chat template cannot continue an episode on its sampled "
                          f"ids: {problem}")


def rerendered_context(tokenizer, e: Episode, chat: bool) -> list[int]:
    """DEBUG ONLY (``env.debug_rerender``): the episode's history as a naive re-rendering gives it, not the ids
    sampled: the prompt, each sampled turn and each reply (the runs of ``Episode.mask``) decoded to text (special
    tokens dropped unless ``chat``: a chat template's markers stay), joined by newlines and tokenized again without
    special tokens. The token check must count every turn sampled on it (``cluster.driver.token_check``).

    Returns:
        The re-rendered ids (a list of int).
    """
    pieces, start = [list(e.prompt_ids)], 0
    for i in range(1, len(e.mask) + 1):
        if i == len(e.mask) or e.mask[i] != e.mask[start]:
            pieces.append(e.response_ids[start:i])
            start = i
    text = "\n".join(tokenizer.decode(p, skip_special_tokens=not chat) for p in pieces if p)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def spliced_routing(before: Any, turn: Any) -> Any:
    """An episode's R3 routing after a turn: the rows it had (the input positions up to the previous turn's
    last sampled token, each from the forward, and so the weight version, that sampled the token it predicts),
    then the turn's rows from there on (the environment's reply and the turn itself, from the turn's forward).
    A turn sampled after a weight sync recomputes the earlier positions under the new weights; their rows are
    not taken, so every sampled token keeps its own turn's experts.

    Args:
        before: None, or int16 numpy ``[n, layers, k]`` (the episode's rows so far).
        turn: None (no routing capture), or int16 numpy ``[m, layers, k]``, ``m >= n``: the turn's engine rows
            for every input position of the episode.

    Returns:
        ``turn`` when ``before`` is None, else ``[m, layers, k]``: ``before`` then ``turn[n:]``.

    Raises:
        ValueError: ``turn`` has fewer rows than ``before`` or another shape per row.
    """
    import numpy as np

    if before is None or turn is None:
        return turn
    if len(turn) < len(before) or turn.shape[1:] != before.shape[1:]:
        raise ValueError(f"a turn's routing {turn.shape} does not extend the episode's {before.shape}")
    return np.concatenate([before, turn[len(before):]])


def fill_missing_routing(episodes: list[Episode]) -> None:
    """With routing capture on, an episode that sampled no turn (its environment failed at the start) gets an
    all ``-1`` routing (no engine experts: the learner's replay uses its placeholder there; it has no sampled
    token to train) so that the batch's rows agree."""
    import numpy as np

    shape = next((e.routed_experts.shape[1:] for e in episodes if e.routed_experts is not None), None)
    for e in episodes:
        if shape is not None and e.routed_experts is None:
            n = max(len(e.prompt_ids) + len(e.response_ids) - 1, 0)
            e.routed_experts = np.full((n, *shape), -1, dtype=np.int16)


def _named_argument(arguments: dict, name: str, tools: list[dict]) -> dict:
    """The ``tag`` format's one argument (``{TAG_ARGUMENT_KEY: text}``) under the name of the tool's only
    parameter (from its JSON schema); other arguments, and tools with another number of parameters, as they are."""
    if set(arguments) != {TAG_ARGUMENT_KEY}:
        return arguments
    for t in tools:
        fn = t.get("function", t)
        params = list((fn.get("parameters") or {}).get("properties") or {})
        if fn.get("name") == name and len(params) == 1:
            return {params[0]: arguments[TAG_ARGUMENT_KEY]}
    return arguments


def tool_call_dicts(calls: Iterable[ToolCall], tools: list[dict]) -> list[dict]:
    """Parsed tool calls (``rollout.tool_calls.ToolCall``) as the env worker's ``step`` and the gateway's reply
    take them, ``[{"name": str, "arguments": dict}]`` in order: the one place the driver turns a call into
    arguments (the ``tag`` format's one argument named after the tool's parameter, ``_named_argument``).
    ``tools``: the episode's tools' JSON schemas."""
    return [{"name": c.name, "arguments": _named_argument(c.arguments, c.name, tools)} for c in calls]


def _row_dict(row: PromptRow) -> dict:
    return {"uid": row.uid, "prompt": row.prompt, "answer": row.answer, "verifier": row.verifier, "meta": row.meta}


def episode_metrics(episodes: list[Episode], busy_share: float) -> dict[str, float]:
    """The ``agent/*`` metrics of a round of episodes (turns per episode, tool calls and errors by kind, episodes
    cut by the turn or token budget, failed environments, environment seconds, the engines' busy share)."""
    n = max(len(episodes), 1)
    turns = [e.turns for e in episodes]
    errors = Counter()
    for e in episodes:
        errors.update(e.tool_errors)
    m = {"agent/turns_mean": sum(turns) / n, "agent/turns_max": float(max(turns, default=0)),
         "agent/tool_calls_mean": sum(e.tool_calls for e in episodes) / n,
         "agent/cut_turns": float(sum(e.status == MAX_TURNS for e in episodes)),
         "agent/cut_tokens": float(sum(e.status == CUT_TOKENS for e in episodes)),
         "agent/env_failed": float(sum(e.status in FAILED for e in episodes)),
         "agent/env_s": sum(e.env_s for e in episodes), "agent/engine_busy_share": float(busy_share),
         "agent/turn_reward_mean": sum(sum(e.turn_rewards) for e in episodes) / n}
    m.update({f"agent/tool_errors/{k}": float(v) for k, v in sorted(errors.items())})
    return m
