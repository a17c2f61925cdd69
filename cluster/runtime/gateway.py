"""The session gateway: an OpenAI-compatible HTTP endpoint per episode in front of the rollout engines
(``env.agent``; docs/agents.md "Agent programs").

One async Ray actor (``Gateway``) runs a uvicorn server with a FastAPI app on its own event loop, on the driver's
node (``env.gateway.host``, 127.0.0.1 by default). Why an actor and not Ray Serve: a run has one gateway whose
state is the sessions under way, which the driver reads turn by turn; Serve's replicas, router and HTTP proxy
would add a second process hop and a controller to a job that needs neither, and Serve's autoscaling has nothing
to scale (the work is on the engines, which scale as they do today).

Every episode gets a session: ``open`` returns its base URL ``http://host:port/s/<session id>/v1`` and its key
(the ``Authorization: Bearer`` token, compared with ``hmac.compare_digest``). Routes under the base URL:
``POST /chat/completions`` (stream or not), ``POST /responses`` (the Responses API), ``GET /models``; and
``POST /s/<id>/close`` (an agent program, or its runner, ends the episode with a reward).

A separate program (``env.gateway.harness``) takes its episodes itself: the driver opens each episode's session
with its row (``open(id, row)``), which then waits for a program; ``POST /sessions`` with the run's key
(``run_key``, which the driver gives the program it starts) claims the oldest waiting one (``{"uid": ...}``: one of
that row's) and answers its row, base URL and key; nothing waiting within ``wait_s`` is 204, a stopping gateway 410.

The gateway samples nothing itself: the driver stays in charge. An HTTP request becomes an event in its session's
inbox; the driver's ``exchange(session, answer)`` answers the request under way (with the sampled turn parsed
into a ``Reply``, or a ``ProtocolError``) and waits for the session's next event: the agent's next request, the
session's close, or the deadline. So a request is a turn the agent loop schedules like any other (engine
affinity, continuous batching, no turn open at a weight sync).

Errors (OpenAI's error body): 400 a malformed request (naming the field), 401 a missing or wrong key, 404 an
unknown session, 409 a closed session or a second request while one is under way in the same session, 503 when
the driver fails the request (``engine_lost``: the engine sampling its turn died and is being replaced).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from reward.episode_status import ERROR, OK
from rollout.openai_protocol import (
    ProtocolError,
    Reply,
    chat_completion,
    chat_completion_chunks,
    models_list,
    parse_chat_request,
    sse,
)
from rollout.openai_responses import parse_responses_request, response_events, response_object


@dataclass
class _Session:
    """One episode's session: its key, the request under way (a future the driver answers) and its inbox."""

    key: str
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    pending: asyncio.Future | None = None
    closed: bool = False
    requests: int = 0


def _error(err: ProtocolError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


class Gateway:
    """The gateway actor (module docstring). Wrap with ``ray.remote`` (async actor).

    Args:
        host: address to bind (``env.gateway.host``).
        port: TCP port, 0 = a free one (``env.gateway.port``).
        model_name: the model id served (``env.gateway.model_name``).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, model_name: str = "policy"):
        self.host, self.port, self.model_name = host, port, model_name
        self.sessions: dict[str, _Session] = {}
        self.counters: dict[str, float] = {}
        self.server = None
        self.task: asyncio.Task | None = None
        self.run_key = secrets.token_urlsafe(24)  # POST /sessions (env.gateway.harness)
        self.waiting: list[tuple[str, dict]] = []  # sessions opened with a row, not yet claimed: (id, row)
        self.offered: asyncio.Event | None = None  # set when a session starts waiting (claims wake on it)
        self.stopping = False

    # -- the driver's calls -----------------------------------------------------------------------------------
    async def start(self) -> str:
        """Serve on ``host:port``; returns the server's root URL (``http://host:port``)."""
        import uvicorn

        # keep-alive well past the clients' (httpx: 5 s), so a client never sends on a connection the server is
        # closing (an APIConnectionError under load)
        config = uvicorn.Config(self._app(), host=self.host, port=self.port, log_level="warning", access_log=False,
                                timeout_keep_alive=120, backlog=4096)
        self.server = uvicorn.Server(config)
        self.task = task = asyncio.get_running_loop().create_task(self.server.serve())
        while not self.server.started:
            if task.done():
                raise RuntimeError(f"the gateway did not start on {self.host}:{self.port}: {task.exception()!r}")
            await asyncio.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://{self.host}:{self.port}"

    async def open(self, session_id: str, row: dict | None = None) -> dict[str, str]:
        """A new session: ``{"base_url": .../s/<id>/v1, "api_key": key, "session_id": id}``. With ``row`` (a
        JSON-able dict with ``uid``) it waits for a separate program to claim it (``POST /sessions``).

        Raises:
            ValueError: ``session_id`` is already open.
        """
        if session_id in self.sessions:
            raise ValueError(f"gateway session {session_id!r} is already open")
        key = secrets.token_urlsafe(24)
        self.sessions[session_id] = _Session(key)
        if row is not None:
            self.waiting.append((session_id, row))
            self._offered().set()
        return {"base_url": f"http://{self.host}:{self.port}/s/{session_id}/v1", "api_key": key,
                "session_id": session_id}

    async def open_many(self, requests: list[tuple[str, dict | None]]) -> list[dict[str, str]]:
        """``open`` of each ``(session_id, row)``, in order, in one call (one actor round trip per round)."""
        return [await self.open(sid, row) for sid, row in requests]

    async def harness_env(self) -> dict[str, str]:
        """What a separate program needs to take episodes: ``GSPO_GATEWAY_URL`` (the root URL) and
        ``GSPO_GATEWAY_KEY`` (the run key ``POST /sessions`` asks for)."""
        return {"GSPO_GATEWAY_URL": f"http://{self.host}:{self.port}", "GSPO_GATEWAY_KEY": self.run_key}

    async def exchange(self, session_id: str, answer: Any = None, timeout_s: float = 300.0) -> dict[str, Any]:
        """Answer the session's request under way (``answer``: a ``Reply``, a ``ProtocolError``, or None when
        none is under way) and wait for its next event.

        Returns:
            ``{"kind": "request", "request": <ChatRequest fields>, "request_id": str}``, ``{"kind": "end",
            "reward": ..., "status": ..., "error": ...}`` (the session was closed), or ``{"kind": "timeout"}``
            (nothing within ``timeout_s`` seconds: the session is closed).

        Raises:
            KeyError: an unknown session.
        """
        s = self.sessions[session_id]
        if answer is not None and s.pending is not None and not s.pending.done():
            s.pending.set_result(answer)
        try:
            return await asyncio.wait_for(s.inbox.get(), timeout_s)
        except asyncio.TimeoutError:
            self._close(s, {"kind": "timeout"})
            return {"kind": "timeout"}

    async def close(self, session_id: str) -> None:
        """End a session from the driver (its episode is over): a request under way gets 409, later ones too."""
        if (s := self.sessions.get(session_id)) is not None:
            self._close(s, {"kind": "end", "reward": None, "status": "closed", "error": "closed by the trainer"})
            self.sessions.pop(session_id, None)

    async def close_many(self, session_ids: list[str]) -> None:
        """``close`` of each session, in one call (a round's episodes at their end)."""
        for session_id in session_ids:
            await self.close(session_id)

    async def take_counters(self) -> dict[str, float]:
        """The gateway's counters since the last call (``gateway/*``: requests, errors by status, streams)."""
        out, self.counters = self.counters, {}
        return out

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving: open requests are answered 409 (their sessions closed), then the server ends."""
        self.stopping = True
        self._offered().set()  # claims under way answer 410
        for s in self.sessions.values():
            self._close(s, {"kind": "end", "reward": None, "status": "closed", "error": "the gateway stopped"})
        if self.server is not None:
            self.server.should_exit = True
            await asyncio.wait([self.task], timeout=timeout_s)

    # -- the HTTP side ----------------------------------------------------------------------------------------
    def _count(self, key: str, n: float = 1.0) -> None:
        self.counters[key] = self.counters.get(key, 0.0) + n

    def _offered(self) -> asyncio.Event:
        if self.offered is None:
            self.offered = asyncio.Event()
        return self.offered

    def _take_waiting(self, uid: str | None) -> dict[str, Any] | None:
        """The oldest waiting session (of row ``uid`` when given) still open, taken off the list; None if none.
        Sessions that ended while waiting (their episode's deadline) are dropped."""
        self.waiting = [(sid, row) for sid, row in self.waiting
                        if (s := self.sessions.get(sid)) is not None and not s.closed]
        for k, (sid, row) in enumerate(self.waiting):
            if uid is None or row.get("uid") == uid:
                del self.waiting[k]
                s = self.sessions[sid]
                return {"session_id": sid, "base_url": f"http://{self.host}:{self.port}/s/{sid}/v1",
                        "api_key": s.key, "row": row}
        return None

    async def _claim(self, authorization: str | None, body: Any):
        """``POST /sessions``: a waiting episode for a separate program (module docstring)."""
        token = (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(token.encode(), self.run_key.encode()):
            return _error(ProtocolError(401, "missing or wrong run key (GSPO_GATEWAY_KEY)",
                                        type="authentication_error", code="invalid_api_key"))
        body = {} if body is None else body
        uid, wait_s = (body.get("uid"), body.get("wait_s", 30.0)) if isinstance(body, dict) else (None, None)
        if not isinstance(body, dict) or not isinstance(wait_s, (int, float)) or not 0 <= wait_s <= 300:
            return _error(ProtocolError(400, "the body must be {\"uid\": str (optional), \"wait_s\": seconds "
                                        "0-300 (optional)}", param="wait_s" if isinstance(body, dict) else "body"))
        deadline = asyncio.get_running_loop().time() + float(wait_s)
        while not self.stopping:
            if (claimed := self._take_waiting(None if uid is None else str(uid))) is not None:
                self._count("gateway/claims")
                return JSONResponse(claimed)
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return Response(status_code=204)
            event = self._offered()
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), left)
            except asyncio.TimeoutError:
                pass
        return _error(ProtocolError(410, "the gateway is stopping: no more episodes", code="gateway_stopped"))

    def _close(self, s: _Session, event: dict[str, Any]) -> None:
        if s.closed:
            return
        s.closed = True
        if s.pending is not None and not s.pending.done():
            s.pending.set_result(ProtocolError(409, "the episode of this session ended", code="session_closed"))
        s.inbox.put_nowait(event)

    def _session(self, session_id: str, authorization: str | None) -> _Session:
        s = self.sessions.get(session_id)
        if s is None:
            raise ProtocolError(404, f"unknown session {session_id!r}", code="session_not_found")
        token = (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(token.encode(), s.key.encode()):
            raise ProtocolError(401, "missing or wrong API key for this session", type="authentication_error",
                                code="invalid_api_key")
        if s.closed:
            raise ProtocolError(409, "the episode of this session ended", code="session_closed")
        return s

    async def _turn(self, session_id: str, authorization: str | None, body: Any, api: str):
        """One request: checked, put in the session's inbox, answered when the driver gives its turn."""
        self._count("gateway/requests")
        try:
            s = self._session(session_id, authorization)
            if s.pending is not None and not s.pending.done():
                raise ProtocolError(409, "a request of this session is already under way (one at a time)",
                                    code="concurrent_request")
            req = parse_chat_request(body) if api == "chat" else parse_responses_request(body)
        except ProtocolError as err:
            self._count(f"gateway/errors/{err.status}")
            return _error(err)
        s.requests += 1
        request_id = f"{session_id}-{s.requests}"
        s.pending = asyncio.get_running_loop().create_future()
        fields = {f.name: getattr(req, f.name) for f in dataclasses.fields(req)}  # asdict's deep copy: ~1 ms
        s.inbox.put_nowait({"kind": "request", "request": fields, "request_id": request_id})
        answer = await s.pending
        if isinstance(answer, ProtocolError):
            self._count(f"gateway/errors/{answer.status}")
            return _error(answer)
        kw = dict(request_id=request_id, model=self.model_name, created=int(time.time()))
        if not req.stream:
            return JSONResponse(chat_completion(answer, **kw) if api == "chat"
                                else response_object(answer, request=req, **kw))
        self._count("gateway/streams")
        events = (chat_completion_chunks(answer, include_usage=req.include_usage, **kw) if api == "chat"
                  else response_events(answer, request=req, **kw))
        return StreamingResponse(iter([sse(events, api=api)]), media_type="text/event-stream")

    async def _close_route(self, session_id: str, authorization: str | None, body: Any):
        try:
            s = self._session(session_id, authorization)
        except ProtocolError as err:
            return _error(err)
        try:
            event = close_event(body)
        except ProtocolError as err:  # the session stays open: the program may close it again, correctly
            return _error(err)
        self._close(s, event)
        return JSONResponse({"session_id": session_id, "closed": True})

    def _app(self) -> FastAPI:
        """The app: FastAPI's, its routes plain Starlette endpoints (``add_route``) that read the path, the
        ``Authorization`` header and the JSON body themselves; FastAPI's parameter injection cost about 0.35 ms of
        the gateway's CPU per request here (a rollout has hundreds)."""
        app = FastAPI(title="gspo-rl session gateway", docs_url=None, redoc_url=None, openapi_url=None)

        async def _body(request: Request) -> Any:
            try:
                return json.loads(await request.body())
            except ValueError:  # UnicodeDecodeError and json.JSONDecodeError included
                return None

        def _args(request: Request) -> tuple[str, str | None]:
            return request.path_params.get("session_id", ""), request.headers.get("authorization")

        async def chat(request: Request):
            return await self._turn(*_args(request), await _body(request), "chat")

        async def responses(request: Request):
            return await self._turn(*_args(request), await _body(request), "responses")

        async def models(request: Request):
            try:
                self._session(*_args(request))
            except ProtocolError as err:
                return _error(err)
            return JSONResponse(models_list(self.model_name))

        async def claim(request: Request):
            return await self._claim(_args(request)[1], await _body(request))

        async def close(request: Request):
            return await self._close_route(*_args(request), await _body(request))

        for path, endpoint, method in (("/s/{session_id}/v1/chat/completions", chat, "POST"),
                                       ("/s/{session_id}/v1/responses", responses, "POST"),
                                       ("/s/{session_id}/v1/models", models, "GET"),
                                       ("/sessions", claim, "POST"),
                                       ("/s/{session_id}/close", close, "POST")):
            app.add_route(path, endpoint, methods=[method])
        return app


def close_event(body: Any) -> dict[str, Any]:
    """The end event of a close request's body ``{"reward": None | number | {name: number}, "status": "ok" |
    "error", "error": str | None, "infra": None | cause}`` (every key optional; status ``ok`` by default).
    ``infra``, with status ``error``: the failure was a service's, not the model's (a ``reward.infra.Cause``
    value; the agent raised ``reward.infra.InfraFailure``): the episode is scored by ``reward.on_infra_failure``.

    Raises:
        ProtocolError: 400 naming the field: a body that is not an object, a reward that is not None, a finite
            number or a non-empty dict of them (``reward.agent_runner.reward_value``), another status, an
            ``infra`` that is not a known cause or comes with status ``ok``.
    """
    from reward.infra import CAUSES

    from reward.agent_runner import reward_value

    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise ProtocolError(400, f"the body must be a JSON object, got {body!r}"[:300], param="body")
    status = body.get("status", OK)
    if status not in (OK, ERROR):
        raise ProtocolError(400, f"status must be 'ok' or 'error', got {status!r}"[:300], param="status")
    try:
        reward = reward_value(body.get("reward"))
    except ValueError as err:
        raise ProtocolError(400, str(err), param="reward") from None
    infra = body.get("infra")
    if infra is not None and (infra not in CAUSES or status != ERROR):
        raise ProtocolError(400, f"infra must be one of {', '.join(CAUSES)} with status 'error', got {infra!r} with "
                            f"status {status!r}"[:300], param="infra")
    error = body.get("error")
    event = {"kind": "end", "reward": reward, "status": status, "error": None if error is None else str(error)[:500]}
    return {**event, "infra": infra} if infra is not None else event


def start_gateway(host: str, port: int, model_name: str):
    """The gateway actor on this (the driver's) node, serving: ``(handle, root URL)``.

    Raises:
        RuntimeError: the server did not start (its port taken, ...).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    actor = ray.remote(Gateway).options(
        num_cpus=0, max_concurrency=4096, name=None,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote(host, port, model_name)
    return actor, ray.get(actor.start.remote(), timeout=120)


__all__ = ["Gateway", "Reply", "start_gateway"]
