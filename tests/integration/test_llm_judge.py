"""The LLM judge for real: a ``JudgeEngine`` actor (vLLM) on the embedded tiny model scores a batch, its
token-probability scores equal those of a transformers float32 forward of the same prompts, and the judge joins a
real reward pool's exact verifier (weighted sum; a gate that asks it only about passing samples), a prompt it
cannot build giving a counted NaN reward, never an exception (a timed-out engine:
tests/matrix/test_llm_judge_timeout.py)."""

from __future__ import annotations

import math

import pytest
import torch

from cluster.runtime.judge import JudgedRewards, JudgeFleet
from reward.config import RewardConfig
from reward.contracts import RewardRequest
from reward.llm_judge import parse_token_probs, prompt_ids, render
from reward.pool import RewardPool
from rollout.contracts import PromptRow
from tests.helpers.judge import TEMPLATE, judge_requests, tiny_judge_config


@pytest.fixture(scope="module")
def fleet(ray_cluster, tiny_moe, tmp_path_factory):
    f = JudgeFleet(tiny_judge_config(tiny_moe), str(tiny_moe), tmp_path_factory.mktemp("judge_cache"))
    yield f
    f.shutdown()


def test_token_probs_match_a_transformers_forward_and_repeat(fleet, tiny_moe):
    from transformers import AutoModelForCausalLM

    reqs = judge_requests()
    got = fleet.judge(reqs)
    assert fleet.judge(reqs) == got  # greedy: the same answers and scores again
    model = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).eval()
    for req, j in zip(reqs, got):
        ids = prompt_ids(fleet.tokenizer, render(TEMPLATE, req.row, req.response))
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
        top = torch.topk(logp, 20)
        want = parse_token_probs({int(t): float(v) for t, v in zip(top.indices, top.values)},
                                 fleet.positive, fleet.negative)
        if math.isnan(want):
            assert math.isnan(j.score) and j.status == "unparsed"
        else:
            assert j.status == "ok" and j.score == pytest.approx(want, abs=1e-4)
    assert any(j.status == "ok" for j in got)


def test_judged_rewards_combine_with_the_exact_verifier_and_count_failures(fleet):
    pool = RewardPool(RewardConfig(verifier="exact"))
    try:
        rewards = JudgedRewards(pool, fleet)
        reqs = judge_requests()
        broken = RewardRequest(response="7", row=PromptRow(uid="t/no-hint", prompt="3+4=", prompt_token_ids=[1],
                                                           answer="7"))  # no meta hint: no judge prompt
        results = rewards.score(reqs + [broken])
        judged = fleet.judge(reqs)
        for k, (r, j) in enumerate(zip(results, judged)):
            exact = 1.0 if k % 2 == 0 else 0.0  # even: the right sum, odd: one off
            assert r.correct == (k % 2 == 0)
            if j.status == "ok":
                assert r.valid and r.score == pytest.approx(exact + 0.5 * j.score)
            else:
                assert not r.valid
        last = results[-1]
        assert math.isnan(last.score) and last.correct and last.detail["judge"]["error"] == "JudgePrompt"
        m = rewards.metrics()
        failed = sum(j.status != "ok" for j in judged) + 1
        assert m["reward/judge_failed"] == failed and m["reward/invalid"] == failed
        assert m["reward/judge_asked"] == len(reqs) + 1
    finally:
        pool.shutdown()



def test_gate_asks_the_judge_only_where_the_verifier_passed(fleet):
    pool = RewardPool(RewardConfig(verifier="exact"))
    jc = fleet.settings
    fleet.settings = jc.model_copy(update={"combine": jc.combine.model_copy(update={"mode": "gate", "weight": 2.0})})
    try:
        rewards = JudgedRewards(pool, fleet)
        reqs = judge_requests()
        results = rewards.score(reqs)
        judged = fleet.judge(reqs[0::2])  # the right answers only
        m = rewards.metrics()
    finally:
        fleet.settings = jc
        pool.shutdown()
    assert m["reward/judge_asked"] == len(reqs) // 2
    for r, j in zip(results[0::2], judged):
        assert r.correct and (r.score == pytest.approx(1.0 + 2.0 * j.score) if j.status == "ok" else not r.valid)
    for r in results[1::2]:  # the gate is shut: the verifier's 0, the judge not asked
        assert not r.correct and r.score == 0.0 and r.detail["judge"]["status"] == "skipped"
