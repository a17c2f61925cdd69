"""OpenEnv environments (``env.openenv``) through the project's environment interface.

An OpenEnv environment is a server: ``reset`` and ``step`` over a WebSocket session (``/ws``; one environment
instance per session on the server), its action and observation described by pydantic models (``/schema``).
Here:

- ``OpenEnvBackend`` (one per env worker) owns the server: it starts it (``env.openenv.app``: a local subprocess
  on 127.0.0.1, ``reward.openenv_server``) or uses a running one (``env.openenv.url``), reads its action schema
  once, and runs every session's I/O on one event loop of its own (openenv's ``GenericEnvClient``, the client TRL
  uses too). A started server found dead when an episode starts is started again (``ensure_running``).
- ``OpenEnvEnvironment`` is the ``reward.environment.Environment`` of one episode: one session, opened and reset
  (with the episode's seed, and the row's ``meta`` keys in ``env.openenv.reset_meta_keys``) when the episode
  starts, closed when it ends. The model gets one tool (``env.openenv.tool_name``) whose arguments are the
  action's fields; a call is one ``step``. The episode is done when the server says so or when a turn has no
  tool call; its reward is the sum (or the last) of the steps' rewards (no per-turn rewards: they would be
  counted twice).

**Failures.** What the model got wrong goes back to it as a tool error (``reward.environment.run_tool_call``,
kind ``raised``): an action the server refuses as invalid (``VALIDATION_ERROR``) or whose step raised on the server
(``EXECUTION_ERROR``), a step after the server said done. What the server got wrong ends the episode through the
env worker's failure paths as the service's failure, not the model's (``OpenEnvServerError``, a
``reward.infra.InfraFailure``: counted in ``reward/infra_failed/<cause>``, scored by ``reward.on_infra_failure``,
invalid by default): a session that cannot be opened or reset (``service_error`` when the server refused it,
e.g. at capacity), a connection lost (``server_died``), an answer slower than ``CALL_TIMEOUT_SHARE`` x
``env.tool_timeout_s`` (``service_timeout``, status ``timeout``: the call is cancelled, no thread is left behind),
any other server error (``service_error``); a dead server that will not start again (``server_died``). A server that does not start, or does not give its schema, raises ``OpenEnvStartError`` (the driver checks
it before any service starts: ``probe``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import re
import threading
import types
from typing import Any, Callable, Literal, Optional, Union

from reward.config import EnvConfig
from reward.environment import Environment, StepResult
from reward.infra import Cause, InfraFailure
from reward.openenv_server import OpenEnvServer, OpenEnvStartError, http_get

CALL_TIMEOUT_SHARE = 0.9  # a server call's own timeout, as a share of env.tool_timeout_s (the worker's backstop)
TOOL_ERRORS = ("VALIDATION_ERROR", "EXECUTION_ERROR")  # server error codes that go back to the model
_JSON_TYPES = {"integer": int, "number": float, "string": str, "boolean": bool, "array": list, "object": dict}


class OpenEnvReplyError(RuntimeError):
    """The server answered a session message with an error (``code``: openenv's ``WSErrorCode``)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{message} (code: {code})")
        self.code = code


class OpenEnvServerError(InfraFailure):
    """The server failed the episode (connection lost, an error that is not the model's, an answer too slow): the
    service's failure (``reward.infra``), its cause from what failed (``server_failure``)."""


def server_failure(err: BaseException, name: str, what: str = "") -> OpenEnvServerError:
    """The ``OpenEnvServerError`` of a server call that raised ``err``: cause ``service_timeout`` for a call past its
    limit (``TimeoutError``), ``service_error`` for an error the server answered (``OpenEnvReplyError``: a session
    refused at capacity, ...), ``server_died`` for anything else (a connection refused, reset or closed).
    ``name`` names the server (``OpenEnvBackend.name``), ``what`` the call."""
    if isinstance(err, OpenEnvServerError):
        return err
    cause = (Cause.SERVICE_TIMEOUT if isinstance(err, TimeoutError) else
             Cause.SERVICE_ERROR if isinstance(err, OpenEnvReplyError) else Cause.SERVER_DIED)
    return OpenEnvServerError(cause, f"{name}: {what}{type(err).__name__}: {err}")


def _client_class():
    """openenv's ``GenericEnvClient``, its error replies raised as ``OpenEnvReplyError`` with their details (the
    library's own ``RuntimeError`` drops a validation error's field list, which the model needs to see)."""
    from openenv.core.generic_client import GenericEnvClient
    from websockets.exceptions import ConnectionClosed

    class SessionClient(GenericEnvClient):
        async def _send_and_receive(self, message: dict) -> dict:
            try:
                await self._send(message)
            except ConnectionClosed:  # the server may have said why before closing (a session refused at capacity)
                try:
                    response = json.loads(await asyncio.wait_for(self._ws.recv(), timeout=1.0))
                except Exception:  # noqa: BLE001 - it said nothing: the closed connection is the error
                    response = None
                if not isinstance(response, dict) or response.get("type") != "error":
                    raise
            else:
                response = await self._receive()
            if response.get("type") == "error":
                data = response.get("data") or {}
                text = str(data.get("message", "unknown error"))
                if data.get("errors"):
                    text += ": " + "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}"
                                             for e in data["errors"] if isinstance(e, dict))
                raise OpenEnvReplyError(str(data.get("code", "UNKNOWN")), text)
            return response

    return SessionClient


class OpenEnvSession:
    """One WebSocket session on the server (one episode), its calls run on the backend's event loop.

    Args:
        client: an openenv ``EnvClient`` for the server (not yet connected).
        loop: the event loop its coroutines run on (another thread's).
        timeout_s: each call's limit, seconds: past it the call is cancelled and ``TimeoutError`` raised.
    """

    def __init__(self, client: Any, loop: asyncio.AbstractEventLoop, timeout_s: float):
        self.client, self.loop, self.timeout_s = client, loop, timeout_s

    def _run(self, coro: Any, what: str) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"the OpenEnv server did not answer {what} within {self.timeout_s:g} s") from None

    def reset(self, **kwargs: Any) -> Any:
        """Connect (on first use) and reset: openenv's ``StepResult`` (``observation`` dict, ``reward``, ``done``).

        Raises:
            OpenEnvReplyError: the server answered with an error; ConnectionError / OSError: no connection;
            TimeoutError: no answer in time.
        """
        return self._run(self.client.reset(**kwargs), "reset")

    def step(self, action: dict) -> Any:
        """One action: openenv's ``StepResult``. Raises as ``reset``."""
        return self._run(self.client.step(action), "step")

    def close(self) -> None:
        """Close the session (the server ends its environment instance); errors are ignored (best effort)."""
        try:
            self._run(self.client.close(), "close")
        except Exception:  # noqa: BLE001 - a dead or slow server has nothing more to close
            pass


class OpenEnvBackend:
    """An env worker's OpenEnv server (started here, or a running one) and what its episodes share.

    Args:
        cfg: the ``env`` section with ``env.openenv`` enabled.

    Attributes:
        server: the local ``OpenEnvServer`` (``env.openenv.app``), or None for ``env.openenv.url``.
        action_schema: the action's JSON schema (the server's ``/schema``).
        tool: the tool function the model calls (``tool_function``), shared by the episodes (bound to each).
        call_timeout_s: each server call's limit (``CALL_TIMEOUT_SHARE`` x ``env.tool_timeout_s``).

    Raises (at construction):
        OpenEnvStartError: the server does not start, or does not give an action schema in time; the message
            names the app or URL.
    """

    def __init__(self, cfg: EnvConfig):
        if not cfg.openenv.enabled:
            raise ValueError("env.openenv is off (app and url unset): no OpenEnv server to use")
        self.cfg = cfg.openenv
        self.call_timeout_s = CALL_TIMEOUT_SHARE * cfg.tool_timeout_s
        self.server = OpenEnvServer(self.cfg.app, self.cfg.start_timeout_s) if self.cfg.app is not None else None
        self._url = self.server.start() if self.server is not None else str(self.cfg.url).rstrip("/")
        self._lock = threading.Lock()
        self._client_cls = _client_class()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="openenv-sessions")
        self._thread.start()
        try:
            self.action_schema = fetch_action_schema(self._url, self.cfg.start_timeout_s, self.name)
            self.tool = tool_function(self.cfg.tool_name, self.cfg.tool_description, self.action_schema)
        except Exception:
            self.close()
            raise

    @property
    def name(self) -> str:
        """The config key and value that name the server, for messages."""
        return f"env.openenv.app={self.cfg.app!r}" if self.cfg.app is not None else f"env.openenv.url={self.cfg.url!r}"

    @property
    def url(self) -> str:
        """The server's base URL (a started server's changes when it is started again)."""
        return self._url

    def ensure_running(self) -> int:
        """Start the local server again when its process has died; 1 when it was started again, else 0 (always 0
        for ``env.openenv.url``).

        Raises:
            OpenEnvStartError: it would not start again.
        """
        if self.server is None:
            return 0
        with self._lock:
            if self.server.running():
                return 0
            self._url = self.server.start()
            return 1

    def session(self) -> OpenEnvSession:
        """A new, unconnected session on the server (connected by its first ``reset``)."""
        timeout = self.call_timeout_s
        client = self._client_cls(base_url=self._url, connect_timeout_s=timeout, message_timeout_s=timeout)
        return OpenEnvSession(client, self._loop, timeout)

    def environment(self, row: dict, seed: int) -> "OpenEnvEnvironment":
        """The episode's environment: a session opened and reset (``OpenEnvEnvironment``)."""
        return OpenEnvEnvironment(row, seed, self)

    def close(self) -> None:
        """Stop the local server (if any) and the sessions' event loop. Idempotent."""
        if self.server is not None:
            self.server.stop()
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)


def fetch_action_schema(url: str, timeout_s: float, name: str) -> dict:
    """The action's JSON schema from the server's ``GET /schema`` (``{"action": {...}, ...}``).

    Raises:
        OpenEnvStartError: no answer within ``timeout_s``, not status 200, or not an OpenEnv schema; the message
            names the server (``name``).
    """
    http_url = re.sub(r"^ws", "http", url)
    try:
        status, body = http_get(f"{http_url}/schema", timeout_s)
        schema = json.loads(body) if status == 200 else None
    except (OSError, ValueError) as err:
        raise OpenEnvStartError(f"{name}: no action schema from {http_url}/schema: {type(err).__name__}: {err}") from None
    if not isinstance(schema, dict) or not isinstance(schema.get("action"), dict):
        raise OpenEnvStartError(f"{name}: {http_url}/schema answered status {status} without an OpenEnv schema "
                                f"({body[:200]!r})")
    return schema["action"]


def _python_type(prop: dict) -> Any:
    """A type hint for one JSON-schema property that ``transformers.utils.get_json_schema`` turns back into it."""
    if "enum" in prop and prop["enum"]:
        return Literal[tuple(prop["enum"])]
    options = prop.get("anyOf") or prop.get("oneOf")
    if options:
        hints = [_python_type(o) for o in options if o.get("type") != "null"]
        nullable = any(o.get("type") == "null" for o in options)
        hint = hints[0] if len(hints) == 1 else (Union[tuple(hints)] if hints else Any)
        return Optional[hint] if nullable else hint
    return _JSON_TYPES.get(prop.get("type"), Any)


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def tool_function(name: str, description: str | None, action_schema: dict) -> Callable:
    """The tool the model calls, ``name(self, **fields)``, typed and documented from the action's JSON schema (its
    fields but ``metadata``; required ones without a default) so that ``reward.environment.tool_schema`` describes
    it; bound to an ``OpenEnvEnvironment`` it sends the arguments given as the action (``OpenEnvEnvironment.act``).

    Raises:
        OpenEnvStartError: the action has no field the model could fill.
    """
    props = {k: v for k, v in (action_schema.get("properties") or {}).items() if k != "metadata"}
    if not props:
        raise OpenEnvStartError(f"the action schema has no fields besides metadata: {action_schema!r}"[:500])
    required = set(action_schema.get("required") or ())
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {}
    lines = []
    for field, prop in props.items():
        hint = _python_type(prop if isinstance(prop, dict) else {})
        default = inspect.Parameter.empty if field in required else None
        params.append(inspect.Parameter(field, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=hint))
        annotations[field] = hint
        lines.append(f"    {field}: {_one_line(prop.get('description') or prop.get('title') or field)}")
    summary = _one_line(description or action_schema.get("description") or f"Act in the environment ({name}).")

    def act(self: "OpenEnvEnvironment", **arguments: Any) -> str:
        return self.act(arguments)

    act.__name__ = act.__qualname__ = name
    act.__doc__ = f"{summary}\n\nArgs:\n" + "\n".join(lines) + "\n"
    act.__annotations__ = {**annotations, "return": str}
    act.__signature__ = inspect.Signature(params, return_annotation=str)
    return act


def render(observation: Any, key: str | None) -> str:
    """An observation as the text the model sees: field ``key``, else the only field's value, else JSON.

    Raises:
        ValueError: the observation is not a dict, or has no field ``key`` (the message lists its fields).
    """
    if not isinstance(observation, dict):
        raise ValueError(f"an observation must be a JSON object, got {observation!r}"[:500])
    if key is not None:
        if key not in observation:
            raise ValueError(f"env.openenv.observation_key={key!r} is not a field of the observation "
                             f"(its fields: {sorted(observation)})")
        value = observation[key]
    elif len(observation) == 1:
        value = next(iter(observation.values()))
    else:
        value = observation
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


class OpenEnvEnvironment(Environment):
    """One episode on an OpenEnv server: a session, opened and reset at construction, closed by ``close``.

    Args:
        row: the data row.
        seed: the episode's seed, sent to ``reset`` (the G episodes of a group share it).
        backend: the worker's ``OpenEnvBackend``.

    Attributes:
        rewards: the rewards the server gave (reset's, if any, and each step's), in order.
        done: the server said the episode is over.
        first: the reset's observation (a dict).

    Raises (at construction):
        OpenEnvServerError: the session could not be opened or reset (the session is closed first): the env
            worker ends the episode as the service's failure (status ``error``, or ``timeout`` for cause
            ``service_timeout``; ``server_failure`` gives the cause).
    """

    def __init__(self, row: dict, seed: int, backend: OpenEnvBackend):
        super().__init__(row, seed)
        self.backend = backend
        self.rewards: list[float] = []
        self.done = False
        self._failure: BaseException | None = None
        meta = self.row.get("meta") or {}
        kwargs = {"seed": self.seed, **{k: meta[k] for k in backend.cfg.reset_meta_keys if k in meta}}
        self.session = backend.session()
        try:
            first = self.session.reset(**kwargs)
        except Exception as err:  # noqa: BLE001 - every failure to open or reset is the server's
            self.session.close()
            raise server_failure(err, backend.name, "the session could not be opened and reset: ") from None
        except BaseException:
            self.session.close()
            raise
        self.first = first.observation
        self._note(first)

    def _note(self, result: Any) -> None:
        if result.reward is not None:
            self.rewards.append(float(result.reward))
        self.done = self.done or bool(result.done)

    def initial_messages(self) -> list[dict]:
        """One user message: the reset observation, the row's prompt, or both (``env.openenv.prompt``).

        Raises:
            ValueError: ``env.openenv.observation_key`` is not a field of the observation.
        """
        how = self.backend.cfg.prompt
        parts = []
        if how in ("row", "row_and_observation"):
            parts.append(str(self.row["prompt"]))
        if how in ("observation", "row_and_observation"):
            parts.append(render(self.first, self.backend.cfg.observation_key))
        return [{"role": "user", "content": "\n\n".join(parts)}]

    def tools(self) -> list[Callable]:
        """The one tool, bound to this episode."""
        return [types.MethodType(self.backend.tool, self)]

    def act(self, arguments: dict) -> str:
        """One step with the action ``arguments`` (the tool's body); the observation as text.

        Raises:
            ValueError: the episode is already over, or the server refused the action or its step raised there
                (back to the model as a tool error).
            OpenEnvServerError: anything else (noted: ``step`` then ends the episode).
        """
        if self.done:
            raise ValueError("the episode is over: the environment takes no more actions")
        if self._failure is not None:
            raise OpenEnvServerError("the session already failed")
        try:
            result = self.session.step(arguments)
        except OpenEnvReplyError as err:
            if err.code in TOOL_ERRORS:
                raise ValueError(str(err)) from None
            self._failure = err
            raise server_failure(err, self.backend.name) from None
        except Exception as err:  # noqa: BLE001 - a lost connection or a timeout: the episode ends in step()
            self._failure = err
            raise server_failure(err, self.backend.name) from None
        self._note(result)
        return render(result.observation, self.backend.cfg.observation_key)

    def step(self, assistant_text: str, tool_calls: list[dict]) -> StepResult:
        """The turn's calls as steps; done when the server said so or the turn has no call.

        Raises:
            OpenEnvServerError: the server failed a step: its answer came later than the call's limit (cause
                ``service_timeout``, status ``timeout``), the connection was lost (``server_died``), another error
                (``service_error``); the episode ends as the service's failure (``reward.on_infra_failure``).
        """
        messages, errors = self.call_tools(tool_calls)
        if self._failure is not None:
            raise server_failure(self._failure, self.backend.name, "the session failed: ")
        return StepResult(messages, done=self.done or not tool_calls, tool_errors=errors)

    def reward(self) -> float:
        """The steps' rewards summed, or the last one (``env.openenv.reward``); 0.0 when the server gave none."""
        if not self.rewards:
            return 0.0
        return float(sum(self.rewards)) if self.backend.cfg.reward == "sum" else self.rewards[-1]

    def close(self) -> None:
        """Close the session (best effort: a dead server has nothing to close)."""
        self.session.close()


def probe(cfg: EnvConfig) -> str:
    """The start-up check of ``env.openenv`` (on the driver, before any service starts): start the server (or
    reach the URL), read its schema, open one session, reset it with seed 0 (and no row), render its observation,
    close it, stop the server.

    Returns:
        A line for the log: the server, its tool's schema.

    Raises:
        OpenEnvStartError: any of it failed; the message names the server and what failed.
    """
    from reward.environment import tool_schema

    backend = OpenEnvBackend(cfg)
    try:
        session = backend.session()
        try:
            first = session.reset(seed=0)
            render(first.observation, backend.cfg.observation_key)
        except Exception as err:  # noqa: BLE001 - every failure here stops the run, named
            raise OpenEnvStartError(f"{backend.name}: a session on {backend.url} could not be opened and reset: "
                                    f"{type(err).__name__}: {err}") from None
        finally:
            session.close()
        try:
            schema = tool_schema(backend.tool)
        except ValueError as err:
            raise OpenEnvStartError(f"{backend.name}: its action gives no tool schema: {err}") from None
        return f"{backend.name}: answers at {backend.url}; the model's tool: {json.dumps(schema['function'])}"
    finally:
        backend.close()
