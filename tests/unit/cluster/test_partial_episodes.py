"""Partial rollouts of episodes: the backlog's staleness bound, rollback restarts, checkpoint state and take
order (pure bookkeeping, hand-built episodes), and R3 routing spliced turn by turn."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from cluster.driver.episodes import Episode, spliced_routing
from cluster.driver.partial_episodes import EpisodeBacklog, EpisodeGroup, oldest_version
from reward.contracts import RewardResult
from rollout.contracts import PromptRow


def group(serial: int, versions: list[list[int]], scored: list[bool]) -> EpisodeGroup:
    """A group of len(versions) episodes; episode k sampled one token per entry of versions[k] (then a reply)."""
    row = PromptRow(f"p{serial}", "q", [1, 2], "a")
    eps = []
    for k, vs in enumerate(versions):
        e = Episode(f"p{serial}#{k}", row, k, seed=serial, worker=0, group=serial, prompt_ids=[1, 2])
        for v in vs:
            e.add([7], [-0.5], v)
            e.add([8, 9], None, v)  # the environment's reply: not sampled, never decides the age
        e.status = "ok" if scored[k] else "running"
        eps.append(e)
    verdicts = [RewardResult(score=1.0) if s else None for s in scored]
    return EpisodeGroup(row, serial, eps, verdicts)


def test_oldest_version_counts_sampled_tokens_only():
    g = group(0, [[3, 5], []], [True, False])
    assert oldest_version(g.episodes[0]) == 3 and oldest_version(g.episodes[1]) is None
    g.episodes[0].versions[1] = 0  # a reply token's version (mask 0) is not a sampled token's
    assert oldest_version(g.episodes[0]) == 3


def test_expire_marks_episodes_older_than_the_bound_and_take_keeps_admission_order():
    b = EpisodeBacklog(group_size=2, max_staleness=1)
    b.groups = [group(0, [[4], [5]], [True, True]), group(1, [[6], [6, 7]], [True, False]),
                group(2, [[6], [7]], [True, True])]
    assert b.expire(6) == 1 and b.to_restart == {(0, 0)}  # 6 - 4 = 2 > 1; 6 - 5 = 1 is within the bound
    b.to_restart.clear()
    taken = b.take(5, 5)  # (as if group 0's old episode had started again)
    assert [g.serial for g in taken] == [0, 2] and [g.serial for g in b.groups] == [1]  # group 1: one unscored
    b.groups = [group(3, [[2], [6]], [True, True])]
    with pytest.raises(RuntimeError, match="4 versions old at version 6"):
        b.take(1, 6)


def test_restart_all_marks_every_episode_with_sampled_tokens():
    b = EpisodeBacklog(group_size=3, max_staleness=2)
    b.groups = [group(0, [[1], [], [1, 2]], [True, False, False])]
    assert b.restart_all() == 2 and b.to_restart == {(0, 0), (0, 2)}


def test_a_checkpoint_keeps_scored_episodes_and_marks_the_others_to_start_again():
    b = EpisodeBacklog(group_size=2, max_staleness=1)
    b.groups = [group(0, [[1], [1, 2]], [True, False]), group(1, [[2], [2]], [True, True])]
    b.to_restart = {(1, 1)}
    saved = pickle.loads(pickle.dumps(b))
    assert saved.to_restart == {(0, 1), (1, 1)} and b.to_restart == {(1, 1)}
    assert saved.groups[0].episodes[0].sampled == [7] and saved.groups[0].verdicts[0].score == 1.0
    with pytest.raises(ValueError, match="must be >= 1"):
        EpisodeBacklog(group_size=2, max_staleness=0)


def test_spliced_routing_keeps_each_turns_own_rows():
    before = np.zeros((5, 2, 1), dtype=np.int16)  # 5 positions up to the last turn's final sampled token
    turn = np.ones((9, 2, 1), dtype=np.int16)  # the new turn's forward recomputed them (new weights) and 4 more
    out = spliced_routing(before, turn)
    assert out.shape == (9, 2, 1) and (out[:5] == 0).all() and (out[5:] == 1).all()
    assert spliced_routing(None, turn) is turn and spliced_routing(before, None) is None
    with pytest.raises(ValueError, match="does not extend"):
        spliced_routing(before, turn[:4])
