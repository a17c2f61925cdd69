"""The protected runner and the reward worker: timeouts kill whole process groups, failures become
statuses (0 or NaN, never an exception), composite rewards, overlong shaping, truncation masking, and real
rows (GSM8K answers in right and wrong forms; small code tasks with correct, wrong, hanging and hostile
solutions)."""

from __future__ import annotations

import math
import os

import psutil
import pytest

from reward.config import RewardConfig, RewardTerm
from reward.contracts import RewardRequest
from reward.runner import ProtectedRunner
from reward.verifiers import get_verifier
from reward.worker import RewardWorker
from rollout.contracts import PromptRow
from tests.helpers.reward import gsm8k_rows, needs_gsm8k, right_and_wrong_forms
from tests.helpers.reward_worker import row_of
from tests.helpers.userfns import dies, hang_with_child, raises

U = "tests.helpers.userfns"


@pytest.fixture(scope="module")
def runner():
    r = ProtectedRunner(timeout_s=2.0, preload=[U])
    yield r
    r.close()


def test_timeout_kills_the_whole_process_group(runner, tmp_path):
    pidfile = tmp_path / "pids"
    out = runner.call(hang_with_child, "x", {"meta": {"pidfile": str(pidfile)}})
    assert out.status == "timeout" and out.value is None
    pids = [int(p) for p in pidfile.read_text().split()]
    gone, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=5)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def test_failures_are_outcomes_not_exceptions(runner):
    outs = runner.run([(raises, "", {}), (dies, "", {}), (get_verifier("exact"), "5", {"answer": "5"}),
                       (lambda r, row: 1.0, "", {})])
    assert outs[0].status == "error" and outs[0].detail["error"] == "KeyError"
    assert outs[1].status == "error" and outs[1].detail["error"] == "VerifierDied"
    assert outs[2].status == "ok" and outs[2].value == 1.0
    assert outs[3].status == "error" and "picklable" in outs[3].detail["message"]


def test_runner_recovers_after_its_fork_server_dies():
    r = ProtectedRunner(timeout_s=2.0)
    try:
        os.kill(r._proc.pid, 9)
        r._proc.wait()
        out = r.call(get_verifier("exact"), "7", {"answer": "7"})
        assert out.status == "ok" and out.value == 1.0 and r.restarts == 1
    finally:
        r.close()


def test_parse_explosion_times_out_and_the_step_goes_on():
    cfg = RewardConfig(timeout_s=2.0, verifier="math")
    w = RewardWorker(cfg)
    try:
        reqs = [RewardRequest("\\boxed{9^{9^{9^{9^{9}}}}}", row_of("18", "math")),
                RewardRequest("#### 18", row_of("18", "math"))]
        bomb, good = w.score(reqs)
        assert (bomb.score, bomb.status, bomb.correct) == (0.0, "timeout", False)
        assert (good.score, good.status, good.correct) == (1.0, "ok", True)
    finally:
        w.close()


def test_worker_statuses_and_invalid_scores():
    cfg = RewardConfig(timeout_s=2.0, preload=[U])
    w = RewardWorker(cfg)
    try:
        mod = U
        reqs = [RewardRequest("", row_of("1", f"{mod}:raises"))]
        reqs += [RewardRequest(k, row_of("1", f"{mod}:returns_junk")) for k in ("nan", "text", "none", "dict",
                                                                                "inf")]
        reqs += [RewardRequest("", row_of("1", f"{mod}:dies")), RewardRequest("", row_of("1", "nope")),
                 RewardRequest("", row_of("1", f"{mod}:half_with_extra"))]
        res = w.score(reqs)
        assert (res[0].score, res[0].status) == (0.0, "error")  # a verifier that raises: 0 + error
        for r in res[1:6]:  # invalid values: NaN, never a silent 0
            assert math.isnan(r.score) and r.status == "error" and r.detail["error"] == "InvalidScore"
        assert math.isnan(res[6].score) and res[6].detail["error"] == "VerifierDied"  # missing: NaN
        assert math.isnan(res[7].score) and res[7].detail["error"] == "UnknownVerifier"
        assert (res[8].score, res[8].correct, res[8].detail["why"]) == (0.5, True, "partial")
    finally:
        w.close()


def test_nan_policy_is_configurable():
    w = RewardWorker(RewardConfig(timeout_s=2.0, error_score=math.nan))
    try:
        (r,) = w.score([RewardRequest("", row_of("1", f"{U}:raises"))])
        assert math.isnan(r.score) and r.status == "error"
    finally:
        w.close()


def test_composite_overlong_and_truncation_mask():
    cfg = RewardConfig(timeout_s=3.0, extra_terms=[RewardTerm(verifier="format", weight=0.25)],
                       overlong_buffer_len=4, max_response_tokens=20, mask_truncated=True)
    w = RewardWorker(cfg)
    try:
        row = row_of("68")
        res = w.score([
            RewardRequest("40 + 28\n#### 68", row, num_response_tokens=10),   # right + format
            RewardRequest("68", row, num_response_tokens=10),                 # right, no format
            RewardRequest("#### 67", row, num_response_tokens=18),            # wrong + format, 2 into buffer
            RewardRequest("#### 68", row, num_response_tokens=20, truncated=True),  # cut at L_max: masked
        ])
        assert [r.score for r in res[:3]] == [1.25, 1.0, 0.25 - 0.5]
        assert [r.correct for r in res] == [True, True, False, True]
        assert res[2].detail["overlong_penalty"] == -0.5 and res[0].detail["terms"] == {"format": 1.0}
        assert math.isnan(res[3].score) and res[3].detail["masked"] == "truncated"
    finally:
        w.close()
    with pytest.raises(ValueError, match="max_response_tokens"):
        RewardWorker(RewardConfig(overlong_buffer_len=4))
    with pytest.raises(ValueError, match="unknown verifier"):
        RewardWorker(RewardConfig(extra_terms=[RewardTerm(verifier="nope")]))


@needs_gsm8k
def test_worker_on_real_gsm8k_rows():
    rows = gsm8k_rows(10)
    reqs, want = [], []
    for r in rows:
        row = PromptRow(r["uid"], r["prompt"], [], r["answer"], "math", {})
        right, wrong = right_and_wrong_forms(r["answer"])
        for resp in right[:3]:
            reqs.append(RewardRequest(resp, row))
            want.append(1.0)
        for resp in wrong[:2]:
            reqs.append(RewardRequest(resp, row))
            want.append(0.0)
    w = RewardWorker(RewardConfig(timeout_s=5.0, parallel_calls=2))
    try:
        res = w.score(reqs)
    finally:
        w.close()
    assert [r.score for r in res] == want
    assert all(r.status == "ok" and r.correct == (s == 1.0) for r, s in zip(res, want))


def _score_watching_the_runner(cfg: RewardConfig, reqs: list[RewardRequest]):
    """(results, verifier names of the calls the protected runner got)."""
    w = RewardWorker(cfg)
    sent: list[str] = []
    run = w.runner.run

    def watched(calls, alone=None):
        sent.extend(getattr(fn, "__name__", str(fn)) for fn, _, _ in calls)
        return run(calls, alone)

    w.runner.run = watched
    try:
        return w.score(reqs), sent
    finally:
        w.close()


def test_exact_runs_inline_with_the_runners_outcomes_and_other_verifiers_stay_protected():
    no_answer = PromptRow(uid="x", prompt="p", prompt_token_ids=[1], answer=None, verifier="exact")
    reqs = [RewardRequest("#### 68", row_of("68")), RewardRequest("#### 67", row_of("68")),
            RewardRequest("#### 1", no_answer), RewardRequest("#### 68", row_of("68", "math"))]
    inline, sent_inline = _score_watching_the_runner(RewardConfig(timeout_s=5.0), reqs)
    forked, sent_forked = _score_watching_the_runner(RewardConfig(timeout_s=5.0, inline_verifiers=[]), reqs)
    assert sent_inline == ["math_verifier"]  # exact never left the worker
    assert sent_forked == ["exact_verifier"] * 3 + ["math_verifier"]
    for a, b in zip(inline, forked, strict=True):  # the same results either way, the raising call included
        assert (a.score, a.correct, a.status, a.detail.get("error")) == (b.score, b.correct, b.status,
                                                                          b.detail.get("error"))
    assert [r.score for r in inline] == [1.0, 0.0, 0.0, 1.0]
    assert inline[2].status == "error" and inline[2].detail["error"] == "ValueError"


def test_inline_goes_by_name_and_isolation_wins():
    """A user name that resolves to the same function still runs protected (only names in
    reward.inline_verifiers run inline), and a verifier listed in both lists is isolated."""
    reqs = [RewardRequest("#### 1", row_of("1")), RewardRequest("#### 1", row_of("1", "reward.verifiers:exact_verifier"))]
    res, sent = _score_watching_the_runner(RewardConfig(timeout_s=5.0), reqs)
    assert sent == ["exact_verifier"] and [r.score for r in res] == [1.0, 1.0]  # the second, by its user name
    res, sent = _score_watching_the_runner(RewardConfig(timeout_s=5.0, isolated_verifiers=["exact"]), reqs[:1])
    assert sent == ["exact_verifier"] and res[0].score == 1.0


def test_only_linear_string_verifiers_may_run_inline():
    with pytest.raises(ValueError, match=r"reward.inline_verifiers=\['exact', 'math'\]: \['math'\] may not run inline"):
        RewardConfig(inline_verifiers=["exact", "math"])
    with pytest.raises(ValueError, match="may not run inline"):
        RewardConfig(inline_verifiers=[f"{U}:raises"])
