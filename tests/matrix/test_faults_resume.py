"""Faults injected for real (processes killed by PID, a half-written checkpoint) and exact resume.

Starts the real services (Ray, vLLM, DeepSpeed, reward workers) with a tiny per-step batch.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest

from tests.helpers.driver import _trainer


def _kill(pid):
    os.kill(pid, signal.SIGKILL)
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"pid {pid} did not die")


@pytest.fixture(scope="module")
def ray_session():
    yield
    import ray

    ray.shutdown()


def test_engine_and_reward_worker_death_and_scaling(tmp_path, ray_session):
    import ray

    # the weights go by broadcast (sync.transport=collective): the transfer group is rebuilt for every change of
    # the engines (a death, a replacement, scaling down and up); the object store is the default, tested elsewhere
    t = _trainer(tmp_path, "faults", ["trainer.total_steps=5", "rollout.num_engines=2", "reward.num_workers=2",
                                      "data.num_train=40", "sync.transport=collective"])
    t.start()
    try:
        t.warm_start()
        m1 = t.rl_step()
        assert m1["fault/rollout_restarts"] == 0 and m1["rollout/num_engines"] == 2
        assert t.last_sync["sync/collective"] == 1.0
        # an engine dies between steps: its share of the next step is generated again on a new engine
        _kill(t.fleet.pids()[1])
        m2 = t.rl_step()
        assert m2["fault/rollout_restarts"] == 1
        assert ray.get([e.weight_version.remote() for e in t.fleet.engines]) == [t.weight_version] * 2
        # scale down to 1 engine and back up to 2 through the run's control file, between steps
        (t.run_dir / "control.yaml").write_text("rollout.num_engines: 1\n")
        m3 = t.rl_step()
        assert m3["rollout/num_engines"] == 1
        (t.run_dir / "control.yaml").write_text("rollout.num_engines: 2\n")
        m4 = t.rl_step()
        assert m4["rollout/num_engines"] == 2
        # the new engine got the current weights (its version), not the model folder's
        assert ray.get([e.weight_version.remote() for e in t.fleet.engines]) == [t.weight_version] * 2
        # an engine dies just before a weight sync: reported by the learner, replaced, given the same version
        _kill(t.fleet.pids()[0])
        t._sync_weights(t.weight_version + 1)
        assert t.fleet.restarts == 2
        t._sync_weights(t.weight_version + 1)  # both engines again, the new one included: a new group
        assert t.last_sync["sync/collective"] == 1.0
        assert ray.get([e.weight_version.remote() for e in t.fleet.engines]) == [t.weight_version] * 2
        # a reward worker dies between steps: restarted, every completion scored, nothing lost. Whether the step's
        # call meets the dead process (fault/reward_restarts 1, its share rescored) or Ray's restart first (0)
        # is a race; the death in the middle of a call is test_reward_pool's, which waits for the call to start
        dead = t.rewards.worker_pids()[0]
        _kill(dead)
        m5 = t.rl_step()
        assert t.rewards.worker_pids()[0] != dead and m5["fault/reward_restarts"] in (0.0, 1.0)
        assert m5["reward/invalid"] == 0
        steps = t.trained_uids
        assert [len(s) for s in steps] == [8] * 5
        uids = [u for s in steps for u in s]
        assert len(set(uids)) == 40  # 40 training prompts, 5 steps of 8: each trained exactly once
    finally:
        t.shutdown()


def test_learner_death_stops_the_step_fast(tmp_path, ray_session):
    import ray

    from cluster.train import is_learner_error

    t = _trainer(tmp_path, "learner_dies", ["trainer.total_steps=2", "learner.dist_timeout_s=600"])
    t.start()
    try:
        pid = ray.get(t.learners.actors[1].pid.remote())
        _kill(pid)
        start = time.time()
        with pytest.raises(ray.exceptions.RayActorError) as err:
            t.rl_step()
        # fails as soon as the rank is gone, not after the 600 s collective timeout
        assert time.time() - start < 300
        assert is_learner_error(err.value)
    finally:
        t.shutdown()


def test_resume_is_exact_and_skips_half_written_checkpoints(tmp_path, ray_session):
    full = _trainer(tmp_path, "full", ["trainer.total_steps=4", "trainer.save_every=2"])
    full.start()
    try:
        full.run()
        ref_uids = list(full.trained_uids)
        ref_digest = full.learners.call("state_digest")
    finally:
        full.shutdown()
    run = tmp_path / "full"
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["step_00000002", "step_00000004"]
    # Simulate a crash while step 4's checkpoint was being written: only a temp folder of it remains.
    os.rename(run / "checkpoints" / "step_00000004", run / "checkpoints" / "step_00000004.tmp")
    (run / "checkpoints" / "step_00000004.tmp" / "COMPLETE").unlink()
    state = json.loads((run / "checkpoints" / "step_00000002" / "trainer_state.json").read_text())
    assert state["data_fingerprint"]["rows"] == 16
    # another seed would reorder the prompts under the restored position: refused before any actor starts
    from cluster.driver.checkpoint import ResumeMismatch

    reseeded = _trainer(tmp_path, "full", ["trainer.total_steps=4", "trainer.save_every=2", "trainer.resume=true",
                                           "trainer.seed=1"])
    with pytest.raises(ResumeMismatch, match="trainer.seed: checkpoint 0, config 1"):
        reseeded.start()
    assert reseeded.learners is None and getattr(reseeded, "fleet", None) is None
    resumed = _trainer(tmp_path, "full", ["trainer.total_steps=4", "trainer.save_every=2", "trainer.resume=true"])
    resumed.start()
    try:
        assert resumed.step == 2 and resumed.stream.position == 16  # exactly one epoch
        resumed.run()
        assert resumed.trained_uids == ref_uids[2:]  # the same prompts as the uninterrupted run
        digest = resumed.learners.call("state_digest")
        assert digest == ref_digest, "resumed run diverged from the uninterrupted one"
    finally:
        resumed.shutdown()
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [0, 1, 2, 3, 4]  # one line per step, no duplicates after resume
    shutil.rmtree(run / "checkpoints" / "step_00000004.tmp", ignore_errors=True)


def test_health_guard_skips_rolls_back_and_stops(tmp_path, ray_session):
    from cluster.driver.guard import HealthStop

    t = _trainer(tmp_path, "health", ["trainer.total_steps=20", "health.enabled=true", "health.rollback_after=2",
                                      "health.max_rollbacks=1", "health.max_grad_norm=1e6"])
    t.start()
    try:
        t.warm_start()
        assert t.rl_step().get("health/skipped") == 0.0
        # DAPO dynamic sampling is bounded: groups whose rewards are all equal are dropped and refilled for at
        # most max_sampling_rounds extra rounds, then the step trains on what it has (possibly nothing).
        t.cfg.trainer.dynamic_sampling, t.cfg.trainer.max_sampling_rounds = True, 2
        position = t.stream.position
        m = t.rl_step()
        trained, dropped, rounds = m["sampling/groups_trained"], m["sampling/dropped_groups"], m["sampling/rounds"]
        assert 1 <= rounds <= 3 and trained + dropped <= t.stream.position - position
        # trained on whole groups, a multiple of num_minibatches (4) x world_size (2)
        assert trained == len(t.trained_uids[-1]) and trained % 8 == 0
        if trained < 8:
            assert rounds == 3  # it stopped at the bound
        t.cfg.trainer.dynamic_sampling = False
        t.save()
        good = t.learners.call("state_digest")
        version = t.weight_version
        t.cfg.health.min_entropy = 1e9  # a check that every step now fails (entropy is far below)
        m = t.rl_step()
        assert m["health/skipped"] == 1.0 and "min_entropy" in m["health/failed_checks"]
        assert t.learners.call("state_digest") == good  # update skipped exactly
        assert t.weight_version == version  # nothing synced
        m = t.rl_step()  # second failure in a row: roll back to the checkpoint
        assert m["health/rollbacks"] == 1.0
        assert t.learners.call("state_digest") == good
        t.rl_step()
        with pytest.raises(HealthStop, match="min_entropy"):
            t.rl_step()  # still failing after a rollback: stop with a report
        report = json.loads((t.run_dir / "health_report.json").read_text())
        assert report["failed_checks"] == ["min_entropy"] and report["rollbacks"] == 1
    finally:
        t.shutdown()
