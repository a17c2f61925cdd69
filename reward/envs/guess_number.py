"""``GuessNumber``: find a secret integer by guessing; each guess is answered ``higher``, ``lower`` or
``correct`` (``env.cls: reward.envs.guess_number:GuessNumber``)."""

from __future__ import annotations

import random

from reward.environment import Environment, StepResult, tool


class GuessNumber(Environment):
    """Find the secret integer in ``[low, high]`` with the ``guess`` tool.

    The secret is drawn from the episode's seed (``random.Random(seed)``), so the G episodes of a group, which
    share a seed, hunt the same number. The row's ``meta`` may set ``low`` and ``high`` (default 1 and 100) and
    ``turn_penalty`` (default 0: none): when set, every turn's per-turn reward is ``-turn_penalty``. The row's
    prompt is not used: the first message states the game.

    The episode ends when the number is found or when a turn has no tool call. Reward: ``{"found": 1.0}`` when
    it was found, else ``{"found": 0.0}``.

    Raises (at construction):
        ValueError: ``low > high`` or a bound or the penalty is not a number.
    """

    def __init__(self, row: dict, seed: int):
        super().__init__(row, seed)
        meta = self.row.get("meta") or {}
        self.low = int(meta.get("low", 1))
        self.high = int(meta.get("high", 100))
        if self.low > self.high:
            raise ValueError(f"GuessNumber: meta low={self.low} > high={self.high}")
        self.turn_penalty = float(meta.get("turn_penalty", 0.0))
        self.secret = random.Random(self.seed).randint(self.low, self.high)
        self.guesses = 0
        self.found = False

    def initial_messages(self) -> list[dict]:
        """The rules, as one user message."""
        return [{"role": "user", "content": (
            f"I am thinking of an integer between {self.low} and {self.high}. Find it with the guess tool: each "
            "guess is answered 'higher', 'lower' or 'correct'.")}]

    @tool
    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: the guess, an integer

        Returns:
            "higher" when the secret is larger, "lower" when it is smaller, "correct" when it is the secret.
        """
        if isinstance(number, float) and number.is_integer():
            number = int(number)
        if isinstance(number, bool) or not isinstance(number, int):
            raise ValueError(f"number must be an integer, got {number!r}")
        self.guesses += 1
        if number < self.secret:
            return "higher"
        if number > self.secret:
            return "lower"
        self.found = True
        return "correct"

    def step(self, assistant_text: str, tool_calls: list[dict]) -> StepResult:
        """The default step (guesses run in order), done once the number is found."""
        result = super().step(assistant_text, tool_calls)
        result.done = result.done or self.found
        if self.turn_penalty:
            result.reward = -self.turn_penalty
        return result

    def reward(self) -> dict[str, float]:
        """``{"found": 1.0 or 0.0}``."""
        return {"found": 1.0 if self.found else 0.0}
