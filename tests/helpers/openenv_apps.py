"""OpenEnv apps for the adapter's tests (``env.openenv.app: tests.helpers.openenv_apps:NAME``): the example game
with one session at a time (a session left open would refuse the next), a game whose guess 999 answers after
``SLOW_S`` seconds, and an app object that is not an ASGI app (its server exits at start)."""

from __future__ import annotations

import time
from typing import Any, Optional

from openenv.core.env_server.http_server import create_app

from reward.envs.openenv_guess import GuessAction, GuessEnvironment, GuessObservation

SLOW_S = 30.0  # how long the slow game's guess 999 takes


class SlowGuess(GuessEnvironment):
    """The guessing game, but the guess 999 answers after ``SLOW_S`` seconds."""

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **_: Any) -> GuessObservation:
        """The game's step; 999 sleeps first."""
        if action.number == 999:
            time.sleep(SLOW_S)
        return super().step(action)


one_session = create_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=1)
slow = create_app(SlowGuess, GuessAction, GuessObservation, max_concurrent_envs=8)
not_an_app = 42
