"""The math verifier on a regression table of (response, reference, expected score) cases (issue 15, item 2),
and the format verifier on what its marker marks (item 3).

Each row is one behaviour; the ids say which. The issue's own cases are marked ``issue``. Every expected
value is what a careful grader would give, not what some version of the code happened to return.
"""

from __future__ import annotations

import pytest

from reward.answers import boxed_contents, candidates, is_answer, parse_reference
from reward.config import RewardConfig
from reward.verifiers import format_verifier, get_verifier, math_verifier

MB = 1 << 20


CASES = [
    # --- boxed ------------------------------------------------------------------------------------------------
    ("box-int", "So \\boxed{18}.", "18", 1.0),
    ("box-float", "\\boxed{18.0}", "18", 1.0),
    ("box-frac", "\\boxed{\\frac{36}{2}}", "18", 1.0),
    ("box-wrong", "\\boxed{17}", "18", 0.0),
    ("box-empty", "\\boxed{}", "18", 0.0),
    ("box-units", "\\boxed{18 \\text{ apples}}", "18", 1.0),
    ("box-dollar", "\\boxed{\\$18}", "18", 1.0),
    ("box-nested", "\\boxed{\\boxed{18}}", "18", 1.0),
    ("fbox", "\\fbox{18}", "18", 1.0),
    ("box-twice-same", "First \\boxed{18}; checked again: \\boxed{18.0}", "18", 1.0),
    ("box-in-dollars", "The total is $\\boxed{18}$.", "18", 1.0),
    ("box-beats-anchor", "The answer is 17. Correction: \\boxed{18}", "18", 1.0),
    # --- unboxed: anchors, ####, last line ----------------------------------------------------------------------
    ("hashes", "3 + 15 = 18\n#### 18", "18", 1.0),
    ("hashes-wrong", "#### 81", "18", 0.0),
    ("answer-is", "The answer is 18.", "18", 1.0),
    ("final-answer-colon", "Final answer: 18", "18", 1.0),
    ("answer-colon", "Answer: 18", "18", 1.0),
    ("answer-latex", "The final answer is $18$.", "18", 1.0),
    ("last-line", "3 + 15\n18", "18", 1.0),
    ("last-sentence", "She had 3. Then 15 more. So she has 18 apples.", "18", 1.0),
    ("last-number-convention", "Janet had 16 eggs, ate 3, so she has 13", "13", 1.0),
    ("gsm8k-solution", "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether 48+24 = <<48+24=72>>72.\n#### 72",
     "72", 1.0),
    # --- commas: thousands separators and list separators ---------------------------------------------------------
    ("thousands-gold-plain-pred", "The answer is 1234.", "1,234", 1.0),
    ("thousands-both", "The answer is 1,234.", "1,234", 1.0),
    ("thousands-pred-only", "#### 1,234", "1234", 1.0),
    ("thousands-box", "\\boxed{1,234}", "1234", 1.0),
    ("thousands-decimals", "The answer is 1,234.50 dollars.", "1,234.5", 1.0),
    ("million", "\\boxed{10^6}", "1,000,000", 1.0),
    ("list-gold-not-a-number", "\\boxed{357}", "3,5,7", 0.0),  # issue
    ("list-box", "\\boxed{3, 5, 7}", "3,5,7", 1.0),
    ("list-set", "\\boxed{\\{7,5,3\\}}", "3,5,7", 1.0),
    ("list-anchor-and", "The answer is 3, 5 and 7.", "3,5,7", 1.0),
    ("list-missing-member", "\\boxed{3, 5}", "3,5,7", 0.0),
    # --- tuples and intervals -------------------------------------------------------------------------------------
    ("pair-box", "\\boxed{(0,1)}", "(0,1)", 1.0),  # issue
    ("pair-box-space", "\\boxed{(0, 1)}", "(0,1)", 1.0),
    ("pair-anchor", "The answer is (0, 1).", "(0,1)", 1.0),
    ("interval-closed-vs-open", "\\boxed{[0,1]}", "(0,1)", 0.0),
    ("interval-half-open", "\\boxed{[0, 1)}", "[0,1)", 1.0),
    ("pair-order", "\\boxed{(2,1)}", "(1,2)", 0.0),
    # --- LaTeX and plain references -------------------------------------------------------------------------------
    ("frac-gold-decimal", "The answer is 0.5.", "\\frac{1}{2}", 1.0),
    ("frac-gold-short-frac", "\\boxed{\\frac12}", "\\frac{1}{2}", 1.0),
    ("frac-gold-slash", "\\boxed{1/2}", "\\frac{1}{2}", 1.0),
    ("frac-gold-wrong", "\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ("sqrt-gold", "\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),  # issue
    ("sqrt-gold-power", "\\boxed{2^{1/2}}", "\\sqrt{2}", 1.0),
    ("sqrt-gold-integer", "\\boxed{2}", "\\sqrt{2}", 0.0),
    ("pi-gold-coefficient", "\\boxed{2}", "2\\pi", 0.0),  # issue
    ("pi-gold", "\\boxed{2\\pi}", "2\\pi", 1.0),
    ("pi-gold-plain-pi", "\\boxed{\\pi}", "2\\pi", 0.0),
    ("pi-gold-unboxed", "The answer is 2\\pi.", "2\\pi", 1.0),
    ("exponent-gold", "\\boxed{x^2}", "x^2", 1.0),
    ("exponent-gold-wrong", "\\boxed{x^3}", "x^2", 0.0),
    ("exponent-value", "The answer is 1024.", "2^{10}", 1.0),
    ("plain-decimal-gold", "\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("plain-fraction-gold", "The answer is 0.5", "1/2", 1.0),
    ("dollar-env-gold", "\\boxed{\\frac{3}{4}}", "$\\frac{3}{4}$", 1.0),
    # --- percentages ----------------------------------------------------------------------------------------------
    ("percent", "The answer is 25%.", "25%", 1.0),
    ("percent-latex", "\\boxed{25\\%}", "25\\%", 1.0),
    ("percent-wrong", "The answer is 30%.", "25%", 0.0),
    # --- units and trailing words ---------------------------------------------------------------------------------
    ("units-words", "The answer is 18 apples.", "18", 1.0),
    ("units-currency", "The answer is $18.", "18", 1.0),
    ("units-dollars", "#### 18 dollars", "18", 1.0),
    ("units-latex-text", "\\boxed{18\\text{ cm}}", "18", 1.0),
    ("units-speed", "The answer is 18 km/h.", "18", 1.0),
    ("trailing-paren", "18 apples (since 3+15).", "18", 1.0),  # issue
    # --- negative numbers -----------------------------------------------------------------------------------------
    ("negative", "The answer is -5.", "-5", 1.0),
    ("negative-unicode-minus", "The answer is \u22125.", "-5", 1.0),
    ("negative-box", "\\boxed{-5}", "-5", 1.0),
    ("negative-sign-lost", "The answer is 5.", "-5", 0.0),
    # --- hedged answers: several different candidates score 0 -----------------------------------------------------
    ("hedge-or", "The answer is 17 or 18", "18", 0.0),  # issue
    ("hedge-either", "The answer is either 17 or 18.", "18", 0.0),
    ("hedge-hashes", "#### 17 or 18", "18", 0.0),
    ("hedge-comma", "The answer is 17, 18.", "18", 0.0),
    ("hedge-and", "The answer is 17 and 18.", "18", 0.0),
    ("hedge-boxes", "\\boxed{17} or \\boxed{18}", "18", 0.0),
    ("hedge-inside-box", "\\boxed{17 \\text{ or } 18}", "18", 0.0),
    ("hedge-last-line", "17 or 18", "18", 0.0),
    ("hedge-same-value", "The answer is 18 or 18.0.", "18", 1.0),
    ("hedge-many-boxes", " ".join(f"\\boxed{{{i}}}" for i in range(20)), "18", 0.0),
    # --- hedges in other shapes (issue 27): two candidate numbers, a logical "or" in the box ---------------------
    ("hedge-two-numbers-last-line", "17 18", "18", 0.0),  # issue 27
    ("hedge-two-numbers-sentence", "So it is 17 18", "18", 0.0),
    ("hedge-comma-last-line", "So it is 17, 18", "18", 0.0),
    ("hedge-maybe", "Maybe 17, maybe 18", "18", 0.0),
    ("hedge-between", "Between 17 and 18.", "18", 0.0),
    ("hedge-pipe", "The answer is 17 | 18.", "18", 0.0),
    ("hedge-range-anchor", "The answer is 17 to 18.", "18", 0.0),
    ("hedge-hashes-two-numbers", "#### 17 18", "18", 0.0),
    ("hedge-two-assignments", "x = 17, x = 18", "18", 0.0),
    ("hedge-box-lor", "\\boxed{17 \\lor 18}", "18", 0.0),  # issue 27
    ("hedge-box-vee", "\\boxed{17 \\vee 18}", "18", 0.0),
    ("hedge-box-text-or-right-first", "\\boxed{18 \\text{ or } 17}", "18", 0.0),
    ("hedge-anchor-latex-lor", "The answer is $17 \\lor 18$.", "18", 0.0),
    ("hedge-anchor-text-or", "The answer is 17 \\text{ or } 18.", "18", 0.0),
    ("hedge-in-remark", "The answer is 18 (or maybe 17).", "18", 0.0),
    ("hedge-box-same-value-lor", "\\boxed{18 \\lor 18.0}", "18", 1.0),
    ("hedge-box-same-value-text", "\\boxed{18 \\text{ or } 18}", "18", 1.0),
    # --- not hedges: working before the answer, lists for list references, a range in a last sentence ----------
    ("working-line-then-answer", "3 + 15 = 18 apples and 2 = 2 pears\nThe answer is 18.", "18", 1.0),
    ("working-then-answer-numbers", "First 3 and 15.\nThe answer is 18.", "18", 1.0),
    ("working-in-last-sentence", "She had 3 and got 15, so 18 in total.", "18", 1.0),
    ("working-equation-last", "So 3 + 15 = 18.", "18", 1.0),
    ("from-to-last-sentence", "The price rose from 12 to 18.", "18", 1.0),
    ("two-variables-not-a-hedge", "So x = 3, y = 18", "18", 1.0),
    ("list-gold-comma-anchor", "The answer is 12, 3.", "12,3", 1.0),
    ("list-gold-two-numbers-box", "\\boxed{12, 3}", "12,3", 1.0),
    ("thousands-not-a-hedge", "So the total is 1,234.", "1234", 1.0),
    ("remark-with-words-dropped", "The answer is 18 (three plus fifteen).", "18", 1.0),
    # --- LaTeX escapes read as their numbers (issue 27) -----------------------------------------------------------
    ("escaped-dollar-last-sentence", "She pays \\$18 in total.", "18", 1.0),  # issue 27
    ("escaped-dollar-anchor", "The answer is \\$18.", "18", 1.0),
    ("escaped-dollar-hashes", "#### \\$18", "18", 1.0),
    ("escaped-dollar-decimals", "She pays \\$18.50 in total.", "18.5", 1.0),
    ("escaped-dollar-thousands", "So the total is \\$1,234.", "1234", 1.0),
    ("escaped-dollar-two-prices", "It costs \\$5 per hour, so 4 hours cost \\$20.", "20", 1.0),
    ("escaped-dollar-wrong", "She pays \\$17 in total.", "18", 0.0),
    ("escaped-dollar-reference", "The answer is 18.", "\\$18", 1.0),
    ("escaped-percent", "The answer is 50\\%.", "50\\%", 1.0),
    ("latex-thin-space-thousands", "The answer is 1\\,234.", "1234", 1.0),
    ("unicode-thin-space-thousands", "The answer is 1\u2009234.", "1234", 1.0),
    ("text-unit-last-sentence", "So the total is 18 \\text{ dollars}.", "18", 1.0),
    # --- an answer followed by a check sentence -------------------------------------------------------------------
    ("check-after", "The answer is 18. Then 5 more.", "18", 1.0),  # issue
    ("check-equation", "The answer is 18. Check: 3 + 15 = 18.", "18", 1.0),
    ("check-after-hashes", "#### 18\nCheck: 18 - 3 = 15", "18", 1.0),
    ("check-after-box", "\\boxed{18}. Let me verify: 20 - 2 = 18.", "18", 1.0),
    ("check-since", "The answer is 18, since 3+15=18.", "18", 1.0),
    ("check-not", "The answer is 18, not 17.", "18", 1.0),
    # --- empty and huge responses ---------------------------------------------------------------------------------
    ("empty", "", "18", 0.0),
    ("blank", "   \n\n\t\n", "18", 0.0),
    ("junk-marker", "#### ?", "18", 0.0),
    ("1mb-prose-then-answer", "we add them up. " * (MB // 16) + "\nThe answer is 18.", "18", 1.0),
    ("1mb-blank-lines-then-hashes", "\n" * MB + "#### 18", "18", 1.0),
    ("1mb-one-line-repetition", "18" * (MB // 2), "18", 0.0),
    ("1mb-open-boxes", "\\boxed{" * (MB // 7), "18", 0.0),
    ("1mb-nested-boxes", "\\boxed{" * (MB // 16) + "18" + "}" * (MB // 16), "18", 0.0),  # 65k different boxes
    ("1mb-braces-then-box", "{" * MB + "\\boxed{18}", "18", 1.0),
    ("power-tower", "\\boxed{10^{10^{10}}}", "18", 0.0),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("response,answer,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_math_case(response, answer, expected):
    assert math_verifier(response, {"uid": "case", "answer": answer, "meta": {}}) == expected


def test_table_is_large_and_unique():
    assert len(CASES) >= 60
    assert len({c[0] for c in CASES}) == len(CASES)
    assert {1.0, 0.0} == {c[3] for c in CASES}


def test_references_parse_as_the_kind_they_are():
    import sympy

    assert parse_reference("1,234")[0] == 1234
    assert isinstance(parse_reference("3,5,7")[0], sympy.FiniteSet)
    assert parse_reference("(0,1)")[0] == sympy.Interval.open(0, 1)
    assert parse_reference("2\\pi")[0] == 2 * sympy.pi
    assert parse_reference("\\sqrt{2}")[0] == sympy.sqrt(2)
    assert parse_reference("9 * 2 = <<9*2=18>>18\n#### 18")[0] == 18
    assert parse_reference("") == []


def test_candidates_and_boxes():
    assert boxed_contents("a \\boxed{x^{2}} b \\fbox{\\{1\\}} \\boxed{") == ["x^{2}", "\\{1\\}"]
    assert boxed_contents("no box") is None
    assert candidates("The answer is 17 or 18.") == ("anchor", ["17", "18"])
    assert candidates("The answer is 3, 5 and 7.", several=True) == ("anchor", ["3, 5 and 7"])
    assert candidates("18 apples (since 3+15).") == ("last", ["18 apples"])
    assert candidates("") == ("none", [])


def test_math_bad_rows_are_refused_clearly():
    with pytest.raises(ValueError, match="math row 'u1': answer must be a string or a number"):
        math_verifier("18", {"uid": "u1", "meta": {}})
    for bad in ("???", "", "#### ", "\\frac{1}{"):
        with pytest.raises(ValueError, match="math row 'u2': reference answer .* does not parse as math"):
            math_verifier("18", {"uid": "u2", "answer": bad, "meta": {}})


FORMAT_CASES = [
    ("work\n#### 18", 1.0),
    ("#### 18 apples", 1.0),
    ("#### $1,234", 1.0),
    ("#### \\frac{1}{2}", 1.0),
    ("#### 3, 5, 7", 1.0),
    ("#### ?", 0.0),  # issue: junk after the marker
    ("#### ???", 0.0),
    ("#### eighteen", 0.0),
    ("#### 17 or 18", 0.0),
    ("####", 0.0),
    ("####\n18", 0.0),  # the answer must be on the marker's line
    ("18", 0.0),
    ("#### 18\n#### ?", 0.0),  # the last marker counts
    ("\n" * MB + "#### 5", 1.0),
    ("  \n" * (MB // 3) + "no marker", 0.0),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("response,expected", FORMAT_CASES, ids=[repr(c[0][-24:]) for c in FORMAT_CASES])
def test_format_pays_only_for_a_marked_answer(response, expected):
    assert format_verifier(response, {"meta": {}}) == expected
    # as the worker calls it: the pattern bound from the config's default
    assert get_verifier("format", RewardConfig())(response, {"meta": {}}) == expected


def test_is_answer():
    assert is_answer("18") and is_answer(" -5 ") and is_answer("(0, 1)") and is_answer("\\sqrt{2}")
    assert not is_answer("?") and not is_answer("") and not is_answer("abc") and not is_answer("1 or 2")
