"""The reasoning-gym verifier (reward/reasoning_gym_verifier.py): reasoning-gym's own score_answer on hand-checked
right and wrong answers, the answer read from tags or raw, and scoring through the reward worker's protected runner
(a verifier child process under reward.timeout_s, like every verifier that is not inline)."""

from __future__ import annotations

import math

import pytest
import reasoning_gym
from reasoning_gym.utils import extract_answer

from reward.config import RewardConfig
from reward.contracts import RewardRequest
from reward.reasoning_gym_verifier import reasoning_gym_verifier, tagged_answer
from reward.worker import RewardWorker
from rollout.contracts import PromptRow

VERIFIER = "reward.reasoning_gym_verifier:reasoning_gym_verifier"  # as cluster/data/reasoning_gym_task.py names it


def row(name: str, question: str, answer: str, answer_format: str = "tag", config=None) -> dict:
    entry = {"question": question, "answer": answer, "metadata": {"source_dataset": name}}
    return {"uid": f"{name}/{question}", "answer": answer,
            "meta": {"rg_dataset": name, "rg_entry": entry, "rg_config": config or {}, "answer_format": answer_format}}


@pytest.mark.parametrize("response, score", [
    ("<answer>42</answer>", 1.0),
    ("12 + 30 is 42.\n<answer> 42 </answer>", 1.0),      # the tag's content, stripped
    ("<answer>41</answer>", 0.0),
    ("<answer>x=42</answer>", 0.5),                       # reasoning-gym's partial credit: len("42") / len("x=42")
    ("42", 0.0),                                          # no tag: no answer
    ("<answer>41</answer> no, <answer>42</answer>", 1.0),  # the last tag counts
    ("<answer>42", 0.0),                                  # never closed
])
def test_basic_arithmetic_hand_checked(response, score):
    out = reasoning_gym_verifier(response, row("basic_arithmetic", "Calculate 12 + 30.", "42"))
    assert out == {"score": score, "correct": score == 1.0, "dataset": "basic_arithmetic"}


@pytest.mark.parametrize("response, score", [
    ("<answer>1000</answer>", 1.0), ("<answer>1,000.00</answer>", 1.0), ("<answer>+01000</answer>", 1.0),
    ("<answer>999</answer>", 0.0), ("<answer>abc</answer>", 0.0),
])
def test_chain_sum_uses_its_own_decimal_scoring(response, score):
    out = reasoning_gym_verifier(response, row("chain_sum", "State the final answer: 600 + 400 =", "1000"))
    assert (out["score"], out["correct"]) == (score, score == 1.0)


@pytest.mark.parametrize("response, score", [
    ("34 + 17 = 51\n\nThe answer is 51.", 1.0),          # what follows "answer is", to the end of its sentence
    ("The final answer is 52.", 0.0),
    ("So the sum is \\boxed{51}.", 1.0),
    ("#### 51", 1.0),
    ("34 + 17 = 51", 1.0),                                  # the last sentence, an equation: its right side
    ("So 34 + 17 = 50 + 1 = 51.", 1.0),
    ("So, 34 + 17 =", 0.0),                                 # a dangling equation answers nothing
    ("I added them: 51 apples", 2 / 23),                    # basic_arithmetic's partial credit: len("51") / len(...)
    ("", 0.0),
])
def test_final_answers_are_read_as_the_math_verifier_reads_them(response, score):
    out = reasoning_gym_verifier(response, row("basic_arithmetic", "Calculate 34 + 17.", "51", "final"))
    assert math.isclose(out["score"], score) and out["correct"] == (score == 1.0)


def test_raw_answers_are_the_whole_response_stripped():
    r = row("spell_backward", "Spell this word backward (example: sun -> nus): ammonia", "ainomma", "raw")
    assert reasoning_gym_verifier(" ainomma\n", r)["score"] == 1.0
    assert 0.0 < reasoning_gym_verifier("ammonia", r)["score"] < 1.0  # spell_backward's own partial credit
    assert reasoning_gym_verifier("", r)["score"] == 0.0
    assert reasoning_gym_verifier("<answer>ainomma</answer>", r)["score"] < 1.0  # raw: the tags are text


def test_generated_entries_score_their_reference_and_not_a_wrong_answer():
    """Ten datasets, their entries as reasoning-gym generates them: the reference in tags scores 1, a wrong
    answer below 1."""
    names = ["basic_arithmetic", "chain_sum", "gcd", "lcm", "spell_backward", "letter_counting", "leg_counting",
             "count_bits", "simple_equations", "number_sequence"]
    for name in names:
        ds = reasoning_gym.create_dataset(name, size=5, seed=11)
        for i in range(5):
            entry = ds[i]
            r = {"uid": f"{name}/{i}", "meta": {"rg_dataset": name, "rg_entry": entry, "answer_format": "tag"}}
            assert reasoning_gym_verifier(f"<answer>{entry['answer']}</answer>", r)["score"] == 1.0, (name, entry)
            wrong = reasoning_gym_verifier("<answer>-987654321x</answer>", r)
            assert wrong["score"] < 1.0 and not wrong["correct"], (name, entry)


def test_tagged_answer_matches_reasoning_gyms_extraction_on_well_formed_text():
    for text in ["<answer>5</answer>", "think <answer> 5 </answer>", "<answer>1</answer> then <answer>2</answer>",
                 "<answer>\na, b\n</answer>\n", "none here", "</answer><answer>"]:
        assert tagged_answer(text) == extract_answer(text), text
    assert tagged_answer("<answer>a<answer>b</answer>") == "b"  # nested: the innermost (the regex: "a<answer>b")
    assert tagged_answer("<answer>" * 200_000) is None  # two reverse scans: linear on degenerate output


def test_rows_without_the_entry_are_refused_by_name():
    with pytest.raises(ValueError, match="reasoning_gym row 'u1': meta needs rg_dataset"):
        reasoning_gym_verifier("<answer>1</answer>", {"uid": "u1", "meta": {}})
    bad = row("gcd", "q", "1")
    bad["meta"]["answer_format"] = "boxed"
    with pytest.raises(ValueError, match="answer_format='boxed'"):
        reasoning_gym_verifier("1", bad)


def test_the_reward_worker_scores_rows_in_its_protected_runner():
    def prompt_row(r: dict) -> PromptRow:
        return PromptRow(uid=r["uid"], prompt=r["meta"]["rg_entry"]["question"], prompt_token_ids=[1],
                         answer=r["answer"], verifier=VERIFIER, meta=r["meta"])

    add = prompt_row(row("basic_arithmetic", "Calculate 12 + 30.", "42"))
    cfg = RewardConfig(timeout_s=10.0)
    assert VERIFIER not in cfg.inline_verifiers  # never in the worker itself: a child process with the timeout
    w = RewardWorker(cfg)
    try:
        broken = PromptRow(uid="broken", prompt="p", prompt_token_ids=[1], answer="1", verifier=VERIFIER, meta={})
        res = w.score([RewardRequest("<answer>42</answer>", add), RewardRequest("<answer>41</answer>", add),
                       RewardRequest("<answer>x=42</answer>", add), RewardRequest("<answer>1</answer>", broken)])
        assert [(r.score, r.correct, r.status) for r in res[:3]] == [(1.0, True, "ok"), (0.0, False, "ok"),
                                                                      (0.5, False, "ok")]
        assert res[0].detail == {"dataset": "basic_arithmetic"}
        assert (res[3].score, res[3].status, res[3].detail["error"]) == (0.0, "error", "ValueError")
        assert "reward.reasoning_gym_verifier" in w.runner.preload  # imported once into the fork server
        assert all(math.isfinite(r.elapsed_s) for r in res)
    finally:
        w.close()
