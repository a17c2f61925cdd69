"""The LLM judge's pure parts (``reward.llm_judge``, ``reward.config.JudgeConfig``): the template and its fields,
the prompt through a chat template, the regex and token-probability scores, NaN where the answer has none, and
the combination with the verifiers' reward (hand-computed values)."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from cluster.models.tiny_model import build_char_tokenizer
from reward.config import JudgeConfig, RewardConfig
from reward.contracts import RewardResult
from reward.llm_judge import (Judgement, combine, judgement, parse_regex, parse_token_probs, prompt_ids, render,
                              single_token_ids, template_fields)
from rollout.contracts import PromptRow
from tests.helpers.chat_tokenizers import build_bpe_tokenizer

ROW = PromptRow(uid="train/3+4", prompt="03+04=", prompt_token_ids=[1, 2], answer="7",
                meta={"solution": "3+4=7", "level": 2})


# -- the template ---------------------------------------------------------------------------------------------
def test_render_fills_row_fields_meta_and_response():
    text = render("Q {prompt} ref {answer} [{uid}] lvl {meta[level]} sol {meta[solution]}: {response} {{x}}",
                  ROW, "#### 7")
    assert text == "Q 03+04= ref 7 [train/3+4] lvl 2 sol 3+4=7: #### 7 {x}"


def test_render_inserts_the_response_as_text_not_as_a_template():
    # a response full of braces and field names stays exactly what the model wrote
    assert render("<{response}>", ROW, "{prompt} {meta[level]} {0} }{") == "<{prompt} {meta[level]} {0} }{>"


def test_render_accepts_a_row_dict():
    assert render("{answer}|{response}", {"uid": "u", "prompt": "p", "answer": "a", "meta": {}}, "r") == "a|r"


def test_render_missing_meta_key_names_key_and_row():
    with pytest.raises(ValueError, match=r"meta\[missing\].*train/3\+4.*level"):
        render("{meta[missing]}", ROW, "r")


@pytest.mark.parametrize("template, bad", [("{}", "{}"), ("{0}", "{0}"), ("{prompt.upper}", "prompt.upper"),
                                           ("{question}", "question"), ("{meta}", "meta")])
def test_template_fields_refuse_unknown_and_positional_fields(template, bad):
    with pytest.raises(ValueError, match="reward.judge.template"):
        template_fields(template)


def test_template_fields_lists_the_named_fields():
    assert template_fields("{prompt}{response}{meta[a b]}{{lit}}") == ["prompt", "response", "meta[a b]"]
    with pytest.raises(ValueError, match="literal braces"):
        template_fields("unclosed {prompt")


def test_config_refuses_bad_template_regex_and_overlapping_tokens():
    with pytest.raises(ValidationError, match="question"):
        JudgeConfig(model_path="m", template="{question}")
    with pytest.raises(ValidationError, match="does not compile"):
        JudgeConfig(model_path="m", regex="(")
    with pytest.raises(ValidationError, match="both positive and negative"):
        JudgeConfig(model_path="m", positive_tokens=["Yes"], negative_tokens=["Yes", "No"])
    with pytest.raises(ValidationError, match="node_resources"):
        JudgeConfig(model_path="m", node_resources={"CPU": 1})
    assert not RewardConfig().judge.enabled and JudgeConfig(model_path="m").enabled


# -- the prompt's tokens --------------------------------------------------------------------------------------
def test_prompt_ids_use_the_chat_template_with_the_generation_prompt():
    tok = build_bpe_tokenizer()
    ids = prompt_ids(tok, "Is 3+4=7?", system_prompt="Be strict.")
    text = tok.decode(ids)
    assert text == ("<|im_start|>system\nBe strict.<|im_end|>\n<|im_start|>user\nIs 3+4=7?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    # chat=False: the text as it is, the system prompt before it
    assert tok.decode(prompt_ids(tok, "Is 3+4=7?", system_prompt="S", chat=False)) == "S\n\nIs 3+4=7?"


def test_prompt_ids_without_a_chat_template_encode_the_text():
    tok = build_char_tokenizer()  # the tiny model's: no chat template, one token per character
    ids = prompt_ids(tok, "7?")
    assert tok.decode(ids, skip_special_tokens=True) == "7?" and len(ids) in (2, 3)


def test_single_token_ids_refuse_multi_token_names():
    tok = build_char_tokenizer()
    one, zero = tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("0")
    assert single_token_ids(tok, ["1", "1", "0"], "k") == [one, zero]
    with pytest.raises(ValueError, match=r"reward.judge.positive_tokens: 'Yes' is 3 tokens"):
        single_token_ids(tok, ["Yes"], "reward.judge.positive_tokens")


# -- the score ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("answer, pattern, scale, want", [
    ("Score: 8/10", r"Score:\s*(\d+)", 0.1, 0.8),
    ("I give it 7.5 then 9", r"(-?\d+(?:\.\d+)?)", 1.0, 7.5),  # the first match
    ("rating -2", r"-?\d+", 0.5, -1.0),  # no group: the whole match
    ("Yes", r"(\d+)", 1.0, math.nan),  # nothing matches
    ("value: inf", r"value: (\w+)", 1.0, math.nan),  # not a finite number
    ("value: abc", r"value: (\w+)", 1.0, math.nan),
])
def test_parse_regex(answer, pattern, scale, want):
    got = parse_regex(answer, pattern, scale)
    assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want)


def test_parse_token_probs_hand_computed():
    yes, no, other = 5, 6, 7
    # P(yes)=0.6, P(no)=0.2 -> 0.6 / 0.8 = 0.75
    top = {yes: math.log(0.6), no: math.log(0.2), other: math.log(0.1)}
    assert parse_token_probs(top, [yes], [no]) == pytest.approx(0.75)
    # two surface forms per side add up: (0.3 + 0.1) / (0.3 + 0.1 + 0.1) = 0.8
    top = {1: math.log(0.3), 2: math.log(0.1), 3: math.log(0.1)}
    assert parse_token_probs(top, [1, 2], [3]) == pytest.approx(0.8)
    # a side outside the top log-probs counts 0
    assert parse_token_probs({yes: math.log(0.01)}, [yes], [no]) == pytest.approx(1.0)
    assert parse_token_probs({no: -3.0}, [yes], [no]) == 0.0
    # neither side among them: NaN
    assert math.isnan(parse_token_probs({other: -0.1}, [yes], [no]))
    assert math.isnan(parse_token_probs({}, [yes], [no]))


def test_judgement_is_unparsed_nan_when_the_answer_has_no_score():
    regex_cfg = JudgeConfig(model_path="m", score="regex", regex=r"Score: (\d+)", scale=0.1)
    assert judgement("Score: 7", {}, regex_cfg, [], []) == Judgement(pytest.approx(0.7), "ok", "Score: 7")
    bad = judgement("no idea", {}, regex_cfg, [], [])
    assert math.isnan(bad.score) and bad.status == "unparsed" and bad.answer == "no idea"
    probs_cfg = JudgeConfig(model_path="m")
    assert judgement("Maybe", {9: -0.1}, probs_cfg, [1], [2]).status == "unparsed"
    assert judgement("Yes", {1: math.log(0.9), 2: math.log(0.1)}, probs_cfg, [1], [2]).score == pytest.approx(0.9)


# -- the combination ------------------------------------------------------------------------------------------
def _verdict(score, correct):
    return RewardResult(score, correct, "ok", {"x": 1}, 0.01)


def test_combine_weighted_hand_computed():
    out = combine(_verdict(1.0, True), Judgement(0.75), "weighted", 0.5)
    assert out.score == pytest.approx(1.375) and out.correct and out.status == "ok"
    assert out.detail == {"x": 1, "judge": {"score": 0.75, "status": "ok"}}
    # a wrong answer still gets the judge's term: 0 + 2 * 0.25
    assert combine(_verdict(0.0, False), Judgement(0.25), "weighted", 2.0).score == pytest.approx(0.5)
    # primary_weight 0 upstream (verifier part 0): the judge alone, correct stays the verifier's
    out = combine(_verdict(0.0, True), Judgement(0.9), "weighted", 1.0)
    assert out.score == pytest.approx(0.9) and out.correct


def test_combine_gate_counts_the_judge_only_where_the_verifier_passed():
    assert combine(_verdict(1.0, True), Judgement(0.5), "gate", 1.0).score == pytest.approx(1.5)
    shut = combine(_verdict(0.0, False), Judgement(math.nan, "skipped"), "gate", 1.0)
    assert shut.score == 0.0 and shut.status == "ok" and shut.detail["judge"]["status"] == "skipped"
    # a failed judge behind a closed gate does not matter
    assert combine(_verdict(-0.5, False), Judgement(math.nan, "timeout"), "gate", 1.0).score == -0.5


@pytest.mark.parametrize("status, want", [("timeout", "timeout"), ("unparsed", "error"), ("error", "error")])
def test_combine_failed_judge_gives_an_invalid_sample(status, want):
    for mode in ("weighted", "gate"):
        out = combine(_verdict(1.0, True), Judgement(math.nan, status, detail={"error": "E"}), mode, 0.5)
        assert math.isnan(out.score) and not out.valid and out.status == want and out.correct
        assert out.detail["judge"] == {"score": out.detail["judge"]["score"], "status": status, "error": "E"}


def test_combine_refuses_unknown_mode():
    with pytest.raises(ValueError, match="combine.mode='sum'"):
        combine(_verdict(1.0, True), Judgement(1.0), "sum", 1.0)
