"""Agent programs run as episodes (``env.agent``): the user's function, called once per episode in an env worker
with the row and an OpenAI client pointed at the episode's gateway session (docs/agents.md "Agent programs").

``AgentRuns.start`` runs ``fn(row, client)`` in a thread of its own (threads are reused across episodes) (a coroutine function gets an
``openai.AsyncOpenAI`` client and its own event loop in that thread), so many episodes run at once on one
worker. When the function returns, raises or its thread is abandoned, the runner closes the session over the
gateway's REST route (``POST /s/<id>/close`` with the session key) with the reward it returned (a float, named
components, or None: the row's verifier scores the last assistant message) or the error. The run never waits on
an agent here: the driver's deadline (``env.episode_timeout_s``) ends an episode whose agent hangs, and its
session then refuses the agent's next request (409), which ends a well-behaved client.

A program that is not Python (a CLI harness) is run the same way by a small function that starts it with
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` set from ``session_env`` and closes the session with its reward
(``close_session``), as ``reward/envs/cli_agent.py`` shows. A program that takes its episodes itself
(``env.gateway.harness``, started once by the driver) asks for each with ``claim_session`` and closes it with
``close_session``, as ``reward/envs/calc_harness.py`` does.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import queue
import threading
from typing import Any, Callable

from reward.environment import resolve_user_object
from reward.episode_status import ERROR, OK
from reward.infra import cause_of


def load_agent(name: str, key: str = "env.agent") -> Callable[..., Any]:
    """The agent function ``"module.path:function"`` names.

    Raises:
        ValueError: it cannot be imported (as ``reward.environment.resolve_user_object``) or is not callable.
    """
    fn = resolve_user_object(name, key)
    if not callable(fn) or inspect.isclass(fn):
        raise ValueError(f"{key}={name!r} is {fn!r}, not a function (row, client) -> reward")
    return fn


def reward_value(value: Any) -> float | dict[str, float] | None:
    """What an agent returned, checked: None, a finite number, or a non-empty ``{str: finite number}``.

    Raises:
        ValueError: anything else (the message shows the value).
    """
    def finite(v: Any) -> bool:
        return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)

    if value is None or finite(value):
        return None if value is None else float(value)
    if isinstance(value, dict) and value and all(isinstance(k, str) and finite(v) for k, v in value.items()):
        return {k: float(v) for k, v in value.items()}
    raise ValueError(f"an agent must return None, a finite number or a dict of them by name, got {value!r}"[:300])


def session_env(session: dict[str, str]) -> dict[str, str]:
    """Environment variables that point an OpenAI client (or a CLI harness) at a session."""
    return {"OPENAI_BASE_URL": session["base_url"], "OPENAI_API_KEY": session["api_key"]}


def close_session(session: dict[str, str], reward: Any = None, status: str = OK, error: str | None = None,
                  timeout_s: float = 30.0, http: Any = None, infra: str | None = None) -> bool:
    """End a session over the gateway's REST route with the episode's reward; True when the gateway took it
    (False: the session had ended already, e.g. at its deadline). ``http``: an ``httpx.Client`` to send it with
    (default: a new one). ``infra`` (with status ``error``): a ``reward.infra.Cause`` value, the failure was a
    service's, not the model's."""
    import httpx

    url = session["base_url"].removesuffix("/v1") + "/close"
    body = {"reward": reward, "status": status, "error": error, **({"infra": infra} if infra else {})}
    try:
        r = (http or httpx).post(url, json=body, timeout=timeout_s,
                                 headers={"Authorization": f"Bearer {session['api_key']}"})
    except httpx.HTTPError:
        return False
    return r.status_code == 200


class GatewayStopped(Exception):
    """The gateway has no more episodes to give (the run is ending: 410, or it no longer answers)."""


def claim_session(url: str, run_key: str, uid: str | None = None, wait_s: float = 30.0,
                  http: Any = None) -> dict[str, Any] | None:
    """Take one of the run's episodes for a separate program (``env.gateway.harness``): ``POST <url>/sessions``
    with the run key. Returns ``{"session_id", "base_url", "api_key", "row"}`` (``row``: the task row as a dict),
    or None when no episode waited within ``wait_s`` seconds (ask again).

    Args:
        url: the gateway's root URL (``GSPO_GATEWAY_URL``).
        run_key: the run's key (``GSPO_GATEWAY_KEY``).
        uid: take an episode of this row only (None: the oldest waiting).
        http: an ``httpx.Client`` to send it with (default: a new one).

    Raises:
        GatewayStopped: the run is ending (410), or the gateway does not answer.
        RuntimeError: any other answer (a wrong key: 401; a bad body: 400), with its body.
    """
    import httpx

    body = {"wait_s": wait_s} | ({} if uid is None else {"uid": uid})
    try:
        r = (http or httpx).post(url.rstrip("/") + "/sessions", json=body, timeout=wait_s + 30.0,
                                 headers={"Authorization": f"Bearer {run_key}"})
    except httpx.TransportError as err:
        raise GatewayStopped(f"the gateway at {url} does not answer: {err!r}") from None
    if r.status_code == 204:
        return None
    if r.status_code == 410:
        raise GatewayStopped(r.text[:300])
    if r.status_code != 200:
        raise RuntimeError(f"POST {url}/sessions answered {r.status_code}: {r.text[:300]}")
    return r.json()


class AgentRuns:
    """The agent programs under way on one env worker.

    Args:
        fn: the agent function (``load_agent``).
        timeout_s: ``env.episode_timeout_s``, the clients' HTTP timeout too.
    """

    def __init__(self, fn: Callable[..., Any], timeout_s: float):
        import ssl

        import httpx  # noqa: F401 - imported once here: threads importing a module at once see it half-made
        import openai  # noqa: F401

        self.fn, self.timeout_s = fn, timeout_s
        # One TLS context for every episode's HTTP client: a client that builds its own takes about 20 ms here,
        # which 256 episodes a step would pay one after another. Each episode has a connection pool of its own: one
        # pool shared by 256 threads serialised them on its lock (4.4x the gateway's time per request,
        # bench/gateway.py).
        self.tls = ssl.create_default_context()
        # Threads are reused: an ended agent's thread waits (up to idle_s) for the next episode, since starting one
        # costs about 0.7 ms of this process's CPU here, 256 times a step. A hung agent keeps its thread; new
        # episodes then get new ones.
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.idle = 0  # threads waiting for a job (or reserved by a start about to put one)
        self.idle_s = 60.0
        self.running: set[str] = set()  # episodes whose agent has not returned
        self.lock = threading.Lock()

    def start(self, episode_id: str, row: dict, session: dict[str, str]) -> None:
        """Run the agent on ``row`` against ``session`` (``Gateway.open``'s answer) in a thread of its own (an
        idle one, or a new one); returns at once."""
        with self.lock:
            self.running.add(episode_id)
            spawn = self.idle == 0
            self.idle -= 0 if spawn else 1
        self.jobs.put((episode_id, row, session))
        if spawn:
            threading.Thread(target=self._serve, daemon=True, name="agent").start()

    def _serve(self) -> None:
        """A thread's loop: run jobs until none came for ``idle_s`` seconds."""
        while True:
            try:
                episode_id, row, session = self.jobs.get(timeout=self.idle_s)
            except queue.Empty:
                with self.lock:
                    if self.idle > 0 and self.jobs.empty():
                        self.idle -= 1
                        return
                continue
            threading.current_thread().name = f"agent-{session['session_id']}"
            try:
                self._run(episode_id, row, session)
            finally:
                with self.lock:
                    self.running.discard(episode_id)
                    self.idle += 1

    def _call(self, row: dict, session: dict[str, str], http: Any) -> Any:
        import httpx
        import openai

        kw = dict(base_url=session["base_url"], api_key=session["api_key"], max_retries=0, timeout=self.timeout_s)
        if inspect.iscoroutinefunction(self.fn):
            async def main() -> Any:
                async with httpx.AsyncClient(verify=self.tls, timeout=self.timeout_s) as ahttp:
                    return await self.fn(row, openai.AsyncOpenAI(http_client=ahttp, **kw))
            return asyncio.run(main())
        return self.fn(row, openai.OpenAI(http_client=http, **kw))

    def _run(self, episode_id: str, row: dict, session: dict[str, str]) -> None:
        import httpx

        with httpx.Client(verify=self.tls, timeout=self.timeout_s) as http:
            try:
                reward = reward_value(self._call(row, session, http))
            except Exception as e:  # noqa: BLE001 - the agent's failure is its episode's, reported to the driver
                close_session(session, None, ERROR, f"{type(e).__name__}: {e}"[:500], http=http, infra=cause_of(e))
                return
            close_session(session, reward, OK, http=http)
