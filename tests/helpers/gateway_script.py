"""An agent program against the real session gateway, with a script in the driver's place (no Ray, no engine).

``play(fn, row, script)`` serves ``cluster.runtime.gateway.Gateway`` in-process with uvicorn on 127.0.0.1, opens
one session, runs the agent function ``fn(row, client)`` through ``reward.agent_runner.AgentRuns`` (its own
thread, as an env worker runs it) and answers each request the agent sends with the script's next entry, the way
the driver's ``exchange`` loop does. It returns what the gateway saw: every request (``ChatRequest`` fields as
``exchange`` hands them to the driver) and the event that ended the session (the runner's close with the agent's
reward, the agent program's own close, or a timeout).

A script entry is a ``Reply`` (the sampled turn), a ``ProtocolError`` (the request fails with it), or a function
of the request (its fields as a dict) returning one of those. A request past the script's end is answered with a
503 (``code="script_exhausted"``) and counted in ``Played.exhausted``, so a test sees an agent that asked more
than the script planned instead of hanging.

``start_agent`` replaces ``AgentRuns`` when the program under test is launched otherwise (it gets the session,
``Gateway.open``'s answer, and runs in a thread).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from cluster.runtime.gateway import Gateway
from rollout.openai_protocol import ProtocolError, Reply

ScriptEntry = Reply | ProtocolError | Callable[[dict], "Reply | ProtocolError"]
SESSION_ID = "scripted"


@dataclass
class Played:
    """What the gateway saw of one scripted episode.

    Attributes:
        requests: each request's fields (``rollout.openai_protocol.ChatRequest`` as a dict: ``messages`` in
            normal form, ``tools``, ``api``, ``stream``, ...), in order.
        end: the session's last event: ``{"kind": "end", "reward", "status", "error"}`` or ``{"kind": "timeout"}``.
        session: the session the agent was given (``base_url``, ``api_key``, ``session_id``).
        exhausted: requests that came after the script's last entry (answered with 503).
        agent_done: whether the agent had returned when the episode was over (the wait for it timed out if not).
        counters: the gateway's counters (``gateway/requests``, ``gateway/errors/<status>``, ...).
    """

    requests: list[dict] = field(default_factory=list)
    end: dict = field(default_factory=dict)
    session: dict = field(default_factory=dict)
    exhausted: int = 0
    agent_done: bool = False
    counters: dict = field(default_factory=dict)


async def drive(gateway: Gateway, session_id: str, script: Sequence[ScriptEntry], played: Played,
                timeout_s: float) -> None:
    """Answer the session's requests from ``script`` until its end event, filling ``played`` (module docstring)."""
    entries = list(script)
    event = await gateway.exchange(session_id, None, timeout_s)
    while event["kind"] == "request":
        request = event["request"]
        played.requests.append(request)
        if entries:
            entry = entries.pop(0)
            answer = entry(request) if callable(entry) else entry
        else:
            played.exhausted += 1
            answer = ProtocolError(503, "the test's script has no more replies", code="script_exhausted")
        event = await gateway.exchange(session_id, answer, timeout_s)
    played.end = event


async def _stop(gateway: Gateway) -> None:
    """Stop the server and wait (at most 5 s) for its task to end, so no socket outlives the test."""
    await gateway.stop()
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    if others:
        await asyncio.wait(others, timeout=5.0)


def play(fn: Callable[..., Any] | None, row: dict, script: Sequence[ScriptEntry], *, timeout_s: float = 60.0,
         start_agent: Callable[[dict], Any] | None = None) -> Played:
    """Run one episode of the agent ``fn(row, client)`` against a served ``Gateway`` answered by ``script``.

    Args:
        fn: the agent function (sync or a coroutine function), run by ``AgentRuns``; None with ``start_agent``.
        row: the task row handed to the agent.
        script: the answers to the agent's requests, in order (module docstring).
        timeout_s: the episode's deadline (the gateway's wait for each event, the agent's HTTP timeout).
        start_agent: instead of ``AgentRuns``: called with the session in a thread of its own.

    Returns:
        ``Played``; the agent was waited for (at most 15 s) after the session ended.
    """
    played = Played()
    threads: list[threading.Thread] = []

    async def main() -> None:
        from reward.agent_runner import AgentRuns

        runs = None
        gateway = Gateway(host="127.0.0.1", port=0)
        await gateway.start()
        try:
            played.session = await gateway.open(SESSION_ID)
            if start_agent is None:
                runs = AgentRuns(fn, timeout_s)
                runs.start("episode", row, played.session)
            else:
                t = threading.Thread(target=start_agent, args=(played.session,), daemon=True, name="scripted-agent")
                t.start()
                threads.append(t)
            await drive(gateway, SESSION_ID, script, played, timeout_s)
            # the agent's own close lands before the runner's: give the runner's (a no-op then) time to arrive
            deadline = asyncio.get_running_loop().time() + 15.0
            def busy() -> bool:
                return any(t.is_alive() for t in threads) or (runs is not None and bool(runs.running))

            while busy() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
            played.agent_done = not busy()
            played.counters = await gateway.take_counters()
            await gateway.close(SESSION_ID)
        finally:
            await _stop(gateway)

    asyncio.run(main())
    return played


def call_reply(name: str, **arguments: Any) -> Reply:
    """A sampled turn that is one tool call ``name(**arguments)`` and no text."""
    return Reply(content="", tool_calls=[{"name": name, "arguments": dict(arguments)}], prompt_tokens=10,
                 completion_tokens=5)


def text_reply(text: str) -> Reply:
    """A sampled turn that is only text (the agent's final answer)."""
    return Reply(content=text, prompt_tokens=10, completion_tokens=len(text.split()) or 1)


__all__ = ["Played", "ScriptEntry", "call_reply", "drive", "play", "text_reply"]
