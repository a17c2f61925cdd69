"""Partial rollouts of multi-turn episodes (``trainer.partial_rollouts=true`` with ``env`` set): episodes that
continue across weight syncs, so a step never waits for its slowest episode.

The loop (``cluster.driver.episodes.TurnLoop``, advanced by ``EpisodeRunner.pump``) stays under way between
collections: up to ``2 P`` groups are admitted, and a collection ends as soon as ``P`` groups have every episode
ended; the rest goes on after the weight sync. The unit of a partial rollout is the **turn**: at the end of a
collection no new turn is given to the engines and the open turns finish under the weights that started them (a
drain, at most one turn long), so every turn has one weight version and the engines hold no open request at the
sync; tool calls under way go on through the sync (the env workers do not depend on the weights). The next turn
of an episode is sampled from its exact ids by the new weights, each sampled token keeping its version and
behaviour log-prob, and R3 its own turn's experts (``episodes.spliced_routing``).

With ``sync.in_flight`` on (keep / recompute) there is no drain: turns stay open on the engines across the
collection's end and the sync (the engines load the new weights between two scheduler steps,
``rollout.in_flight``), and a turn may span versions, each token with its own version and log-prob. An episode
whose oldest token falls out of the bound is restarted as below, its open turn aborted on its engine (its tokens
counted in ``partial/dropped_tokens``); the bound is checked again as turns end, so no group is taken stale.

The staleness bound (``trainer.max_staleness = k``): before a collection at version ``V``, an episode not yet
trained whose oldest sampled token is older than ``V - k`` is restarted: its environment is aborted and a new
episode of the same group (same seed, so the same initial state) starts (``partial/restarted_episodes``, its
sampled tokens in ``partial/dropped_tokens``). So is an episode whose env worker was replaced or removed
(``control.yaml``) while it was under way, and every episode with tokens after a health-guard rollback.

Checkpoints (``EpisodeBacklog`` pickles into ``partial_rollouts.pkl``): a group whose episodes have all ended is
saved scored, with its turns, ids, log-probs, versions and verdicts, and is trained after a resume as it would
have been; an episode under way cannot be saved (an environment has no saved state in this interface), so after a
resume it starts again from its group's seed, counted in ``partial/restarted_episodes``. Its prompt stays admitted:
no prompt is lost or trained twice.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import ray

from cluster.config import Config
from cluster.data.prompts import PromptStream
from cluster.driver.agent_loop import EpisodeRunner
from cluster.driver.collect import Collected
from cluster.driver.episodes import Episode, TurnLoop, episode_metrics, fill_missing_routing
from cluster.driver.partial_buffer import take_ready
from reward.contracts import RewardResult
from reward.episode_status import RUNNING
from rollout.contracts import PromptRow

log = logging.getLogger("cluster.train")


@dataclass
class EpisodeGroup:
    """A prompt's ``G`` episodes; ``serial`` is its admission number (groups train in this order, and it seeds
    the group's environments). ``verdicts[k]``: episode k's verdict once it has ended and its environment gave
    the reward (and was closed), else None."""

    row: PromptRow
    serial: int
    episodes: list[Episode]
    verdicts: list[RewardResult | None] = field(default_factory=list)
    attempts: int = 0  # episodes started for this group (restarts included): keeps episode ids unique

    @property
    def ended(self) -> bool:
        """True when every episode has ended (scored or not)."""
        return all(e.status != RUNNING for e in self.episodes)

    @property
    def scored(self) -> bool:
        """True when every episode has its verdict."""
        return all(v is not None for v in self.verdicts)


def oldest_version(e: Episode) -> int | None:
    """The weight version of the episode's oldest sampled token; None before its first turn."""
    return min(e.sampled_versions, default=None)


class EpisodeBacklog:
    """The groups admitted and not yet trained, with the restarts the staleness bound asked for (pure
    bookkeeping; the collector carries them out). Pickled into checkpoints: an episode with its verdict is saved
    whole; one without (under way, its environment open) is marked to start again.

    Args:
        group_size: ``G`` (>= 1).
        max_staleness: ``k`` (>= 1), the largest ``V - version`` of a trained token.

    Raises:
        ValueError: an argument below 1.
    """

    def __init__(self, group_size: int, max_staleness: int):
        if group_size < 1 or max_staleness < 1:
            raise ValueError(f"group_size={group_size} and max_staleness={max_staleness} must be >= 1")
        self.group_size, self.max_staleness = group_size, max_staleness
        self.groups: list[EpisodeGroup] = []
        self.next_serial = 0
        self.to_restart: set[tuple[int, int]] = set()  # (serial, sample_index)
        self.restarted_episodes = 0
        self.dropped_tokens = 0

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["to_restart"] = set(self.to_restart) | {(g.serial, e.sample_index) for g in self.groups
                                                      for e, v in zip(g.episodes, g.verdicts) if v is None}
        return state

    def mark(self, group: EpisodeGroup, e: Episode) -> None:
        """Ask for ``e`` to be started again (done by the collector before the next turn)."""
        self.to_restart.add((group.serial, e.sample_index))

    def expire(self, version: int) -> int:
        """Before a collection at ``version``: mark every episode whose oldest sampled token is older than
        ``version - max_staleness``. Returns how many were marked."""
        n = 0
        for g in self.groups:
            for e in g.episodes:
                old = oldest_version(e)
                if old is not None and version - old > self.max_staleness:
                    self.mark(g, e)
                    n += 1
        return n

    def restart_all(self) -> int:
        """After a health-guard rollback: mark every episode that has sampled a token (its weights were rolled
        over). Returns how many."""
        n = 0
        for g in self.groups:
            for e in g.episodes:
                if oldest_version(e) is not None:
                    self.mark(g, e)
                    n += 1
        return n

    def take(self, count: int, version: int) -> list[EpisodeGroup]:
        """Remove and return up to ``count`` scored groups (admission order) to train at ``version``.

        Raises:
            RuntimeError: a taken episode's oldest token is beyond the bound (``expire`` was not applied).
        """
        out, self.groups = take_ready(self.groups, count, lambda g: g.scored,
                                      lambda g: [v for e in g.episodes if (v := oldest_version(e)) is not None],
                                      version, self.max_staleness)
        return out

    def num_ended(self) -> int:
        """Groups whose episodes have all ended (scored or not)."""
        return sum(g.ended for g in self.groups)


class PartialEpisodeCollector:
    """``collect(step)`` like ``cluster.driver.collect.Collector`` for episodes that span weight syncs (module
    docstring); ``rounds_beside`` plays on while the learner trains (``trainer.partial_rollout_overlap``).

    Args:
        cfg: the run config (``trainer.partial_rollouts=true``, ``env`` set).
        stream: the training prompt stream (advances by the prompts admitted).
        runner: the ``EpisodeRunner`` (its engines, env workers and turn logic).
        version: returns the weight version the engines hold now.
    """

    def __init__(self, cfg: Config, stream: PromptStream, runner: EpisodeRunner, version: Callable[[], int]):
        self.cfg, self.stream, self.runner, self.version = cfg, stream, runner, version
        self._backlog = EpisodeBacklog(cfg.trainer.group_size, cfg.trainer.max_staleness)
        self.loop = TurnLoop()
        self.handles: dict[str, Any] = {}  # episode id -> the env worker it was started on
        self.stats: dict[str, float] = {}  # the last collection's partial/* metrics
        self._beside_s = 0.0  # seconds played beside the learner since the last collection

    @property
    def buffer(self) -> EpisodeBacklog:
        """The backlog (saved in checkpoints; ``restart_all`` after a rollback), as partial rollouts name it."""
        return self._backlog

    @buffer.setter
    def buffer(self, backlog: EpisodeBacklog) -> None:  # resume: what a checkpoint held
        self._backlog, self.loop, self.handles = backlog, TurnLoop(), {}

    # -- starting episodes --------------------------------------------------------------------------------
    def _new_episode(self, g: EpisodeGroup, k: int) -> Episode:
        G, pool = self.cfg.trainer.group_size, self.runner.pool
        g.attempts += 1
        seed = self.cfg.rollout.seed * 1_000_003 + g.serial
        return Episode(f"{g.row.uid}#{k}@p{g.serial}.{g.attempts}", g.row, k, seed, (g.serial * G + k) % len(pool),
                       group=g.serial)

    def _open(self, episodes: list[Episode]) -> None:
        """Start ``episodes`` in their environments; the loop takes each one as its environment answers (the
        engines sample other episodes meanwhile)."""
        for e in episodes:
            self.handles[e.episode_id] = self.runner.pool.workers[e.worker]
            self.loop.starting[self.runner.start_ref(e)] = e
            self.loop.by_id[e.episode_id] = e

    def _admit(self) -> None:
        """Keep ``2 P`` groups in the backlog: while some episodes wait on their tools, the engines have the
        other groups' turns to sample."""
        P, b = self.cfg.trainer.prompts_per_step, self._backlog
        count = 2 * P - len(b.groups)
        if count <= 0:
            return
        new = []
        for row in self.stream.take(count):
            g = EpisodeGroup(row, b.next_serial, [], [None] * self.cfg.trainer.group_size)
            b.next_serial += 1
            g.episodes = [self._new_episode(g, k) for k in range(self.cfg.trainer.group_size)]
            b.groups.append(g)
            new += g.episodes
        self._open(new)

    def _stale_worker(self, e: Episode) -> bool:
        pool = self.runner.pool
        return e.worker >= len(pool) or self.handles.get(e.episode_id) is not pool.workers[e.worker]

    def _restart(self) -> None:
        """Carry out the marked restarts, and restart the episodes under way whose env worker was replaced or
        removed; counted in ``restarted_episodes`` (an open turn of theirs, ``sync.in_flight``, is aborted)."""
        b, pool, again, gone = self._backlog, self.runner.pool, [], []
        for g in b.groups:
            for i, e in enumerate(g.episodes):
                open_env = g.verdicts[i] is None  # started and not finished: its environment is open
                lost = open_env and self._stale_worker(e)
                if (g.serial, e.sample_index) not in b.to_restart and not lost:
                    continue
                if open_env and not lost:
                    pool.workers[e.worker].abort.remote(e.episode_id)  # its environment, closed without a reward
                self._forget(e)
                gone.append(e)
                b.dropped_tokens += sum(e.mask)
                g.episodes[i], g.verdicts[i] = self._new_episode(g, e.sample_index), None
                again.append(g.episodes[i])
        b.to_restart.clear()
        b.restarted_episodes += len(again)
        b.dropped_tokens += self._drop_open_turns(gone)
        self._open(again)

    def _drop_open_turns(self, episodes: list[Episode]) -> int:
        """Abort the open turns of ``episodes`` on their engines (none when the loop was drained); returns the
        sampled tokens thrown away. A turn that ended in a call not read yet comes back later and is ignored
        (``EpisodeRunner.pump``: its episode is no longer in the loop)."""
        engines = self.runner.fleet.engines
        by_slot: dict[int, list[str]] = {}
        for e in episodes:
            slot = self.loop.on_engine.pop(e.episode_id, None)
            if slot is not None:
                by_slot.setdefault(slot, []).append(e.episode_id)
        if not by_slot:
            return 0
        slots = sorted(by_slot)
        tokens = 0
        for slot, (turns, lost) in zip(slots, ray.get([engines[j].drop_turns.remote(by_slot[j]) for j in slots])):
            self.loop.open_turns[slot] -= turns
            tokens += lost
        return tokens

    def _forget(self, e: Episode) -> None:
        """Drop an episode from the loop (an open turn of it is aborted by ``_drop_open_turns``); its env answer
        or its turn, if one is still coming, is ignored."""
        self.loop.ready = [x for x in self.loop.ready if x is not e]
        self.loop.stepping = {ref: x for ref, x in self.loop.stepping.items() if x is not e}
        self.loop.starting = {ref: x for ref, x in self.loop.starting.items() if x is not e}
        self.loop.by_id.pop(e.episode_id, None)
        self.handles.pop(e.episode_id, None)

    # -- playing ------------------------------------------------------------------------------------------
    def _score(self) -> None:
        """Score every episode that has ended (its environment gives the reward and is closed), then repair the
        env workers (those that died or hold too many abandoned threads are replaced; episodes under way there
        start again at the next collection)."""
        ended = [(g, i) for g in self._backlog.groups for i, e in enumerate(g.episodes)
                 if g.verdicts[i] is None and e.status != RUNNING]
        episodes = [g.episodes[i] for g, i in ended]
        for (g, i), verdict in zip(ended, self.runner.finish_episodes(episodes)):
            g.verdicts[i] = verdict
            self._forget(g.episodes[i])
        # a worker already replaced since (its episodes' handles are stale) is not replaced again
        self.runner.repair_pool({e.worker for e in episodes if e.worker_lost and not self._stale_worker(e)})

    @property
    def in_flight(self) -> bool:
        """True when weights load while turns are open (``sync.in_flight`` keep / recompute): no drain."""
        return self.cfg.sync.in_flight != "off"

    def drain_turns(self) -> None:
        """Let the open turns finish (no new turn starts): the engines hold no request (before a sync unless
        ``sync.in_flight``; before an evaluation, whose episodes share the engines)."""
        with self.runner.aborting_on_error():
            while not self.loop.drained():
                self.runner.pump(self.loop, None, submit=False)

    def _expire_ended(self, version: int) -> None:
        """``sync.in_flight``: a turn that ended may hold tokens of versions older than the bound (it was open
        across several loads): restart such episodes before their group can be taken."""
        if self.in_flight and self._backlog.expire(version):
            self._restart()

    def rounds_beside(self, stop: threading.Event) -> None:
        """``trainer.partial_rollout_overlap``: play on at the engines' current weights while the learner trains,
        until ``stop`` is set (then the open turns finish) or nothing is left to play."""
        t0 = time.perf_counter()
        with self.runner.aborting_on_error():
            self._restart()
            while not stop.is_set():
                self.runner.pump(self.loop, None)
                self._admit()
                if self.loop.idle():
                    break
            if not self.in_flight:
                self.drain_turns()
        self._beside_s += time.perf_counter() - t0

    def collect(self, step: int) -> Collected:
        """Play until ``trainer.prompts_per_step`` groups have every episode ended; those groups, scored, in
        admission order (``step`` is unused: each group's seed is its admission number). ``stats`` gets the
        collection's ``partial/*`` metrics."""
        P, version, b = self.cfg.trainer.prompts_per_step, self.version(), self._backlog
        c = Collected(step=step, start_position=self.stream.position)
        self.runner.fleet.settle()
        t0, restarted0, dropped0, busy0 = time.perf_counter(), b.restarted_episodes, b.dropped_tokens, self.loop.busy
        b.expire(version)
        with self.runner.aborting_on_error():
            self._restart()
            self._admit()  # also when P groups ended already: the backlog stays full for the next collection
            while b.num_ended() < P:
                self.runner.pump(self.loop, None)  # first the episodes carried over: the engines start at once
                self._expire_ended(version)
                self._admit()  # then new groups' environments start while the engines sample
                if self.loop.idle() and b.num_ended() < P:
                    raise RuntimeError(f"partial episodes: nothing under way with {b.num_ended()} of {P} groups "
                                       "ended")
            if not self.in_flight:
                self.drain_turns()
        self._score()
        wall = time.perf_counter() - t0
        groups = b.take(P, version)
        episodes = [e for g in groups for e in g.episodes]
        fill_missing_routing(episodes)
        c.prompts, c.completions = [g.row for g in groups], [e.completion() for e in episodes]
        c.results = [v for g in groups for v in g.verdicts]
        c.sampled = {e.episode_id: e.sampled for e in episodes}
        c.rollout_s, c.rounds = wall + self._beside_s, 1
        c.generated_tokens = sum(x.sampled_tokens for x in c.completions)
        busy = (self.loop.busy - busy0) / max(wall * len(self.runner.fleet.engines), 1e-9)
        c.reward_metrics = {**episode_metrics(episodes, busy), **self.runner.pool.take_metrics()}
        c.end_position = self.stream.position
        spans = [len(set(e.sampled_versions)) for e in episodes]
        self.stats = {
            "partial/restarted_episodes": float(b.restarted_episodes - restarted0),
            "partial/dropped_tokens": float(b.dropped_tokens - dropped0),
            "partial/multi_version_share": sum(s > 1 for s in spans) / max(1, len(spans)),
            "partial/in_flight_groups": float(len(b.groups)), "partial/beside_learner_s": self._beside_s,
        }
        self._beside_s = 0.0
        return c
