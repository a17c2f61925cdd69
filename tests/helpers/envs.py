"""Environments and tools for the env worker tests, named by ``module:name`` (``tests.helpers.envs:Scripted``).

``Scripted`` does what its row's ``meta`` says: ``raise_in`` / ``hang_in`` name a method (``init``,
``initial_messages``, ``tools``, ``step``, ``reward``, ``close``) that raises ``RuntimeError`` or blocks until
the test opens the row's gate (``release(uid)``; at most ``HANG_S`` seconds, so a forgotten gate cannot hang
the suite); ``service_fails_in`` names a method that raises ``reward.infra.InfraFailure`` of cause
``meta["cause"]`` (a service it needs failed). Every call it gets is written to ``EVENTS[row uid]`` so that a
test sees, for instance, that ``close`` ran after an error. ``ServiceTool`` adds a tool backed by a service.
"""

from __future__ import annotations

import random
import threading
from collections import defaultdict

from reward.environment import Environment, StepResult, tool
from reward.infra import InfraFailure

HANG_S = 30.0
EVENTS: dict[str, list[str]] = defaultdict(list)
_GATES: dict[str, threading.Event] = {}
_GATES_LOCK = threading.Lock()


def gate(uid: str) -> threading.Event:
    """The gate a hanging call of row ``uid`` waits on."""
    with _GATES_LOCK:
        return _GATES.setdefault(uid, threading.Event())


def release(uid: str) -> None:
    """Let every call of row ``uid`` that hangs return."""
    gate(uid).set()


def row(uid: str, prompt: str = "Add 2 and 3.", answer: str = "5", verifier: str = "exact", **meta) -> dict:
    """A data row as the env worker gets it (``PromptRow`` fields)."""
    return {"uid": uid, "prompt": prompt, "prompt_token_ids": [], "answer": answer, "verifier": verifier,
            "meta": dict(meta)}


class Scripted(Environment):
    """Tools ``add``, ``fail`` and ``wait``; reward ``{"base": 1.0, "per_turn": 0.25 * turns}``; fails or hangs
    where ``meta`` says."""

    def __init__(self, row: dict, seed: int):
        super().__init__(row, seed)
        self.uid = self.row["uid"]
        self.meta = self.row.get("meta") or {}
        self.turns = 0
        self.noise = random.Random(seed).random()
        self._act("init")

    def _act(self, method: str) -> None:
        EVENTS[self.uid].append(method)
        if self.meta.get("raise_in") == method:
            raise RuntimeError(f"scripted failure in {method}")
        if self.meta.get("hang_in") == method:
            gate(self.uid).wait(HANG_S)
        if self.meta.get("service_fails_in") == method:
            raise InfraFailure(self.meta.get("cause", "server_died"), f"the service failed in {method}")

    def initial_messages(self) -> list[dict]:
        """The default messages, with the seed's noise in a system message."""
        self._act("initial_messages")
        return [{"role": "system", "content": f"noise {self.noise:.6f}"}, *super().initial_messages()]

    def tools(self) -> list:
        """The @tool methods."""
        self._act("tools")
        return super().tools()

    @tool
    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first integer
            b: the second integer
        """
        return a + b

    @tool
    def fail(self, reason: str) -> str:
        """Raise an error.

        Args:
            reason: what the error says
        """
        raise RuntimeError(reason)

    @tool
    def wait(self, seconds: float) -> str:
        """Block until the test opens the gate.

        Args:
            seconds: the longest wait, seconds
        """
        gate(self.uid).wait(min(seconds, HANG_S))
        return "waited"

    def helper(self) -> int:
        """A public method that is not a tool."""
        return 0

    def step(self, assistant_text: str, tool_calls: list[dict]) -> StepResult:
        """The default step, recorded."""
        self._act("step")
        self.turns += 1
        result = super().step(assistant_text, tool_calls)
        result.reward = 0.5
        return result

    def reward(self) -> dict[str, float]:
        """``{"base": 1.0, "per_turn": 0.25 * turns}`` (or ``meta["reward"]`` as given, to test its checks)."""
        self._act("reward")
        if "reward" in self.meta:
            return self.meta["reward"]
        return {"base": 1.0, "per_turn": 0.25 * self.turns}

    def close(self) -> None:
        """Recorded."""
        self._act("close")


class ServiceTool(Scripted):
    """``Scripted`` with a tool ``lookup`` backed by a service that fails as ``meta["service"]`` says: a
    ``reward.infra.Cause`` value raises ``InfraFailure`` of that cause (the service's failure), ``"raise"`` a
    plain ``KeyError`` (back to the model as a tool error); unset, it answers."""

    @tool
    def lookup(self, key: str) -> str:
        """Look a key up in the service.

        Args:
            key: what to look up
        """
        how = self.meta.get("service")
        if how == "raise":
            raise KeyError(key)
        if how:
            raise InfraFailure(how, f"the lookup service failed ({how})")
        return f"value of {key}"


class Forgiving(Scripted):
    """A ``step`` that turns every ``Exception`` into a plain answer."""

    def step(self, assistant_text: str, tool_calls: list[dict]) -> StepResult:
        """The default step, exceptions caught."""
        try:
            return super().step(assistant_text, tool_calls)
        except Exception as err:  # noqa: BLE001 - the point of this helper
            return StepResult([{"role": "user", "content": f"never mind: {err}"}], done=False)


class BadStep(Environment):
    """``step`` returns a plain dict instead of a ``StepResult``."""

    def step(self, assistant_text: str, tool_calls: list[dict]):
        """Breaks the contract."""
        return {"messages": [], "done": True}

    def reward(self) -> float:
        """1.0."""
        return 1.0


class UndocumentedTool(Environment):
    """A ``@tool`` method without a docstring."""

    @tool
    def shout(self, text: str) -> str:  # noqa: D102 - the point of this helper
        return text.upper()

    def reward(self) -> float:
        """0.0."""
        return 0.0


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def untyped(a, b):
    """Add two things.

    Args:
        a: the first
        b: the second
    """
    return a + b


def undocumented_arg(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
    """
    return a + b


NOT_A_FUNCTION = 3
