"""An OpenEnv environment written with openenv-core's server API: find a secret integer from ``higher`` /
``lower`` replies, served over HTTP and WebSocket (``env.openenv.app: reward.envs.openenv_guess:app``;
``configs/tiny_openenv_guess.yaml``). It needs nothing beyond openenv-core (no Docker).

The game is ``reward.envs.guess_number.GuessNumber``'s, so that the two can be compared: the secret is
``random.Random(seed).randint(low, high)`` unless ``reset`` is given one, so the G episodes of a group (one seed)
hunt the same number. Each step is one guess (``GuessAction.number``); its observation's ``message`` is
``higher``, ``lower`` or ``correct``, and ``correct`` ends the episode with reward ``1 + guess_bonus x (guesses
saved against trying every number, high - low + 1 - guesses, not below 0)``; every other step's reward is 0, so
the steps' sum (``env.openenv.reward: sum``) is ``GuessNumber``'s reward.

Run it alone: ``python -m reward.openenv_server --app reward.envs.openenv_guess:app --port 8000``.
"""

from __future__ import annotations

import random
from typing import Any, Optional
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

MAX_SESSIONS = 1024  # WebSocket sessions (episodes) open at once on one server


class GuessAction(Action):
    """Guess the secret number."""

    number: int = Field(..., description="the guess, an integer")


class GuessObservation(Observation):
    """The reply to a guess (or the rules, after reset)."""

    message: str = Field("", description="higher, lower or correct; the rules after reset")


class GuessState(State):
    """The game's state: the range, the secret, the guesses so far and whether the secret was found."""

    low: int = 1
    high: int = 100
    secret: int = 0
    guesses: int = 0
    found: bool = False


class GuessEnvironment(Environment):
    """The number-guessing game as an OpenEnv environment (one instance per WebSocket session)."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # instances share nothing

    def __init__(self) -> None:
        super().__init__()
        self._state = GuessState(episode_id=str(uuid4()))
        self.guess_bonus = 0.0

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, low: int = 1, high: int = 100,
              secret: Optional[int] = None, guess_bonus: float = 0.0, **_: Any) -> GuessObservation:
        """A new game in ``[low, high]``: the secret from ``seed`` (or ``secret`` itself).

        Raises:
            ValueError: ``low > high``, a secret outside the range, or a negative ``guess_bonus``.
        """
        low, high = int(low), int(high)
        if low > high:
            raise ValueError(f"low={low} > high={high}")
        if float(guess_bonus) < 0:
            raise ValueError(f"guess_bonus={guess_bonus} must be >= 0")
        if secret is None:
            secret = random.Random(seed).randint(low, high)
        if not low <= int(secret) <= high:
            raise ValueError(f"secret={secret} is outside [{low}, {high}]")
        self.guess_bonus = float(guess_bonus)
        self._state = GuessState(episode_id=episode_id or str(uuid4()), low=low, high=high, secret=int(secret))
        return GuessObservation(message=f"I am thinking of an integer between {low} and {high}. Find it with the "
                                        "guess tool: each guess is answered 'higher', 'lower' or 'correct'.")

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **_: Any) -> GuessObservation:
        """One guess: ``higher`` / ``lower`` (reward 0) or ``correct`` (done; reward 1 plus the bonus)."""
        s = self._state
        s.step_count += 1
        s.guesses += 1
        if s.found:
            return GuessObservation(message="the game is over", done=True, reward=0.0)
        if action.number < s.secret:
            return GuessObservation(message="higher", reward=0.0)
        if action.number > s.secret:
            return GuessObservation(message="lower", reward=0.0)
        s.found = True
        saved = max(0, s.high - s.low + 1 - s.guesses)
        return GuessObservation(message="correct", done=True, reward=1.0 + self.guess_bonus * saved)

    @property
    def state(self) -> GuessState:
        """The game's state."""
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess_number",
                 max_concurrent_envs=MAX_SESSIONS)
