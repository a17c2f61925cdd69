"""Partial rollouts' bookkeeping (pure Python): samples that span weight versions, and the staleness bound.

With ``trainer.partial_rollouts=true`` an engine generates at most ``trainer.partial_segment_tokens`` tokens of a
sample per round; a sample that has not finished stays in the ``PartialBuffer`` and continues after the next weight
sync as a new request whose prompt is the original prompt plus the tokens generated so far (abort-and-continue:
the engine recomputes the prefix's KV cache with the new weights, so nothing stale is reused). Every response
token keeps the weight version that sampled it and its behaviour log-prob under that version.

The staleness of a token trained at learner version ``V`` is ``V - version(token)``; ``trainer.max_staleness=k``
bounds the oldest token of every trained sample. A sample (finished or not, not yet trained) whose oldest token
is older than ``V - k`` is dropped and sampled again from its prompt under the current weights: its tokens are
counted in ``partial/dropped_tokens`` and the sample in ``partial/restarted_samples`` (dropped and counted, not
corrected). A group is trained when all of its ``G`` samples have finished; groups leave in admission order.

With the engines' routing capture (``rollout.return_routed_experts``, for R3) a sample also keeps, per input
position, the experts of the version that sampled the token predicted there: a continuation piece reports the
experts of every position it computed (its prompt = the row's prompt plus the prefix, recomputed under the new
weights), and only its rows from the prefix's last token on (the positions that sampled the new tokens) are
appended; the prompt's rows and the prefix's rows stay those of the versions that sampled from them. Row
``P - 1 + j`` (which sampled response token ``j``) therefore carries ``versions[j]``, and the prompt's rows the
first segment's version: R3 replays, for each token, the experts under which it was sampled.

Nothing here knows Ray or vLLM: the driver (``cluster.driver.partial_rollout``) turns requests into engine calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from rollout.contracts import Completion, PromptRow


@dataclass
class PartialSample:
    """One sample of a group, possibly unfinished.

    Attributes:
        sample_index: index in its group, ``[0, G)``.
        token_ids: response tokens generated so far.
        logprobs: behaviour log-prob of each token (nats, post-temperature), under the version that sampled it.
        versions: weight version that sampled each token (same length as ``token_ids``).
        text: decoded response so far (the segments' texts joined).
        finish_reason: ``""`` while in flight, then ``"stop"`` or ``"length"``.
        routing: None (no routing capture), or int16 numpy ``[P - 1 + len(token_ids), layers, k]``: the experts
            each input position ran under the version that sampled the token it predicted (module docstring).
    """

    sample_index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    routing: Any = field(default=None, compare=False)  # numpy: kept out of ==

    @property
    def finished(self) -> bool:
        """True once the sample stopped (EOS) or reached the response limit."""
        return bool(self.finish_reason)

    @property
    def oldest_version(self) -> int | None:
        """The version of its oldest token; None for a sample with no token yet."""
        return min(self.versions) if self.versions else None

    def restart(self) -> int:
        """Throw the sample's tokens away (it is sampled again from its prompt). Returns the tokens dropped."""
        n = len(self.token_ids)
        self.token_ids, self.logprobs, self.versions, self.text, self.finish_reason = [], [], [], "", ""
        self.routing = None
        return n


@dataclass
class PartialGroup:
    """A prompt and its ``G`` samples; ``serial`` is its admission number (groups train in this order)."""

    row: PromptRow
    serial: int
    samples: list[PartialSample]

    @property
    def finished(self) -> bool:
        """True when every sample has finished."""
        return all(s.finished for s in self.samples)


@dataclass
class Request:
    """One engine request of a round: continue ``group.samples[index]`` (its prompt is the row's prompt plus
    the tokens generated so far)."""

    group: PartialGroup
    index: int

    @property
    def prompt_token_ids(self) -> list[int]:
        """The row's prompt followed by the sample's tokens so far."""
        return list(self.group.row.prompt_token_ids) + self.group.samples[self.index].token_ids


class PartialBuffer:
    """The groups admitted and not yet trained, with the counters of what the staleness bound dropped.

    Args:
        group_size: ``G``, samples per prompt (>= 1).
        max_response_tokens: the response limit (>= 1): a sample reaching it finishes as ``"length"``.
        max_staleness: ``k >= 1``, the largest ``V - version`` of any trained token.

    Raises:
        ValueError: a bad argument (named with its value).
    """

    def __init__(self, group_size: int, max_response_tokens: int, max_staleness: int):
        if group_size < 1 or max_response_tokens < 1 or max_staleness < 1:
            raise ValueError(f"group_size={group_size}, max_response_tokens={max_response_tokens} and "
                             f"max_staleness={max_staleness} must be >= 1")
        self.group_size = group_size
        self.max_response_tokens = max_response_tokens
        self.max_staleness = max_staleness
        self.groups: list[PartialGroup] = []
        self.next_serial = 0  # admission counter (also seeds the rounds: resume keeps it)
        self.rounds = 0  # rounds generated so far (seeds each round's requests)
        self.restarted_samples = 0  # samples whose tokens the staleness bound threw away
        self.dropped_tokens = 0  # tokens thrown away with them
        # what the rounds since the last collection did, reported with the next one (partial_rollout_overlap's
        # rounds beside the learner): kept here so that a checkpoint, and a run resumed from it, report them too
        self.beside_rounds = 0  # rounds run beside the learner
        self.beside_tokens = 0  # tokens they generated
        self.slots = 0  # decode slots the rounds offered (requests x the round's longest piece)
        self.slots_used = 0  # of which produced a token

    # -- admission and requests ----------------------------------------------------------------------------
    def admit(self, rows: list[PromptRow]) -> None:
        """Add one group of ``G`` empty samples per row, in order."""
        for row in rows:
            self.groups.append(PartialGroup(row, self.next_serial, [PartialSample(k) for k in range(self.group_size)]))
            self.next_serial += 1

    def num_ready(self) -> int:
        """Groups whose samples have all finished."""
        return sum(g.finished for g in self.groups)

    def num_unfinished(self) -> int:
        """Groups with a sample still in flight."""
        return len(self.groups) - self.num_ready()

    def requests(self) -> list[Request]:
        """Every unfinished sample, in admission then sample order."""
        return [Request(g, s.sample_index) for g in self.groups for s in g.samples if not s.finished]

    # -- the staleness bound -------------------------------------------------------------------------------
    def expire(self, version: int) -> int:
        """Before sampling or training at weight version ``version``: restart every sample whose oldest token is
        older than ``version - max_staleness`` (it could never be trained within the bound). Returns how many
        samples were restarted (also added to ``restarted_samples``; their tokens to ``dropped_tokens``)."""
        n = 0
        for g in self.groups:
            for s in g.samples:
                old = s.oldest_version
                if old is not None and version - old > self.max_staleness:
                    self.dropped_tokens += s.restart()
                    n += 1
        self.restarted_samples += n
        return n

    def restart_all(self) -> int:
        """After a health-guard rollback: restart every sample that has tokens (finished or not), since the
        weights that sampled them were rolled over. The groups stay admitted in their order, so no prompt is
        lost or taken twice. Returns the samples restarted (counted like ``expire``'s)."""
        n = 0
        for g in self.groups:
            for s in g.samples:
                if s.token_ids or s.finished:
                    self.dropped_tokens += s.restart()
                    n += 1
        self.restarted_samples += n
        return n

    # -- results -------------------------------------------------------------------------------------------
    def extend(self, request: Request, piece: Completion, segment_tokens: int) -> None:
        """Append an engine's continuation ``piece`` (``piece.response_*`` are the new tokens only, sampled by
        ``piece.weight_version``) to the request's sample. The sample finishes on ``"stop"``, at the response
        limit; a piece cut at ``segment_tokens`` (``"length"``) below the limit stays in flight.

        With routing capture, ``piece.routed_experts`` (``[P + prefix + new - 1, layers, k]``) extends the sample's
        routing by its rows from ``P + prefix - 1`` on (module docstring).

        Raises:
            ValueError: the sample has already finished, the piece would pass the response limit, or its routing
                has the wrong number of rows or is missing while the sample's earlier pieces had one.
        """
        s = request.group.samples[request.index]
        if s.finished:
            raise ValueError(f"prompt uid={request.group.row.uid!r} sample {s.sample_index} has already finished")
        new = list(piece.response_token_ids)
        if len(s.token_ids) + len(new) > self.max_response_tokens:
            raise ValueError(f"prompt uid={request.group.row.uid!r}: {len(s.token_ids)} + {len(new)} tokens exceed "
                             f"rollout.max_response_tokens={self.max_response_tokens}")
        s.routing = spliced_routing(request, piece, len(new))
        s.token_ids += new
        s.logprobs += list(piece.response_logprobs)
        s.versions += [piece.weight_version] * len(new)
        s.text += piece.response_text
        if piece.finish_reason != "length" or len(new) < segment_tokens:  # EOS or a stop string
            s.finish_reason = "stop"
        elif len(s.token_ids) >= self.max_response_tokens:
            s.finish_reason = "length"

    def take(self, count: int, version: int) -> list[PartialGroup]:
        """Remove and return up to ``count`` finished groups (admission order) to train at ``version``.

        Raises:
            RuntimeError: a taken sample's oldest token is beyond the bound (``expire`` was not called).
        """
        out, self.groups = take_ready(self.groups, count, lambda g: g.finished,
                                      lambda g: [s.oldest_version for s in g.samples if s.versions], version,
                                      self.max_staleness)
        return out

    def drop_all(self) -> list[PromptRow]:
        """Forget every group (a rollback threw their weights away). Returns their rows, in admission order."""
        rows = [g.row for g in self.groups]
        self.groups = []
        return rows


def take_ready(groups: list, count: int, ready: Callable[[Any], bool], oldest: Callable[[Any], list[int]],
               version: int, max_staleness: int) -> tuple[list, list]:
    """Up to ``count`` groups for which ``ready(group)`` holds (admission order: their order in ``groups``), to
    train at ``version``, and the groups left; ``oldest(group)`` gives its samples' oldest token versions (the
    samples with tokens). Shared by ``PartialBuffer`` and the episodes' ``cluster.driver.partial_episodes``.

    Raises:
        RuntimeError: a taken group has a token older than ``version - max_staleness`` (the bound was not applied
            before the take), naming the prompt's uid.
    """
    out = [g for g in groups if ready(g)][:count]
    taken = {id(g) for g in out}
    for g in out:
        worst = max((version - v for v in oldest(g)), default=0)
        if worst > max_staleness:
            raise RuntimeError(f"prompt uid={g.row.uid!r}: a token {worst} versions old at version {version}, "
                               f"beyond trainer.max_staleness={max_staleness}")
    return out, [g for g in groups if id(g) not in taken]


def spliced_routing(request: Request, piece: Completion, new: int) -> Any:
    """The sample's routing after ``piece`` (``new`` tokens): the rows it had, then the piece's rows of the
    positions that sampled the new tokens; the first piece's rows in full (prompt included). None without capture.

    Raises:
        ValueError: the piece's routing does not cover ``len(request.prompt_token_ids) + new - 1`` positions, or it
            is missing (or present) while the sample's earlier pieces had one (or had none).
    """
    s, uid = request.group.samples[request.index], request.group.row.uid
    rows = piece.routed_experts
    if s.token_ids and (rows is None) != (s.routing is None):
        now, before = ("without", "with") if rows is None else ("with", "without")
        raise ValueError(f"prompt uid={uid!r} sample {s.sample_index}: a piece {now} routed_experts after pieces "
                         f"{before} (every engine must have the same rollout.return_routed_experts)")
    if rows is None:
        return None
    rows = np.asarray(rows)
    start = len(request.prompt_token_ids) - 1  # the prefix's last token (the prompt's last when no prefix yet)
    if rows.shape[0] != start + new:
        raise ValueError(f"prompt uid={uid!r} sample {s.sample_index}: routed_experts has {rows.shape[0]} rows, "
                         f"expected {start + new} (the request's {start + 1} prompt tokens + {new} new - 1)")
    if s.routing is None:
        return rows
    return np.concatenate([s.routing, rows[start:]])


def to_completion(group: PartialGroup, s: PartialSample) -> Completion:
    """A finished sample as the ``Completion`` the batch is built from: ``weight_version`` is its OLDEST token's
    version (what the staleness metric reads), ``token_versions`` every token's, ``routed_experts`` its spliced
    routing (per token version; None without capture).

    Raises:
        ValueError: the sample has not finished.
    """
    if not s.finished:
        raise ValueError(f"prompt uid={group.row.uid!r} sample {s.sample_index} has not finished")
    c = Completion(prompt_uid=group.row.uid, sample_index=s.sample_index,
                   prompt_token_ids=list(group.row.prompt_token_ids), response_token_ids=list(s.token_ids),
                   response_logprobs=list(s.logprobs), response_text=s.text, finish_reason=s.finish_reason,
                   weight_version=s.oldest_version if s.versions else 0, token_versions=list(s.versions),
                   routed_experts=s.routing)
    return c
