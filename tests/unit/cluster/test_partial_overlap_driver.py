"""trainer.partial_rollout_overlap in the driver's step, without Ray or vLLM: the real ``Trainer.rl_step`` with a
scripted fleet (``BesideFleet``: the learner's step lasts a set number of rounds beside it) and a stand-in learner
and sync. The segment default lets every sample finish within the bound, no rounds run beside the learner before
a monitored step or after the last step, and an error in the rollout thread stops the step before the sync.
The real engines are in tests/integration/test_partial_rollouts.py. (Written from a review's harness.) On the same
harness: how the step logs the learner's ``RolloutTrainResult``."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cluster.driver.partial_rollout import segment_tokens
from cluster.driver.resume import DriverState
from cluster.driver.trainer import Trainer, monitor_step
from cluster.driver.guard import GuardPolicy
from learner.contracts import BY_LENGTH_KEY, RolloutTrainResult
from tests.helpers.partial import ScriptedFleet, collector


class BesideFleet(ScriptedFleet):
    """The learner's step lasts ``budget`` rounds beside it (``stop`` set during the budget-th)."""

    def __init__(self, budget: int = 100):
        super().__init__()
        self.stop, self.budget, self.left = None, budget, 0
        self.restarts, self.fail_beside = 0, False

    def __len__(self):
        return 1

    def generate_stream(self, rows, n, **kw):
        if self.stop is not None:
            if self.fail_beside:
                self.learner_done.set()
                raise RuntimeError("engine slot 0 died 4 times in one step")
            self.left -= 1
            if self.left <= 0:  # the learner finishes during this round: deterministic, no timing involved
                self.stop.set()
                self.learner_done.set()
        yield from super().generate_stream(rows, n, **kw)


class FakeRewards:
    num_workers = 1


def make_trainer(tmp_path: Path, *extra: str, budget: int = 100) -> tuple[Trainer, BesideFleet]:
    col, fleet = collector("trainer.max_staleness=2", "trainer.partial_rollout_overlap=true", *extra,
                            fleet=BesideFleet(budget))
    t = object.__new__(Trainer)
    t.cfg, t.run_dir, t.state, t.pending, t.collector, t.fleet = col.cfg, tmp_path, DriverState(), None, col, fleet
    t.stream, t.rewards, t.last_sync, t.trained_uids = col.stream, FakeRewards(), {}, []
    t._pool = ThreadPoolExecutor(max_workers=1)
    t.batches, t.monitored = [], []
    real_submit = t._pool.submit

    def submit(fn, *a):  # hand the stop event to the fleet, as the learner finishing would set it
        if a and isinstance(a[0], threading.Event):
            fleet.stop, fleet.left, fleet.learner_done = a[0], fleet.budget, threading.Event()
            fut = real_submit(fn, *a)
            fut.add_done_callback(lambda f, done=fleet.learner_done: done.set())  # nothing left to sample
            return fut
        return real_submit(fn, *a)

    t._pool.submit = submit

    def train(c, rewards):
        if fleet.stop is not None:  # the learner's step lasts until the budget-th round beside it (or all done)
            fleet.learner_done.wait(timeout=5)
        t.batches.append([t.weight_version - x.weight_version for x in c.completions])
        t.monitored.append(monitor_step(t.cfg, t.step + 1))
        return RolloutTrainResult(loss=0.0, optimizer_steps=1, grad_norm=0.0), 0.0

    def sync(version):
        fleet.version = t.state.weight_version = version
        fleet.stop = None
        return 0.01

    t.train, t._sync_weights = train, sync
    t.after_train = lambda result, m: sync(t.weight_version + 1)
    return t, fleet


def test_default_segment_lets_every_sample_finish_within_the_bound_beside_the_learner(tmp_path):
    """Beside a learner step that lasts one round, a collection that starts with P finished groups runs no round,
    so a sample begun beside the learner gets one segment per version: the default segment (max_response_tokens
    / k with the overlap, not / (k + 1)) still lets it finish within the bound, so nothing is dropped."""
    t, fleet = make_trainer(tmp_path, "trainer.partial_segment_tokens=null", budget=1)  # the default
    assert t.collector.segment == segment_tokens(12, 1) == 6  # with the overlap: max_response_tokens / k
    for _ in range(12):
        t.rl_step()
    assert t.collector.buffer.restarted_samples == 0, (t.collector.buffer.restarted_samples,
                                                      t.collector.buffer.dropped_tokens)


def test_no_rounds_run_beside_the_learner_before_a_monitored_step(tmp_path):
    """As the one-step overlap collects nothing ahead before a monitored step, no rounds run beside the learner
    step before one (learner.mismatch_monitor_every=5: steps 1, 6, 11); every other step but the last has them."""
    t, fleet = make_trainer(tmp_path, "learner.mismatch_monitor_every=5", "trainer.total_steps=12")
    beside = [t.rl_step()["partial/rounds_beside_learner"] for _ in range(12)]
    assert [s + 1 for s in range(12) if monitor_step(t.cfg, s + 1)] == [1, 6, 11]
    assert beside[5] == beside[10] == 0 and beside[0] == 0  # the steps after the skipped learner steps
    assert all(beside[i] >= 1 for i in (1, 2, 3, 4, 6, 7, 8, 9, 11)), beside


def test_an_exception_in_the_rollout_thread_stops_the_step_before_the_sync(tmp_path):
    t, fleet = make_trainer(tmp_path, "trainer.total_steps=4")
    t.rl_step()
    fleet.fail_beside = True
    with pytest.raises(RuntimeError, match="died 4 times"):
        t.rl_step()
    assert t.step == 1 and t.weight_version == 1  # step 2: no sync, no step counted


def test_no_rounds_beside_the_last_step(tmp_path):
    t, fleet = make_trainer(tmp_path, "trainer.total_steps=3")
    ms = [t.rl_step() for _ in range(3)]
    assert [m["partial/rounds_beside_learner"] for m in ms][0] == 0 and ms[1]["partial/rounds_beside_learner"] >= 1
    calls = len(fleet.calls)
    assert t.collector.buffer.beside_rounds == 0 and len(fleet.calls) == calls
    assert all(max(b) <= 2 for b in t.batches)


def test_the_learner_result_is_logged_as_it_came_and_its_length_sums_are_not(tmp_path):
    """The step's metrics hold the learner result's ``metrics`` in their order after the staleness keys, then the
    guard's count of the refused step (the real ``after_train``: no rollback yet); the per-length sums become the
    length slices and are not logged themselves."""
    t, _ = make_trainer(tmp_path, "trainer.total_steps=2", "trainer.length_buckets=2")
    result = RolloutTrainResult.from_metrics({
        "loss/policy": 0.5, "actor/grad_norm": 2.0, "actor/num_optimizer_steps": 0.0,
        BY_LENGTH_KEY: {3: [2.0, 3.0, 1.0, 2.0]}, "health/skipped": 1.0, "health/failed_checks": "max_grad_norm",
        "health/reasons": "max_grad_norm: actor/grad_norm=2 > 1"})
    t.train = lambda c, rewards: (result, 0.0)
    t.guard = GuardPolicy(t.cfg, tmp_path)  # health.rollback_after=3: a first refusal only counts
    t.after_train = Trainer.after_train.__get__(t)
    m = t.rl_step()
    keys = list(m)
    assert keys[:10] == ["step", "rollout/staleness_mean", "rollout/staleness_max", "loss/policy", "actor/grad_norm",
                         "actor/num_optimizer_steps", "health/skipped", "health/failed_checks", "health/reasons",
                         "health/consecutive_failures"], keys
    assert m["health/failed_checks"] == "max_grad_norm" and m["health/consecutive_failures"] == 1.0
    assert BY_LENGTH_KEY not in m and not any(k.startswith("sync/") for k in m)  # refused: no sync
    assert m["length/0-6/seq_ratio_mean"] == 1.5 and m["length/0-6/clip_fraction"] == 0.5
    assert t.weight_version == 0 and t.guard.failures == 1
