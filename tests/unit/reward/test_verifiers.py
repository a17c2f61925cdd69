"""Verifiers as plain functions: exact, math (on real GSM8K rows), format, user verifiers, code extraction,
and the DAPO overlong penalty against hand-computed values."""

from __future__ import annotations

import math

import pytest

from reward.verifiers import (
    exact_verifier,
    extract_code,
    extract_final_answer,
    format_verifier,
    get_verifier,
    math_verifier,
)
from reward.worker import overlong_penalty
from rollout.contracts import PromptRow
from tests.helpers.reward import gsm8k_rows, needs_gsm8k, right_and_wrong_forms


def test_exact_normalises_and_reads_after_hashes():
    row = {"answer": "68", "meta": {}}
    assert exact_verifier("68", row) == 1.0
    assert exact_verifier("  68 \n", row) == 1.0
    assert exact_verifier("40 + 28 = 68\n#### 68", row) == 1.0
    assert exact_verifier("#### 6 8", row) == 0.0
    assert exact_verifier("#### 67", row) == 0.0
    assert exact_verifier("68.0", row) == 0.0  # exact means exact
    assert exact_verifier("the sum\n####   a   b ", {"answer": "a b"}) == 1.0
    assert exact_verifier("", {"answer": ""}) == 0.0  # an empty reference matches nothing
    assert exact_verifier("#### 5", PromptRow("u", "p", [], "5")) == 1.0  # a PromptRow works too


def test_math_forms_of_eighteen():
    row = {"answer": "18", "meta": {}}
    for resp in ("18", "18.0", "$18", "\\frac{36}{2}", "#### 18", "The answer is 18 dollars.", "\\boxed{18}"):
        assert math_verifier(resp, row) == 1.0, resp
    for resp in ("17", "#### 81", "The answer is 19.", "no idea"):
        assert math_verifier(resp, row) == 0.0, resp
    # a raw GSM8K answer as the reference: the text after #### is used
    assert math_verifier("#### 18", {"answer": "9 * 2 = <<9*2=18>>18\n#### 18"}) == 1.0


def test_extract_final_answer_order():
    assert extract_final_answer("a\n#### 5\nignored") == "5"
    assert extract_final_answer("The answer is 3. Then \\boxed{4}") == "4"  # a box beats an anchor
    assert extract_final_answer("The answer is 18. Then 5 more.") == "18"  # up to the end of its sentence
    assert extract_final_answer("so the answer is: 12 apples") == "12 apples"
    assert extract_final_answer("x\n\n  7 \n\n").strip() == "7"
    assert extract_final_answer("   ") is None


@needs_gsm8k
def test_math_on_real_gsm8k_rows():
    rows = gsm8k_rows(25)
    assert len(rows) == 25
    for row in rows:
        right, wrong = right_and_wrong_forms(row["answer"])
        for resp in right:
            assert math_verifier(resp, row) == 1.0, (row["uid"], resp, row["answer"])
        for resp in wrong:
            assert math_verifier(resp, row) == 0.0, (row["uid"], resp, row["answer"])
        # the dataset's own worked solution is right for its row
        assert math_verifier(row["meta"]["solution"], row) == 1.0


def test_format_verifier_pattern_from_option_and_row():
    assert format_verifier("work\n#### 12", {"meta": {}}) == 1.0
    assert format_verifier("12", {"meta": {}}) == 0.0
    assert format_verifier("<answer>3</answer>", {"meta": {}}, pattern=r"<answer>.+</answer>") == 1.0
    assert format_verifier("<answer>?</answer>", {"meta": {}}, pattern=r"<answer>.+</answer>") == 0.0
    assert format_verifier("<a>x</a><b>7</b>", {"meta": {}}, pattern=r"<a>(.+)</a><b>(?P<answer>.+)</b>") == 1.0
    assert format_verifier("<answer>3</answer>", {"meta": {"format_regex": r"^\d+$"}}) == 0.0
    with pytest.raises(ValueError, match="not a valid regular expression"):
        format_verifier("x", {"meta": {"format_regex": "(unclosed"}})


def test_format_default_pattern_is_the_configs_and_line_bounded():
    from reward.config import RewardConfig
    from reward.verifiers import DEFAULT_FORMAT_REGEX

    assert RewardConfig().format_regex == DEFAULT_FORMAT_REGEX
    # the answer is taken from the marker's line only (the old default's \s* ran across lines)
    assert format_verifier("####\n18", {"meta": {}}) == 0.0
    assert format_verifier("#### 17 or 18", {"meta": {}}) == 0.0  # the whole line is the marked answer
    # a user-given pattern is used as written, the old default among them (its \s* crosses the newline)
    old = r"(?m)^\s*####\s*\S+"
    assert format_verifier("####\n18", {"meta": {}}, pattern=old) == 1.0
    assert format_verifier("####\n18", {"meta": {"format_regex": old}}) == 1.0


def test_registry_builtins_users_and_errors():
    assert get_verifier("exact") is exact_verifier
    assert get_verifier("math") is math_verifier
    assert get_verifier("tests.helpers.reward:_user_verifier")("x", {})["score"] == 0.5
    from reward.config import RewardConfig

    fmt = get_verifier("format", RewardConfig(format_regex=r"^=(\S+)$"))
    assert fmt("=12", {"meta": {}}) == 1.0 and fmt("#### 1", {"meta": {}}) == 0.0
    assert fmt("=ok", {"meta": {}}) == 0.0  # the marked text is not an answer
    with pytest.raises(ValueError, match="unknown verifier 'nope'"):
        get_verifier("nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        get_verifier("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="has no callable 'missing'"):
        get_verifier("reward.verifiers:missing")


def test_extract_code():
    assert extract_code("def f(): pass") == "def f(): pass"
    text = "Here:\n```\nx = 1\n```\nand\n```python\ny = 2\n```\nthen\n```\nz = 3\n```"
    assert extract_code(text) == "y = 2\n"
    assert extract_code("```\nz = 3\n```") == "z = 3\n"


def test_overlong_penalty_hand_values():
    # L_max = 20, L_cache = 4: free up to 16 tokens, then -1/4 per token, -1 beyond 20
    assert overlong_penalty(0, 20, 4) == 0.0
    assert overlong_penalty(16, 20, 4) == 0.0
    assert overlong_penalty(17, 20, 4) == -0.25
    assert overlong_penalty(18, 20, 4) == -0.5
    assert overlong_penalty(20, 20, 4) == -1.0
    assert overlong_penalty(21, 20, 4) == -1.0
    assert overlong_penalty(20, 20, 20) == -1.0 and overlong_penalty(10, 20, 20) == -0.5
    for bad in ((5, 20, 0), (5, 20, 21), (-1, 20, 4)):
        with pytest.raises(ValueError):
            overlong_penalty(*bad)
    assert math.isfinite(overlong_penalty(10**9, 20, 4))
