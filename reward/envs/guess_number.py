"""``GuessNumber``: find a secret integer by guessing; each guess is answered ``higher``, ``lower`` or
``correct`` (``env.cls: reward.envs.guess_number:GuessNumber``)."""

from __future__ import annotations

import random
import re

from reward.environment import Environment, StepResult, tool

_INTEGER = re.compile(r"[+-]?\d+")


class GuessNumber(Environment):
    """Find the secret integer in ``[low, high]`` with the ``guess`` tool.

    The secret is drawn from the episode's seed (``random.Random(seed)``), so the G episodes of a group, which
    share a seed, hunt the same number. The row's ``meta`` may set:

    * ``low`` and ``high`` (default 1 and 100);
    * ``secret``: the number itself, in ``[low, high]``, instead of one drawn from the seed (held-out rows that
      cover the range evenly);
    * ``turn_penalty`` (default 0: none): when set, every turn's per-turn reward is ``-turn_penalty``;
    * ``guess_bonus`` (default 0: none): the episode's reward for fewer guesses (below);
    * ``use_prompt`` (default false): the first message is the row's prompt (a task that states the game in its
      own words) instead of the rules written here.

    The episode ends when the number is found or when a turn has no tool call. Reward: ``{"found": 1.0}`` when
    it was found, else ``{"found": 0.0}``; with ``guess_bonus`` b > 0 a found number also earns ``{"saved": b x
    (guesses saved against trying every number: high - low + 1 - guesses, not below 0)}``, so finding it in fewer
    guesses is better and a found number always scores at least 1 (``correct``). Every guess counts, also several
    in one turn.

    Raises (at construction):
        ValueError: ``low > high``, a secret outside ``[low, high]``, or a bound, the secret or a penalty or bonus
            that is not a number (a negative bonus included).
    """

    def __init__(self, row: dict, seed: int):
        super().__init__(row, seed)
        meta = self.row.get("meta") or {}
        self.low = int(meta.get("low", 1))
        self.high = int(meta.get("high", 100))
        if self.low > self.high:
            raise ValueError(f"GuessNumber: meta low={self.low} > high={self.high}")
        self.turn_penalty = float(meta.get("turn_penalty", 0.0))
        self.guess_bonus = float(meta.get("guess_bonus", 0.0))
        if not self.guess_bonus >= 0:
            raise ValueError(f"GuessNumber: meta guess_bonus={self.guess_bonus} must be >= 0")
        self.use_prompt = bool(meta.get("use_prompt", False))
        if meta.get("secret") is not None:
            self.secret = int(meta["secret"])
            if not self.low <= self.secret <= self.high:
                raise ValueError(f"GuessNumber: meta secret={self.secret} is outside [{self.low}, {self.high}]")
        else:
            self.secret = random.Random(self.seed).randint(self.low, self.high)
        self.guesses = 0
        self.found = False

    def initial_messages(self) -> list[dict]:
        """The rules, as one user message (the row's prompt with ``meta["use_prompt"]``)."""
        if self.use_prompt:
            return super().initial_messages()
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
        if isinstance(number, str) and _INTEGER.fullmatch(number.strip()):
            number = int(number.strip())  # the tag format's argument is text: "<call>guess 12</call>"
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
        """``{"found": 1.0 or 0.0}``, plus ``{"saved": ...}`` for a found number with ``guess_bonus``."""
        out = {"found": 1.0 if self.found else 0.0}
        if self.guess_bonus and self.found:
            out["saved"] = self.guess_bonus * max(0, self.high - self.low + 1 - self.guesses)
        return out
