"""Collecting one step's rollout: prompts -> engines (G completions each) -> reward workers, streamed.

``Collector.collect(step)`` takes the step's prompts from the stream, has the engines generate them in pieces
(``rollout.pieces_per_engine`` calls queued on each engine) and scores every piece as soon as it arrives, so
scoring runs while the engines generate the rest. With dynamic sampling (DAPO) it drops groups whose rewards
are all equal and samples more prompts, at most ``trainer.max_sampling_rounds`` extra rounds.

In the overlapped mode (``trainer.max_staleness=1``) the driver runs ``collect(k+1)`` in a thread while the
learner trains on step k; the collector is the only user of the engines and reward workers until the driver
joins it. The learner is touched only when an engine dies: its replacement asks the learner for the current
weights, a call that runs after the learner's update (see the README on the version tag this gives).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from cluster.config import Config
from cluster.data.prompts import PromptStream
from reward.contracts import RewardRequest, RewardResult
from reward.infra import add_counts, counts
from rollout.contracts import Completion, PromptRow

log = logging.getLogger("cluster.train")


def all_equal(scores: list[float]) -> bool:
    """True when the group's valid (non-NaN) rewards are all equal (or fewer than two are valid)."""
    valid = [x for x in scores if not math.isnan(x)]
    return len(valid) < 2 or max(valid) == min(valid)


@dataclass
class Collected:
    """What one step's rollout and scoring produced: the groups to train on and how they were obtained.

    ``start_position`` / ``end_position``: the prompt stream's position before and after the collection (a
    collection that is thrown away rewinds the stream to ``start_position``)."""

    step: int = 0
    prompts: list[PromptRow] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)
    results: list[RewardResult] = field(default_factory=list)
    rollout_s: float = 0.0
    reward_s: float = 0.0
    rounds: int = 0
    dropped: int = 0
    generated_tokens: int = 0
    reward_metrics: dict[str, float] = field(default_factory=dict)
    start_position: int = 0
    end_position: int = 0
    sampled: dict[str, list[int]] = field(default_factory=dict)  # episodes: the engines' ids by episode id
    # env.gateway.fork_policy=all: each episode's other branches, (branch, Completion), by episode id; they train
    # with their episode's reward and advantage (cluster.driver.batching.with_branches)
    branches: dict[str, list[tuple[int, Completion]]] = field(default_factory=dict)
    # on-policy distillation (distill): per completion the teacher's log-prob of each response token, None where
    # the teacher failed (that sample's reward is then NaN); None = not asked yet (cluster/driver/distill.py)
    teacher_logprobs: list[list[float] | None] | None = None


def score(rewards, rows_by_uid: dict[str, PromptRow], completions: list[Completion]) -> list[RewardResult]:
    """Verdicts of ``completions`` from the reward pool ``rewards``, in order."""
    reqs = [RewardRequest(response=c.response_text, row=rows_by_uid[c.prompt_uid],
                          num_response_tokens=len(c.response_token_ids), truncated=c.truncated)
            for c in completions]
    return rewards.score(reqs)


class Collector:
    """Rollout and scoring of a step's prompts (see the module docstring).

    Args:
        cfg: the run config.
        stream: the training prompt stream (its position advances by the prompts taken).
        fleet: the ``cluster.runtime.services.EngineFleet``.
        rewards: the ``reward.pool.RewardPool``.
        episodes: None, or (``env`` set) the ``cluster.driver.agent_loop.EpisodeRunner`` that plays multi-turn
            episodes in place of single answers; their environments score them.
    """

    def __init__(self, cfg: Config, stream: PromptStream, fleet, rewards, episodes=None):
        self.cfg, self.stream, self.fleet, self.rewards, self.episodes = cfg, stream, fleet, rewards, episodes

    def _generate_and_score(self, rows: list[PromptRow], seed: int,
                            c: Collected) -> tuple[list[Completion], list[RewardResult]]:
        """All completions of ``rows`` and their verdicts, in prompt order; the scoring of a piece overlaps the
        generation of the next pieces. Adds the timings and token count to ``c``."""
        G = self.cfg.trainer.group_size
        if self.episodes is not None:
            t0 = time.perf_counter()
            comps, scored, metrics, sampled = self.episodes.run(rows, G, seed)
            c.rollout_s += time.perf_counter() - t0
            c.generated_tokens += sum(x.sampled_tokens for x in comps)
            c.reward_metrics.update(metrics)
            c.sampled.update(sampled)
            c.branches.update(self.episodes.take_branches())
            return comps, scored
        comps: list[Completion | None] = [None] * (len(rows) * G)
        scored: list[RewardResult | None] = [None] * (len(rows) * G)
        by_uid = {r.uid: r for r in rows}
        t0 = time.perf_counter()
        for lo, piece in self.fleet.generate_stream(rows, G, seed=seed, pieces_per_engine=self.cfg.rollout.pieces_per_engine):
            comps[lo * G : lo * G + len(piece)] = piece
            t = time.perf_counter()
            scored[lo * G : lo * G + len(piece)] = score(self.rewards, by_uid, piece)
            c.reward_s += time.perf_counter() - t
        c.rollout_s += time.perf_counter() - t0
        if any(x is None for x in comps):
            raise RuntimeError(f"rollout returned {sum(x is not None for x in comps)} completions for {len(rows)} prompts x G={G}")
        c.generated_tokens += sum(len(x.response_token_ids) for x in comps)
        return comps, scored  # type: ignore[return-value]

    def collect(self, step: int) -> Collected:
        """The rollout of RL step ``step + 1`` (0-based ``step`` seeds the sampling): groups kept, cut to a
        multiple of ``num_minibatches x world_size`` when dynamic sampling came up short."""
        cfg, tc = self.cfg, self.cfg.trainer
        G, P = tc.group_size, tc.prompts_per_step
        c = Collected(step=step, start_position=self.stream.position)
        want = P
        while want > 0:
            batch_prompts = self.stream.take(want)
            new, scored = self._generate_and_score(batch_prompts, cfg.rollout.seed + 1_000_003 * step + 7_919 * c.rounds, c)
            for k, v in self.rewards.metrics().items():
                c.reward_metrics[k] = c.reward_metrics.get(k, 0.0) + v
            for i, row in enumerate(batch_prompts):
                group = scored[i * G : (i + 1) * G]
                if tc.dynamic_sampling and all_equal([r.score for r in group]):
                    c.dropped += 1
                    add_counts(c.reward_metrics, counts(r.infra_failed for r in group))  # counted all the same
                    continue
                if len(c.prompts) < P:
                    c.prompts.append(row)
                    c.completions.extend(new[i * G : (i + 1) * G])
                    c.results.extend(group)
            c.rounds += 1
            want = P - len(c.prompts) if tc.dynamic_sampling and c.rounds <= tc.max_sampling_rounds else 0
        unit = cfg.learner.num_minibatches * cfg.learner.world_size
        usable = len(c.prompts) - len(c.prompts) % unit
        if usable < len(c.prompts):
            log.warning(
                "dynamic sampling: %d informative groups after %d rounds (bound reached); training on %d",
                len(c.prompts), c.rounds, usable)
            c.prompts, c.completions, c.results = c.prompts[:usable], c.completions[: usable * G], c.results[: usable * G]
        c.end_position = self.stream.position
        return c
