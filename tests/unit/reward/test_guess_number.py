"""``GuessNumber``'s row options: a fixed secret, the episode's bonus for saved guesses, the row's prompt as the
first message, and guesses written as text (the ``tag`` tool-call format's argument)."""

from __future__ import annotations

import pytest

from reward.envs.guess_number import GuessNumber
from tests.helpers.envs import row


def _guess(env: GuessNumber, number) -> str:
    result = env.step("", [{"name": "guess", "arguments": {"number": number}}])
    return result.messages[0]["content"]


def test_a_fixed_secret_replaces_the_seeded_one():
    assert {GuessNumber(row("g", low=1, high=9, secret=4), s).secret for s in range(20)} == {4}
    with pytest.raises(ValueError, match="secret=10 is outside"):
        GuessNumber(row("g", low=1, high=9, secret=10), 0)


def test_guesses_written_as_text_are_read_as_integers():
    env = GuessNumber(row("g", low=1, high=9, secret=6), 0)
    assert [_guess(env, n) for n in ("3", " 8 ", "+5")] == ["higher", "lower", "higher"]
    bad = env.step("", [{"name": "guess", "arguments": {"number": "6.5"}},
                        {"name": "guess", "arguments": {"number": "six"}}])
    assert bad.tool_errors == {"raised": 2} and not bad.done and env.guesses == 3
    assert _guess(env, "6") == "correct" and env.found and env.guesses == 4


@pytest.mark.parametrize("guesses, reward", [(1, {"found": 1.0, "saved": 0.8}), (9, {"found": 1.0, "saved": 0.0}),
                                             (12, {"found": 1.0, "saved": 0.0})])
def test_the_bonus_counts_the_guesses_saved_against_trying_every_number(guesses, reward):
    env = GuessNumber(row("g", low=1, high=9, secret=1, guess_bonus=0.1), 0)
    for _ in range(guesses - 1):
        assert _guess(env, 5) == "lower"
    assert _guess(env, 1) == "correct"
    assert env.reward() == pytest.approx(reward)


def test_without_the_number_found_there_is_no_bonus_and_without_a_bonus_no_component():
    env = GuessNumber(row("g", low=1, high=9, secret=3, guess_bonus=0.1), 0)
    _guess(env, 5)
    assert env.reward() == {"found": 0.0}
    plain = GuessNumber(row("g", low=1, high=9, secret=3), 0)
    _guess(plain, 3)
    assert plain.reward() == {"found": 1.0}
    with pytest.raises(ValueError, match="guess_bonus=-0.1"):
        GuessNumber(row("g", guess_bonus=-0.1), 0)


def test_the_first_message_is_the_rules_or_the_rows_prompt():
    assert "between 1 and 9" in GuessNumber(row("g", low=1, high=9), 0).initial_messages()[0]["content"]
    env = GuessNumber(row("g", prompt="Guess my number in 1..9.", low=1, high=9, use_prompt=True), 0)
    assert env.initial_messages() == [{"role": "user", "content": "Guess my number in 1..9."}]
