"""The batched protected runner: a child process runs a chunk of calls in sequence, each with its own
timeout; a call that hangs (in Python, or in C with every catchable signal ignored) or crashes costs only
itself, the rest of its chunk continues in a new child, every call gets exactly one outcome in order, and
no process is left behind."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from reward._forkserver import make_chunks
from reward.config import RewardConfig
from reward.contracts import RewardRequest
from reward.runner import ProtectedRunner
from reward.worker import RewardWorker
from rollout.contracts import PromptRow
from tests.helpers.userfns import dies, exact_with_pid, forks_and_returns, hang_in_c, hang_in_python, segfaults

U = "tests.helpers.userfns"


TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def runners():
    made = {}

    def get(parallel: int = 1, calls_per_child: int = 32) -> ProtectedRunner:
        key = (parallel, calls_per_child)
        if key not in made:
            made[key] = ProtectedRunner(TIMEOUT_S, memory_mb=1024, preload=[U], parallel=parallel,
                                        calls_per_child=calls_per_child)
        return made[key]

    yield get
    for r in made.values():
        r.close()


def _ok(i: int, pid_dir: Path) -> tuple:
    """An exact call that is right for even i (score 1.0) and wrong for odd i (0.0)."""
    return (exact_with_pid, str(i), {"uid": f"ok{i}", "answer": str(i if i % 2 == 0 else -i),
                                      "meta": {"pid_dir": str(pid_dir)}})


def _bad(fn, name: str, pid_dir: Path) -> tuple:
    return (fn, "", {"uid": name, "answer": "", "meta": {"pid_dir": str(pid_dir)}})


def _noted_pids(pid_dir: Path) -> list[int]:
    return [int(p.name.rsplit(".", 1)[1]) for p in pid_dir.iterdir()]


def _assert_all_gone(pids: list[int]) -> None:
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=5)
    assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []


def _server_children(runner: ProtectedRunner) -> list[psutil.Process]:
    return psutil.Process(runner._proc.pid).children(recursive=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("parallel,calls_per_child", [(1, 32), (2, 32), (1, 1)])
def test_chunk_with_hangs_and_a_crash(runners, tmp_path, parallel, calls_per_child):
    runner = runners(parallel, calls_per_child)
    calls = [_ok(0, tmp_path), _bad(hang_in_python, "hang_py", tmp_path), _ok(1, tmp_path),
             _bad(hang_in_c, "hang_c", tmp_path), _ok(2, tmp_path), _bad(dies, "crash", tmp_path),
             _ok(3, tmp_path)]
    outs = runner.run(calls)
    assert [o.status for o in outs] == ["ok", "timeout", "ok", "timeout", "ok", "error", "ok"]
    assert [outs[i].value["score"] for i in (0, 2, 4, 6)] == [1.0, 0.0, 1.0, 0.0]
    assert outs[1].value is None and outs[1].detail == {"timeout_s": TIMEOUT_S}
    assert outs[3].value is None and outs[3].detail == {"timeout_s": TIMEOUT_S}
    assert outs[5].value is None and outs[5].detail["error"] == "VerifierDied"
    assert os.WEXITSTATUS(outs[5].detail["wait_status"]) == 3
    pids = [outs[i].value["pid"] for i in (0, 2, 4, 6)]
    if calls_per_child == 1:
        assert len(set(pids)) == 4  # the pre-batching mode: a fresh process per call
    # every call's own deadline, never the chunk's: each call starts with (almost) the whole limit
    assert all(0.5 * TIMEOUT_S < outs[i].value["left_s"] <= TIMEOUT_S for i in (0, 2, 4, 6))
    noted = _noted_pids(tmp_path)
    assert len(noted) == 3  # the Python hang and its child, the C hang
    _assert_all_gone(noted + pids)
    assert _server_children(runner) == []


@pytest.mark.timeout(60)
def test_a_chunk_shares_one_process_until_a_failure(runners, tmp_path):
    runner = runners(1, 32)
    calls = [_ok(i, tmp_path) for i in range(3)] + [_bad(segfaults, "segv", tmp_path)]
    calls += [_ok(i, tmp_path) for i in range(3, 6)]
    outs = runner.run(calls)
    assert outs[3].status == "error" and outs[3].detail["signal"] == 11
    assert [o.value["score"] for o in outs if o.status == "ok"] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    before = {o.value["pid"] for o in outs[:3]}
    after = {o.value["pid"] for o in outs[4:]}
    assert len(before) == 1 and len(after) == 1 and before != after
    assert _noted_pids(tmp_path)[0] in before  # the crash took down the chunk's process, nothing else
    assert _server_children(runner) == []


@pytest.mark.timeout(60)
def test_a_verifier_that_forks_is_answered_once(runners, tmp_path):
    runner = runners(1, 32)
    calls = [(forks_and_returns, "", {}), _ok(0, tmp_path), (forks_and_returns, "", {}), _ok(1, tmp_path)]
    outs = runner.run(calls)
    assert [o.status for o in outs] == ["ok"] * 4
    assert [outs[0].value, outs[1].value["score"], outs[2].value, outs[3].value["score"]] == [1.0, 1.0, 1.0, 0.0]
    assert _server_children(runner) == []


def test_alone_calls_get_their_own_process(runners, tmp_path):
    runner = runners(1, 32)
    calls = [_ok(i, tmp_path) for i in range(6)]
    outs = runner.run(calls, alone=[False, True, False, False, True, False])
    pids = [o.value["pid"] for o in outs]
    assert pids[0] == pids[2] == pids[3] == pids[5]
    assert len({pids[0], pids[1], pids[4]}) == 3
    with pytest.raises(ValueError, match="2 flags for 6 calls"):
        runner.run(calls, alone=[True, False])


def test_make_chunks():
    assert make_chunks(0, 4, 1) == []
    assert make_chunks(5, 2, 1) == [[0, 1], [2, 3], [4]]
    assert make_chunks(5, 64, 2) == [[0, 1, 2], [3, 4]]  # every parallel slot gets work
    assert make_chunks(5, 1, 3) == [[0], [1], [2], [3], [4]]
    assert make_chunks(6, 64, 1, [False, True, False, False, True, False]) == [[1], [4], [0, 2, 3, 5]]
    assert make_chunks(3, 64, 1, [True, True, True]) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="calls_per_child"):
        ProtectedRunner(1.0, calls_per_child=0)


def test_worker_isolates_configured_verifiers(tmp_path):
    name = f"{U}:exact_with_pid"
    rows = [PromptRow(uid=f"r{i}", prompt="p", prompt_token_ids=[], answer=str(i), verifier=name,
                      meta={}) for i in range(4)]
    reqs = [RewardRequest(str(i), row) for i, row in enumerate(rows)]
    pids = {}
    for isolated in ([], [name]):
        w = RewardWorker(RewardConfig(timeout_s=TIMEOUT_S, isolated_verifiers=isolated))
        try:
            res = w.score(reqs)
        finally:
            w.close()
        assert [r.score for r in res] == [1.0] * 4
        pids[bool(isolated)] = {r.detail["pid"] for r in res}
    assert len(pids[False]) == 1 and len(pids[True]) == 4
    assert RewardConfig().isolated_verifiers == ["code"]
