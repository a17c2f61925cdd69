"""The deadlines' config, their error and the debug hook, without Ray (the waits on real actors are in
tests/integration/test_deadlines.py)."""

from __future__ import annotations

import pickle
import threading
import time

import pytest

from cluster.config import load_config
from cluster.config_sections import DEADLINE_PHASES, DeadlinesConfig
from cluster.runtime import deadlines
from tests.helpers import REPO_ROOT


def test_every_phase_has_a_deadline_and_checkpoints_share_one():
    d = DeadlinesConfig(checkpoint_s=7.0, generation_s=3.0)
    assert {p: d.seconds(p) for p in DEADLINE_PHASES}["checkpoint_load"] == 7.0 == d.seconds("checkpoint_save")
    assert d.seconds("generation") == 3.0
    with pytest.raises(KeyError, match="unknown deadline phase 'judge'"):
        d.seconds("judge")
    with pytest.raises(ValueError, match="debug_hang"):
        DeadlinesConfig(debug_hang="nap")
    with pytest.raises(ValueError, match="reward_s"):
        DeadlinesConfig(reward_s=0)


@pytest.mark.parametrize("name", ["tiny_moe.yaml", "qwen3_30b_a3b_gsm8k.yaml"])
def test_shipped_configs_deadlines_leave_room_for_their_inner_timeouts(name):
    cfg = load_config(REPO_ROOT / "configs" / name)
    d = cfg.deadlines
    assert d.sync_s > 2 * cfg.sync.engine_timeout_s  # the learner's sync outlives its engine waits
    assert d.learner_step_s > cfg.learner.dist_timeout_s  # a stuck collective is named by the peers' timeout
    assert d.reward_s > cfg.reward.timeout_s and d.env_s > cfg.env.tool_timeout_s


def test_config_refuses_a_sync_deadline_inside_the_engine_timeout():
    with pytest.raises(ValueError, match="deadlines.sync_s=100 must be above"):
        load_config(REPO_ROOT / "configs" / "tiny_moe.yaml", ["deadlines.sync_s=100"])


def test_phase_timeout_names_actor_node_phase_step_and_key_and_pickles():
    err = deadlines.PhaseTimeout("reward", "RewardWorker pid 42", "10.0.0.7 (node ab12)", 3, 5.0,
                                 "deadlines.reward_s", "reward worker 1")
    text = str(err)
    for part in ("RewardWorker pid 42", "10.0.0.7 (node ab12)", "'reward'", "RL step 3", "5s", "deadlines.reward_s",
                 "reward worker 1", "stacks"):
        assert part in text, part
    again = pickle.loads(pickle.dumps(err))
    assert (again.phase, again.actor, again.node, again.step, again.timeout_s) == ("reward", err.actor, err.node, 3, 5.0)
    assert str(again) == text
    assert "before the first RL step" in str(deadlines.PhaseTimeout("start", "a", "n", None, 1.0, "k"))


def test_collective_timeouts_are_told_from_other_errors():
    assert deadlines._is_collective_timeout(RuntimeError("DistBackendError: [..] Timed out waiting 300000ms"))
    assert deadlines._is_collective_timeout(RuntimeError("gloo collective timed out after 5s"))
    assert not deadlines._is_collective_timeout(RuntimeError("CUDA out of memory"))


class Worker:
    def score(self, x):
        return x + 1

    def other(self, x):
        return x


def test_hang_hook_is_off_unless_its_phase_is_named():
    assert deadlines.hang_hook(Worker, ("score",), "reward", DeadlinesConfig()) is Worker
    assert deadlines.hang_hook(Worker, ("score",), "reward", DeadlinesConfig(debug_hang="generation")) is Worker


def test_hang_hook_hangs_the_first_call_of_the_run_only():
    settings = DeadlinesConfig(debug_hang="reward", debug_hang_s=3.0)
    a = deadlines.hang_hook(Worker, ("score",), "reward", settings)
    b = deadlines.hang_hook(Worker, ("score",), "reward", settings)  # a replacement's class: the same marker
    assert a is not Worker and issubclass(a, Worker) and a.__name__ == "Worker"
    assert a().other(1) == 1  # methods not named do not hang
    answers = []
    first = threading.Thread(target=lambda: answers.append(a().score(1)), daemon=True)
    first.start()
    while not first.is_alive():
        time.sleep(0.01)
    time.sleep(0.2)  # the first call is in its sleep
    assert b().score(5) == 6 and a().score(6) == 7  # later calls, the replacement's too, do not hang
    assert first.is_alive() and answers == []
    first.join()
    assert answers == [2]  # the hung call still runs after its sleep
    other_run = deadlines.hang_hook(Worker, ("score",), "reward", DeadlinesConfig(debug_hang="reward", debug_hang_s=60))
    hung = threading.Thread(target=lambda: other_run().score(0), daemon=True)
    hung.start()
    hung.join(timeout=0.5)
    assert hung.is_alive()  # another run (another section) hangs once too


def test_a_phase_timeout_stops_gspo_train_with_exit_code_6_naming_it(tmp_path, monkeypatch, capsys):
    import cluster.driver.trainer as trainer_module
    from cluster.train import main

    class StuckTrainer:
        def __init__(self, cfg, verbose=True):
            self.run_dir, self.step, self.shut = cfg.run_dir, 0, False

        def start(self):
            raise deadlines.PhaseTimeout("learner_step", "LearnerRank pid 9", "10.0.0.1 (node ab)", 1, 5.0,
                                         "deadlines.learner_step_s")

        def shutdown(self):
            self.shut = True

    monkeypatch.setattr(trainer_module, "Trainer", StuckTrainer)
    code = main([str(REPO_ROOT / "configs" / "tiny_moe.yaml"), f"trainer.output_dir={tmp_path}", "wandb.mode=disabled"])
    err = capsys.readouterr().err
    assert code == 6 and "LearnerRank pid 9 on 10.0.0.1" in err and "no checkpoint was written yet" in err, err
