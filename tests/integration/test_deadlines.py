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


def _nodes(ray) -> set[str]:
    """The live nodes as a ``PhaseTimeout`` names them: ``"<ip> (node <node id's first 12 characters>)"``."""
    return {f"{n['NodeManagerAddress']} (node {n['NodeID'][:12]})" for n in ray.nodes() if n["Alive"]}


def _stacks_logged(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.getMessage().startswith("Python stacks of"))


@pytest.mark.timeout(120)
def test_get_names_the_stuck_actor_its_node_phase_and_step_and_logs_its_stacks(ray_cluster, caplog):
    ray = ray_cluster
    settings = DeadlinesConfig(debug_hang="reward", debug_hang_s=HANG)
    cls = ray.remote(deadlines.hang_hook(Sleeper, ("work",), "reward", settings)).options(num_cpus=0)
    actors = [cls.remote() for _ in range(2)]
    pids = ray.get([a.pid.remote() for a in actors])
    deadlines.set_step(7)
    caplog.set_level(logging.ERROR, logger="cluster.runtime.deadlines")
    try:
        hung = actors[1].work.remote(3)  # the run's first hooked call
        assert not ray.wait([hung], timeout=1.0)[0]
        refs = [hung, actors[0].work.remote(4)]
        with pytest.raises(deadlines.PhaseTimeout) as info:
            deadlines.get(refs, [actors[1], actors[0]], "reward", 2.0, "deadlines.reward_s")
        err = info.value
        assert (err.phase, err.step, err.timeout_s) == ("reward", 7, 2.0)
        assert err.actor == f"Sleeper pid {pids[1]}" and err.node in _nodes(ray)
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
        assert "deadlines.reward_s" in errors[0] and any(node in errors[0] for node in _nodes(ray_cluster))
        assert "score" in _stacks_logged(caplog)
    finally:
        deadlines.set_step(None)
        pool.shutdown()


def _learner_config(phase: str, seconds: float):
    from cluster.config import load_config
    from tests.helpers import REPO_ROOT

    return load_config(REPO_ROOT / "configs" / "tiny_moe_zero2.yaml", [
        "learner.world_size=1", "learner.num_cpus_per_rank=0.5", "wandb.mode=disabled", "sync.engine_timeout_s=1",
        f"deadlines.debug_hang={phase}", f"deadlines.debug_hang_s={HANG}", f"deadlines.learner_step_s={seconds}",
        f"deadlines.sync_s={seconds}", f"deadlines.checkpoint_s={seconds}"])


def _learner_call(group, phase: str, tmp_path):
    from tests.helpers.sync import sft_batch

    if phase == "learner_step":
        return group.sft_step(sft_batch(0), 8 * 12)
    if phase == "sync":
        return group.sync_weights([], 1, 64.0, 2, 1.0)
    if phase == "checkpoint_load":
        group.save_checkpoint(str(tmp_path / "ck"))  # not hooked: the load is
        return group.load_checkpoint(str(tmp_path / "ck"))
    return group.save_checkpoint(str(tmp_path / "ck"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("phase", ["learner_step", pytest.param("sync", marks=pytest.mark.matrix),
                                   pytest.param("checkpoint_save", marks=pytest.mark.matrix),
                                   pytest.param("checkpoint_load", marks=pytest.mark.matrix)])
def test_a_stuck_learner_rank_stops_the_call_with_its_phase_timeout(ray_cluster, model_path, tmp_path, caplog,
                                                                     phase):
    from cluster.runtime.learner_group import LearnerGroup

    caplog.set_level(logging.ERROR, logger="cluster.runtime.deadlines")
    group = LearnerGroup(_learner_config(phase, 3.0), model_path)
    deadlines.set_step(4)
    try:
        group.wait_ready()
        pid = group.call("pid")[0]
        with pytest.raises(deadlines.PhaseTimeout) as info:
            _learner_call(group, phase, tmp_path)
        err = info.value
        assert (err.phase, err.step, err.timeout_s, err.actor) == (phase, 4, 3.0, f"LearnerRank pid {pid}")
        assert err.key == ("deadlines.checkpoint_s" if phase.startswith("checkpoint") else f"deadlines.{phase}_s")
        assert err.node in _nodes(ray_cluster)
        stacks = _stacks_logged(caplog)
        assert f"pid {pid}" in stacks and "deadlines.py" in stacks, stacks
    finally:
        deadlines.set_step(None)
        for actor in group.actors:  # the stuck rank would hold shutdown's own call for its 30 s
            ray_cluster.kill(actor)
        group.shutdown()


@pytest.mark.matrix  # an engine started twice (the stuck one and its replacement)
@pytest.mark.timeout(400)
def test_a_stuck_rollout_engine_is_replaced_and_its_prompts_generated_once(ray_cluster, tiny_moe, tmp_path, caplog):
    from transformers import AutoTokenizer

    from cluster.config import load_config
    from cluster.runtime.services import EngineFleet
    from tests.helpers import REPO_ROOT
    from tests.helpers.rollout import rows

    cfg = load_config(REPO_ROOT / "configs" / "tiny_moe_zero2.yaml", [
        "rollout.num_cpus_per_engine=0.5", "wandb.mode=disabled", "deadlines.debug_hang=generation",
        f"deadlines.debug_hang_s={HANG}", "deadlines.generation_s=5"])
    caplog.set_level(logging.ERROR, logger="cluster.runtime.deadlines")
    fleet = EngineFleet(cfg, str(tiny_moe), tmp_path / "cache", weight_sync=None)
    try:
        fleet.start(1)
        prompts = rows(AutoTokenizer.from_pretrained(tiny_moe), ["1+2=", "3+4=", "5+6="])
        out = fleet.generate(prompts, 2, seed=3)
        assert fleet.restarts == 1 and len(out) == 6 and all(c is not None for c in out)
        assert [c.prompt_uid for c in out] == [p.uid for p in prompts for _ in range(2)]  # each prompt's group once
        errors = [r.getMessage() for r in caplog.records if "did not finish phase 'generation'" in r.getMessage()]
        assert len(errors) == 1 and "RolloutEngine pid" in errors[0] and "deadlines.generation_s" in errors[0]
    finally:
        fleet.shutdown()


@pytest.mark.timeout(240)
def test_a_stuck_env_worker_ends_its_episodes_as_lost_and_is_replaced(ray_cluster, tiny_moe, caplog):
    from transformers import AutoTokenizer

    from cluster.config import load_config
    from cluster.data.agent_calc import agent_calc_rows
    from cluster.driver.agent_loop import EpisodeRunner
    from cluster.driver.env_pool import EnvPool
    from cluster.driver.episodes import Episode
    from tests.helpers import REPO_ROOT

    cfg = load_config(REPO_ROOT / "configs" / "tiny_agent_calc.yaml", [
        "env.num_workers=2", "env.num_cpus_per_worker=0.25", "wandb.mode=disabled", "deadlines.debug_hang=env",
        f"deadlines.debug_hang_s={HANG}", "deadlines.env_s=3"])
    tok = AutoTokenizer.from_pretrained(tiny_moe)
    rows, _ = agent_calc_rows(lambda text: tok(text)["input_ids"], num_terms=2, num_train=4, num_eval=0, seed=1)
    caplog.set_level(logging.ERROR, logger="cluster.runtime.deadlines")
    deadlines.set_step(5)
    pool = EnvPool(cfg, lambda slot: "DEFAULT")
    try:
        runner = EpisodeRunner(cfg, None, pool, tok)
        episodes = [Episode(f"{r.uid}#0", r, 0, seed=i, worker=i % 2) for i, r in enumerate(rows)]
        runner.start_episodes(episodes)
        lost = [e for e in episodes if e.worker_lost]
        assert len(lost) == 2 and len({e.worker for e in lost}) == 1 and all(e.status == "error" for e in lost)
        assert all(e.prompt_ids for e in episodes if not e.worker_lost)  # the other worker's episodes started
        errors = [r.getMessage() for r in caplog.records if "did not finish phase 'env'" in r.getMessage()]
        assert len(errors) == 1 and "EnvWorker pid" in errors[0] and "RL step 5" in errors[0], errors
        assert f"env worker {lost[0].worker}" in errors[0] and "deadlines.env_s" in errors[0]
        old = pool.workers[lost[0].worker]
        runner.repair_pool({lost[0].worker})
        assert pool.restarts == 1 and pool.workers[lost[0].worker] is not old and not runner.stuck_workers
    finally:
        deadlines.set_step(None)
        pool.shutdown()


@pytest.mark.matrix  # two ranks start
@pytest.mark.timeout(300)
def test_a_peers_collective_timeout_names_the_stuck_rank(ray_cluster, model_path, caplog):
    from cluster.config import load_config
    from cluster.runtime.learner_group import LearnerGroup
    from tests.helpers import REPO_ROOT
    from tests.helpers.sync import sft_batch

    cfg = load_config(REPO_ROOT / "configs" / "tiny_moe_zero2.yaml", [
        "learner.world_size=2", "learner.num_cpus_per_rank=0.5", "wandb.mode=disabled", "sync.engine_timeout_s=1",
        "learner.dist_timeout_s=5", "deadlines.debug_hang=learner_step", f"deadlines.debug_hang_s={HANG}",
        "deadlines.learner_step_s=120"])  # the peer's collective timeout comes first
    caplog.set_level(logging.ERROR, logger="cluster.runtime.deadlines")
    group = LearnerGroup(cfg, model_path)
    try:
        group.wait_ready()
        pids = group.call("pid")
        with pytest.raises(deadlines.PhaseTimeout) as info:
            group.sft_step(sft_batch(0), 8 * 12)
        err = info.value
        assert err.phase == "learner_step" and err.actor in {f"LearnerRank pid {p}" for p in pids}
        assert "collective timed out waiting for it" in str(err)
    finally:
        for actor in group.actors:
            ray_cluster.kill(actor)
        group.shutdown()


@pytest.mark.matrix  # two engine starts (the stuck judge engine and its replacement)
@pytest.mark.xfail(reason="the deadline, its PhaseTimeout and the replacement pass; the replacement's first answers "
                   "were not ok/unparsed in one of two runs (the other passed), not yet diagnosed", strict=False)
@pytest.mark.timeout(400)
def test_a_stuck_judge_engine_gives_invalid_samples_names_itself_and_is_replaced(ray_cluster, tiny_moe, tmp_path,
                                                                                caplog):
    import math

    from cluster.runtime.judge import JudgeFleet
    from tests.helpers.judge import judge_requests, tiny_judge_config

    caplog.set_level(logging.ERROR, logger="cluster.runtime.deadlines")
    fleet = JudgeFleet(tiny_judge_config(tiny_moe, timeout_s=5), str(tiny_moe), tmp_path / "cache",
                       run_deadlines=DeadlinesConfig(debug_hang="judge", debug_hang_s=HANG))
    try:
        out = fleet.judge(judge_requests())
        assert all(math.isnan(j.score) and j.status == "timeout" for j in out) and fleet.replaced == 1
        errors = [r.getMessage() for r in caplog.records if "did not finish phase 'judge'" in r.getMessage()]
        assert len(errors) == 1 and "reward.judge.timeout_s" in errors[0] and "pid" in errors[0], errors
        fleet.settings = fleet.settings.model_copy(update={"timeout_s": 300})  # room for the new engine's start
        again = fleet.judge(judge_requests())  # the new engine answers
        assert all(j.status in ("ok", "unparsed") for j in again), [(j.status, j.detail) for j in again]
    finally:
        fleet.shutdown()


@pytest.mark.matrix  # a whole run's start (learner, engine, reward worker)
@pytest.mark.timeout(900)
def test_a_run_with_a_stuck_learner_step_stops_with_exit_6_and_the_stacks_in_its_log(tmp_path):
    import os
    import subprocess
    import sys

    from tests.helpers import REPO_ROOT, TEST_ENV

    cmd = [sys.executable, "-m", "cluster.train", str(REPO_ROOT / "configs" / "tiny_moe.yaml"), "trainer.total_steps=2",
           "warm_start.steps=0", "trainer.eval_every=0", "trainer.plots=false", "wandb.mode=disabled",
           f"trainer.output_dir={tmp_path}", "trainer.run_name=stuck", "deadlines.debug_hang=learner_step",
           f"deadlines.debug_hang_s={HANG}", "deadlines.learner_step_s=10"]
    env = {**TEST_ENV, **os.environ, "PYTHONPATH": str(REPO_ROOT)}  # this environment's values win
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=800, cwd=REPO_ROOT)
    assert done.returncode == 6, done.stderr[-3000:]
    assert "did not finish phase 'learner_step' within 10s (deadlines.learner_step_s) at RL step 1" in done.stderr
    log = (tmp_path / "stuck" / "logs" / "driver.log").read_text()
    assert "Python stacks of LearnerRank pid" in log and "train_rollout_batch" in log, log[-3000:]
