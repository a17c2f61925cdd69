"""The example environments (``reward.envs``): the calculator tool against hand-computed values and its refusal
of anything but integer arithmetic; ``GuessNumber`` deterministic per seed and played to the end in an env
worker."""

from __future__ import annotations

import pytest

from reward.config import EnvConfig
from reward.env_worker import EnvWorker
from reward.envs.calculator import MAX_EXPRESSION_CHARS, calc, evaluate
from reward.envs.guess_number import GuessNumber
from tests.helpers.envs import row


@pytest.mark.parametrize("expression, value", [
    ("7", 7),
    ("2 + 3", 5),
    ("12 * (3 + 4) - 5", 79),
    ("2 - 3 - 4", -5),  # left to right
    ("2 + 3 * 4", 14),  # * before +
    ("(2 + 3) * 4", 20),
    ("-3 * -(2 - 7)", -15),
    ("+4", 4),
    ("123456789 * 987654321", 121932631112635269),
    ("((((1))))", 1),
    (" 1 +\t2 ", 3),
])
def test_calculator_values(expression, value):
    assert evaluate(expression) == value
    assert calc(expression) == str(value)


@pytest.mark.parametrize("expression, why", [
    ("__import__('os').system('true')", "only integers"),
    ("2 ** 64", "only integers"),  # a power: parses, refused in the tree
    ("7 / 2", "only integers"),
    ("7 // 2", "only integers"),
    ("1.5 + 1", "only integers"),
    ("0x10", "only integers"),
    ("1_000", "only integers"),
    ("abs(-1)", "only integers"),
    ("()", "only integers"),  # an empty tuple
    ("2 3", "not a well-formed"),
    ("(1 + 2", "not a well-formed"),
    ("", "not a well-formed"),
    ("007", "not a well-formed"),
    ("9" * (MAX_EXPRESSION_CHARS + 1), "characters long"),
])
def test_calculator_refuses_anything_but_integer_arithmetic(expression, why):
    with pytest.raises(ValueError, match=why):
        calc(expression)


def test_calculator_refuses_a_non_string():
    with pytest.raises(TypeError, match="must be a string"):
        evaluate(12)


def test_calculator_as_a_tool_in_an_env_worker():
    w = EnvWorker(EnvConfig(tools=["reward.envs.calculator:calc"]))
    start = w.start("c", row("calc1", prompt="What is 6 * 7?", answer="42"), 0)
    assert start.tool_schemas[0]["function"]["parameters"]["required"] == ["expression"]
    step = w.step("c", "...", [{"name": "calc", "arguments": {"expression": "6 * 7"}},
                               {"name": "calc", "arguments": {"expression": "6 ** 7"}}], [])
    assert step.messages[0]["content"] == "42" and step.tool_errors == {"raised": 1}
    assert step.messages[1]["content"].startswith("Error: ValueError: only integers")
    w.step("c", "#### 42", [], [])
    assert w.finish("c").reward == 1.0


def test_guess_number_is_deterministic_per_seed():
    secrets = [GuessNumber(row(f"g{s}"), s).secret for s in range(40)]
    assert secrets == [GuessNumber(row("other"), s).secret for s in range(40)]  # the seed alone decides
    assert len(set(secrets)) > 20 and all(1 <= x <= 100 for x in secrets)
    small = GuessNumber(row("g", low=3, high=5), 1)
    assert 3 <= small.secret <= 5 and "between 3 and 5" in small.initial_messages()[0]["content"]
    with pytest.raises(ValueError, match="low=9 > high=2"):
        GuessNumber(row("g", low=9, high=2), 0)


def test_guess_number_answers_and_rewards():
    env = GuessNumber(row("g1", turn_penalty=0.1), 4)
    s = env.secret
    below, above = max(s - 1, 0), s + 1
    result = env.step("", [{"name": "guess", "arguments": {"number": below}},
                           {"name": "guess", "arguments": {"number": above}}])
    assert [m["content"] for m in result.messages] == ["higher", "lower"] and not result.done
    assert result.reward == -0.1 and env.reward() == {"found": 0.0}
    bad = env.step("", [{"name": "guess", "arguments": {"number": "fifty"}}])
    assert bad.tool_errors == {"raised": 1} and not bad.done
    found = env.step("", [{"name": "guess", "arguments": {"number": float(s)}}])
    assert found.messages[0]["content"] == "correct" and found.done and env.reward() == {"found": 1.0}
    assert GuessNumber(row("g2"), 4).step("", []).reward is None  # no penalty unless the row sets one


def test_guess_number_played_by_binary_search_in_a_worker():
    w = EnvWorker(EnvConfig(cls="reward.envs.guess_number:GuessNumber", max_turns=8))
    outcomes = []
    for seed in (0, 1, 2):
        w.start(f"e{seed}", row(f"bs{seed}"), seed)
        low, high, step = 1, 100, None
        while step is None or not step.done:
            mid = (low + high) // 2
            step = w.step(f"e{seed}", f"guess {mid}", [{"name": "guess", "arguments": {"number": mid}}], [])
            answer = step.messages[0]["content"]
            low, high = (mid + 1, high) if answer == "higher" else (low, mid - 1) if answer == "lower" else (mid, mid)
        outcomes.append(w.finish(f"e{seed}"))
    assert [(o.status, o.reward, o.components) for o in outcomes] == [("ok", 1.0, {"found": 1.0})] * 3
    assert all(o.turns <= 7 for o in outcomes)  # binary search over 100 numbers
    w.start("lazy", row("bs-lazy"), 0)
    assert w.step("lazy", "I give up.", [], []).done
    lazy = w.finish("lazy")
    assert (lazy.status, lazy.reward, lazy.correct) == ("ok", 0.0, False)
