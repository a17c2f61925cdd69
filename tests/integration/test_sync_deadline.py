"""The collective sync's engine waits share one deadline per phase, and the transfer group's build is bounded
(issue 26). With one wait per engine after another, four hung engines held rank 0 for 4 x
``sync.engine_timeout_s`` (480 s) while the other learner ranks waited under a 300 s ``learner.dist_timeout_s``.

The assertions are on outcomes, not on speed: an engine that answers after the phase's deadline but before a
second per-engine timeout would have run out counts as failed."""

from __future__ import annotations

from learner.weight_sync import _Fanout


class SlowEngine:
    """Answers ``start_weight_update`` after ``delay_s`` seconds (0: at once; a long delay: a hung engine)."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    def start_weight_update(self) -> str:
        import time

        time.sleep(self.delay_s)
        return "started"

    def finish_weight_update(self, version: int) -> int:
        return version


def test_engine_waits_share_one_deadline(ray_cluster):
    ray = ray_cluster
    timeout = 2.0
    # engine 0 hangs; engine 1 answers at 1.5 x timeout: inside its own timeout if the waits went one after
    # another (it would be waited for from t = timeout on), past the shared deadline; engine 2 answers at once
    engines = [ray.remote(SlowEngine).options(num_cpus=0).remote(d) for d in (600.0, 1.5 * timeout, 0.0)]
    try:
        ray.get([e.finish_weight_update.remote(0) for e in engines[1:]])  # started (the hung one is busy later)
        fan = _Fanout(engines, timeout)
        done, _ = fan.wait(fan.call("start_weight_update"))
        assert done == {2: "started"}
        assert sorted(fan.failed) == [0, 1] and "one deadline" in fan.failed[1]
        fan.start_phase()  # a new phase (rank 0 was back in a collective): the live engine answers again
        assert fan.remaining() > 0
        assert fan.wait(fan.call("finish_weight_update", 7))[0] == {2: 7}
    finally:
        for e in engines:
            ray.kill(e)
