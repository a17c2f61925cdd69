"""Every wait has a deadline: a hang injected per phase through ``deadlines.debug_hang`` (cluster/runtime/deadlines.py)
is seen as a ``PhaseTimeout`` naming the actor, its node, the phase and the step, with the stuck process's Python
stacks in the log, within the deadline the test sets (seconds; the pytest timeouts are far above them and only
guard against a regression hanging the suite)."""

from __future__ import annotations

import logging

import pytest

from cluster.config_sections import DeadlinesConfig
from cluster.runtime import deadlines

HANG = 600.0  # the injected hang: far longer than any deadline below, so only a deadline can end the wait


class Sleeper:
    def pid(self) -> int:
        import os

        return os.getpid()

    def work(self, x: int) -> int:
        return x * 2


def _stacks_logged(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.getMessage().startswith("Python stacks of"))


@pytest.mark.timeout(120)
def test_get_names_the_stuck_actor_its_node_phase_and_step_and_logs_its_stacks(ray_cluster, caplog):
    ray = ray_cluster
    settings = DeadlinesConfig(debug_hang="reward", debug_hang_s=HANG)
    cls = ray.remote(deadlines.hang_hook(Sleeper, ("work",), "reward", settings)).options(num_cpus=0)
    actors = [cls.remote() for _ in range(2)]
    pids = ray.get([a.pid.remote() for a in actors])
    assert deadlines.get([a.work.remote(i) for i, a in enumerate(actors[:1])], actors[:1], "reward", 1.0, "k") == [0]
    deadlines.set_step(7)
    caplog.set_level(logging.ERROR, logger="cluster.runtime.deadlines")
    try:
        refs = [actors[1].work.remote(3), actors[0].work.remote(4)]  # actor 1's is the run's first hooked call
        with pytest.raises(deadlines.PhaseTimeout) as info:
            deadlines.get(refs, [actors[1], actors[0]], "reward", 2.0, "deadlines.reward_s")
        err = info.value
        assert (err.phase, err.step, err.timeout_s) == ("reward", 7, 2.0)
        assert err.actor == f"Sleeper pid {pids[1]}" and err.node.startswith("127.0.0.1 (node ")
        assert "1 of 2 calls unanswered" in str(err) and "RL step 7" in str(err)
        stacks = _stacks_logged(caplog)
        assert f"pid {pids[1]}" in stacks and "deadlines.py" in stacks and "method" in stacks, stacks
        assert ray.get(actors[0].work.remote(5)) == 10  # the other actor answered and is free
    finally:
        deadlines.set_step(None)
        for a in actors:
            ray.kill(a)


@pytest.mark.timeout(180)
def test_a_reward_worker_past_its_deadline_is_replaced_and_its_share_scored_once(ray_cluster, caplog):
    from reward.config import RewardConfig
    from reward.contracts import RewardRequest
    from reward.pool import RewardPool
    from rollout.contracts import PromptRow

    settings = DeadlinesConfig(reward_s=3.0, debug_hang="reward", debug_hang_s=HANG)
    caplog.set_level(logging.ERROR, logger="cluster.runtime.deadlines")
    deadlines.set_step(2)
    pool = RewardPool(RewardConfig(num_workers=2, num_cpus_per_worker=0.25), **deadlines.reward_pool_options(settings))
    try:
        pids = pool.worker_pids()
        reqs = [RewardRequest(str(i if i % 3 else i + 1), PromptRow(uid=f"u{i}", prompt="p", prompt_token_ids=[],
                                                                     answer=str(i), verifier="exact"))
                for i in range(6)]
        res = pool.score(reqs)
        assert [r.score for r in res] == [0.0 if i % 3 == 0 else 1.0 for i in range(6)]  # each scored once, in order
        assert pool.metrics()["fault/reward_restarts"] == 1
        new = pool.worker_pids()
        assert len(set(new) - set(pids)) == 1  # the stuck worker was replaced, the other kept
        errors = [r.getMessage() for r in caplog.records if "did not finish phase 'reward'" in r.getMessage()]
        assert len(errors) == 1 and "RewardWorker pid" in errors[0] and "RL step 2" in errors[0], errors
        assert "deadlines.reward_s" in errors[0] and "127.0.0.1" in errors[0]
        assert "score" in _stacks_logged(caplog)
    finally:
        deadlines.set_step(None)
        pool.shutdown()
