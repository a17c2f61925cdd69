"""Partial rollouts (``trainer.partial_rollouts=true``): a step's rollout in rounds of bounded length, samples
that have not finished continuing after the weight sync under the new weights.

A round sends every unfinished sample of the ``PartialBuffer`` (``cluster.driver.partial_buffer``) to the engines
as one request (the row's prompt plus the tokens generated so far, ``n=1``, at most
``trainer.partial_segment_tokens`` new tokens). The engines therefore never wait for a batch's longest
completion: a round lasts at most one segment, and a long sample carries over to the next step. Before each
round new prompts are admitted so that enough groups can finish (``P`` finished groups are needed, at most
``2 P`` groups are in the buffer); rounds repeat until ``P`` groups have finished, which are then scored and
trained. What AReaL (interruptible generation, arXiv 2505.24298) and slime / Kimi k1.5 (partial rollouts with a
per-iteration budget) do, with the abort-and-continue form: vLLM's offline ``LLM`` class in this project runs
one blocking ``generate`` per call, so a request is "paused" by ending the round and "resumed" as a new request
whose prompt carries its prefix. The prefix's KV cache is recomputed under the new weights (the engines reset
their prefix cache at every sync), so no KV from older weights is reused; the sampled tokens' log-probs are
those of the weights that sampled them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from cluster.config import Config
from cluster.data.prompts import PromptStream
from cluster.driver.collect import Collected, score
from cluster.driver.partial_buffer import PartialBuffer, Request, to_completion
from rollout.contracts import PromptRow

log = logging.getLogger("cluster.train")


def segment_tokens(max_response_tokens: int, max_staleness: int, configured: int | None = None) -> int:
    """The tokens of a sample per round: ``configured``, or the smallest divisor of ``max_response_tokens`` that
    is at least ``max_response_tokens / (max_staleness + 1)`` (so ``max_staleness + 1`` rounds, the versions a
    trained sample may span, reach the response limit: no sample has to be dropped in a run without failures).

    Raises:
        ValueError: ``configured`` does not divide ``max_response_tokens``, or an argument below 1.
    """
    if max_response_tokens < 1 or max_staleness < 1:
        raise ValueError(f"max_response_tokens={max_response_tokens} and max_staleness={max_staleness} must be >= 1")
    if configured is not None:
        if configured < 1 or max_response_tokens % configured:
            raise ValueError(f"trainer.partial_segment_tokens={configured} must divide "
                             f"rollout.max_response_tokens={max_response_tokens}")
        return configured
    least = -(-max_response_tokens // (max_staleness + 1))
    return next(d for d in range(least, max_response_tokens + 1) if max_response_tokens % d == 0)


def request_row(req: Request) -> PromptRow:
    """The engine's prompt for ``req``: the row with the sample's tokens so far appended to its prompt ids."""
    row = req.group.row
    return PromptRow(uid=f"{row.uid}#{req.index}", prompt=row.prompt, prompt_token_ids=req.prompt_token_ids,
                     answer=row.answer, verifier=row.verifier, meta=row.meta)


class PartialCollector:
    """``collect(step)`` like ``cluster.driver.collect.Collector``, from rounds over a ``PartialBuffer``.

    Args:
        cfg: the run config (``trainer.partial_rollouts=true``).
        stream: the training prompt stream (advances by the prompts admitted).
        fleet: the ``cluster.runtime.services.EngineFleet``.
        rewards: the ``reward.pool.RewardPool``.
        version: returns the weight version the engines hold now (the driver's).
    """

    def __init__(self, cfg: Config, stream: PromptStream, fleet, rewards, version: Callable[[], int]):
        tc = cfg.trainer
        self.cfg, self.stream, self.fleet, self.rewards, self.version = cfg, stream, fleet, rewards, version
        # with rounds beside the learner a collection may run no round (P groups already finished beside it), so
        # a sample may get only one segment per version: the default then lets it finish within k versions
        versions = tc.max_staleness - 1 if tc.partial_rollout_overlap else tc.max_staleness
        self.segment = segment_tokens(cfg.rollout.max_response_tokens, versions, tc.partial_segment_tokens)
        self.buffer = PartialBuffer(tc.group_size, cfg.rollout.max_response_tokens, tc.max_staleness)
        self.stats: dict[str, float] = {}  # the last collection's partial/* metrics
        self._beside_s = 0.0  # seconds of the rounds beside the learner since the last collection (their counts:
        # the buffer's beside_rounds / beside_tokens / slots, which a checkpoint keeps)
        if self.segment * (versions + 1) < cfg.rollout.max_response_tokens:
            log.warning("trainer.partial_segment_tokens=%d x (trainer.max_staleness=%d + 1) is below "
                        "rollout.max_response_tokens=%d: a sample that long cannot finish within the staleness "
                        "bound across syncs and is sampled again (partial/restarted_samples)", self.segment,
                        tc.max_staleness, cfg.rollout.max_response_tokens)

    def _admit(self) -> None:
        """Admit new prompts so that ``P`` groups can finish, keeping at most ``2 P`` groups in the buffer."""
        P = self.cfg.trainer.prompts_per_step
        admit = min(P - self.buffer.num_ready(), 2 * P - len(self.buffer.groups))
        if admit > 0:
            self.buffer.admit(self.stream.take(admit))

    def _round(self, c: Collected | None) -> None:
        """One round: every unfinished sample gets up to one segment (counted in ``c``, or as a round beside the
        learner when None, and in the buffer's slot counts)."""
        reqs = self.buffer.requests()
        rows = [request_row(r) for r in reqs]
        seed = self.cfg.rollout.seed + 1_000_003 * self.buffer.rounds + 17
        t0, longest, tokens = time.perf_counter(), 0, 0
        for lo, piece in self.fleet.generate_stream(rows, 1, seed=seed, max_tokens=self.segment,
                                                    pieces_per_engine=self.cfg.rollout.pieces_per_engine):
            for j, comp in enumerate(piece):
                self.buffer.extend(reqs[lo + j], comp, self.segment)
                tokens += len(comp.response_token_ids)
                longest = max(longest, len(comp.response_token_ids))
        b = self.buffer
        if c is None:
            self._beside_s += time.perf_counter() - t0
            b.beside_rounds = getattr(b, "beside_rounds", 0) + 1  # a buffer pickled before these counters has none
            b.beside_tokens = getattr(b, "beside_tokens", 0) + tokens
        else:
            c.rollout_s += time.perf_counter() - t0
            c.generated_tokens += tokens
            c.rounds += 1
        b.rounds += 1
        b.slots, b.slots_used = getattr(b, "slots", 0) + len(reqs) * longest, getattr(b, "slots_used", 0) + tokens

    def rounds_beside(self, stop: threading.Event) -> None:
        """``trainer.partial_rollout_overlap``: rounds at the engines' current weights while the learner trains
        (the driver's rollout thread runs this), until ``stop`` is set (the round under way then completes) or
        no sample is left to continue. New prompts are admitted as ``collect`` admits them; what these rounds
        generate is counted in the next ``collect``'s step (its rollout seconds, tokens and rounds).

        With ``trainer.deterministic`` the rounds do not depend on when ``stop`` comes: they run until
        ``trainer.prompts_per_step`` groups are ready for the next collection (or no sample is left), and the
        driver's wait for them holds the sync."""
        deterministic, P = self.cfg.trainer.deterministic, self.cfg.trainer.prompts_per_step
        while deterministic or not stop.is_set():
            self._admit()
            if not self.buffer.num_unfinished() or (deterministic and self.buffer.num_ready() >= P):
                return
            self._round(None)

    def collect(self, step: int) -> Collected:
        """Rounds at the current weight version until ``trainer.prompts_per_step`` groups have finished; those
        groups, scored, in admission order. ``stats`` gets the collection's ``partial/*`` metrics; the rounds run
        beside the learner since the last collection (``rounds_beside``) count in this one."""
        P, version = self.cfg.trainer.prompts_per_step, self.version()
        c = Collected(step=step, start_position=self.stream.position)
        b = self.buffer
        beside = getattr(b, "beside_rounds", 0)  # a buffer pickled before these counters has none
        c.rollout_s, c.rounds, c.generated_tokens = self._beside_s, beside, getattr(b, "beside_tokens", 0)
        self._beside_s, b.beside_rounds, b.beside_tokens = 0.0, 0, 0
        dropped0 = self.buffer.dropped_tokens
        restarted = self.buffer.expire(version)
        while self.buffer.num_ready() < P:
            self._admit()
            self._round(c)
        groups = self.buffer.take(P, version)
        c.prompts = [g.row for g in groups]
        c.completions = [to_completion(g, s) for g in groups for s in g.samples]
        by_uid = {r.uid: r for r in c.prompts}
        t = time.perf_counter()
        c.results = score(self.rewards, by_uid, c.completions)
        c.reward_s += time.perf_counter() - t
        c.reward_metrics = dict(self.rewards.metrics())
        c.end_position = self.stream.position
        spans = [len(set(x.token_versions or [x.weight_version])) for x in c.completions]
        self.stats = {
            "partial/rounds": float(c.rounds), "partial/rounds_beside_learner": float(beside),
            "partial/restarted_samples": float(restarted),
            "partial/dropped_tokens": float(self.buffer.dropped_tokens - dropped0),
            "partial/multi_version_share": sum(s > 1 for s in spans) / max(1, len(spans)),
            "partial/in_flight_groups": float(self.buffer.num_unfinished()),
            "rollout/slot_utilization": b.slots_used / b.slots if getattr(b, "slots", 0) else 0.0,
        }
        b.slots = b.slots_used = 0
        return c


def slot_utilization(c: Collected) -> float:
    """Share of an on-policy rollout's decode slots that produced a token: generated tokens over
    (samples x the longest sample), the engines' batch shrinking as short samples finish (1.0 = no tail)."""
    lengths = [len(x.response_token_ids) for x in c.completions]
    return sum(lengths) / (len(lengths) * max(lengths)) if lengths and max(lengths) else 0.0


def step_metrics(collector: Any, c: Collected) -> dict[str, float]:
    """``rollout/slot_utilization`` for any collector, and the ``partial/*`` metrics of a ``PartialCollector``
    (or of a ``cluster.driver.partial_episodes.PartialEpisodeCollector``)."""
    if isinstance(collector, PartialCollector) or hasattr(collector, "stats"):
        return dict(collector.stats)
    return {"rollout/slot_utilization": slot_utilization(c)}
