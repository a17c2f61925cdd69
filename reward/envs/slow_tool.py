"""An environment whose tool is slow, for measuring whether the engines wait on tools (``bench/agent_tools.py``).

Every assistant turn goes to ``step``, which waits like a tool call of ``delay_s`` seconds (the row's
``meta["delay_s"]``, default 0.2, times a factor from the seed in [0.5, 1.5]) and replies "go on", until the
episode has had its 3 or 4 turns (from the seed); whatever the model wrote does not matter. The reward is 0.
"""

from __future__ import annotations

import random
import time

from reward.environment import Environment, StepResult


class SlowTool(Environment):
    """Episodes of 3-4 turns, each answered after a slow tool's delay (module docstring)."""

    def __init__(self, row: dict, seed: int):
        super().__init__(row, seed)
        rng = random.Random(seed)
        self.turns_left = rng.choice([3, 4])
        self.delay_s = float((row.get("meta") or {}).get("delay_s", 0.2)) * rng.uniform(0.5, 1.5)

    def step(self, assistant_text: str, tool_calls: list[dict]) -> StepResult:
        time.sleep(self.delay_s)
        self.turns_left -= 1
        return StepResult([{"role": "user", "content": "go on"}], done=self.turns_left <= 0)

    def reward(self) -> float:
        return 0.0
