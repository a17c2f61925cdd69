"""The reward pool on real Ray: results in request order across workers, per-step metrics, resize, and a
worker killed mid-call is replaced and its share rescored (nothing lost, nothing scored twice)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from reward.config import RewardConfig
from reward.contracts import RewardRequest
from rollout.contracts import PromptRow
from tests.helpers.reward import gsm8k_rows, needs_gsm8k, right_and_wrong_forms

SLOW = "tests.helpers.userfns:slow_exact"


def _rows(n: int, tmp: Path, delay_s: float) -> list[RewardRequest]:
    """n exact-match requests with distinct answers; odd ones are answered wrongly."""
    reqs = []
    for i in range(n):
        row = PromptRow(uid=f"r{i}", prompt="p", prompt_token_ids=[], answer=str(100 + i), verifier=SLOW,
                        meta={"marker_dir": str(tmp), "delay_s": delay_s})
        reqs.append(RewardRequest(str(100 + i) if i % 2 == 0 else str(i), row))
    return reqs


@pytest.mark.timeout(300)
def test_pool_scores_in_order_resizes_and_survives_a_killed_worker(ray_cluster, tmp_path):
    from reward.pool import RewardPool

    cfg = RewardConfig(num_workers=2, num_cpus_per_worker=0.25, timeout_s=10.0, preload=["tests.helpers.userfns"])
    pool = RewardPool(cfg)
    try:
        # order and values across 2 workers
        reqs = _rows(10, tmp_path / "a", 0.0)
        (tmp_path / "a").mkdir()
        res = pool.score(reqs)
        assert [r.score for r in res] == [1.0 if i % 2 == 0 else 0.0 for i in range(10)]
        m = pool.metrics()
        assert m["reward/timeouts"] == 0 and m["reward/errors"] == 0 and m["fault/reward_restarts"] == 0
        assert m["reward/time_s"] > 0 and pool.metrics()["reward/time_s"] == 0  # reset after reading

        # kill worker 0 while it is scoring its share
        marks = tmp_path / "b"
        marks.mkdir()
        reqs = _rows(6, marks, 1.0)  # 3 per worker, 1 s each
        pids = pool.worker_pids()
        out: dict = {}
        t = threading.Thread(target=lambda: out.setdefault("res", pool.score(reqs)))
        t.start()
        deadline = time.monotonic() + 120
        while not any(p.name.startswith("r0.") for p in marks.iterdir()):  # worker 0 started on its share
            assert time.monotonic() < deadline, "worker 0 never started"
            time.sleep(0.05)
        os.kill(pids[0], signal.SIGKILL)
        t.join(timeout=240)
        assert not t.is_alive()
        res = out["res"]
        assert len(res) == 6
        assert [r.score for r in res] == [1.0 if i % 2 == 0 else 0.0 for i in range(6)]
        assert all(r.status == "ok" for r in res)
        assert pool.metrics()["fault/reward_restarts"] == 1
        assert pool.worker_pids()[0] != pids[0]
        # worker 0's share ran twice (once on the dead worker, once after), worker 1's once; the result
        # list holds exactly one verdict per request
        starts = sorted(p.name.split(".")[0] for p in marks.iterdir())
        assert starts.count("r0") >= 2 and starts.count("r3") == 1

        pool.resize(1)
        assert pool.num_workers == 1
        (tmp_path / "c").mkdir()
        assert [r.score for r in pool.score(_rows(3, tmp_path / "c", 0.0))] == [1.0, 0.0, 1.0]
        pool.resize(3)
        assert pool.num_workers == 3 and len(set(pool.worker_pids())) == 3
        assert pool.score([]) == []
    finally:
        pool.shutdown()


@needs_gsm8k
@pytest.mark.timeout(300)
def test_pool_on_gsm8k_rows(ray_cluster):
    from reward.pool import RewardPool

    reqs, want = [], []
    for r in gsm8k_rows(8):
        row = PromptRow(r["uid"], r["prompt"], [], r["answer"], "math", {})
        right, wrong = right_and_wrong_forms(r["answer"])
        for resp, score in ((right[1], 1.0), (right[2], 1.0), (wrong[0], 0.0)):
            reqs.append(RewardRequest(resp, row))
            want.append(score)
    pool = RewardPool(RewardConfig(num_workers=2, timeout_s=5.0))
    try:
        res = pool.score(reqs)
        assert [r.score for r in res] == want
        assert [r.correct for r in res] == [s == 1.0 for s in want]
    finally:
        pool.shutdown()
