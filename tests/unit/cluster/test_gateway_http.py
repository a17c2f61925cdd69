"""The session gateway's HTTP side (cluster/runtime/gateway.py), served in-process by uvicorn on 127.0.0.1 (no
Ray): keys, unknown and closed sessions, one request at a time, malformed requests and close bodies, and a
request answered by the driver's ``exchange``."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from cluster.runtime.gateway import Gateway
from rollout.openai_protocol import ProtocolError, Reply

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "2+2="}]}


@pytest.fixture()
def served():
    """A served gateway and its loop (a thread of its own), torn down after the test."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    gateway = Gateway()

    def call(coro, timeout=30):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    call(gateway.start())
    yield gateway, call
    call(gateway.stop())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _post(session: dict, path: str, body, key: str | None = None) -> httpx.Response:
    base = session["base_url"].removesuffix("/v1") if path == "/close" else session["base_url"]  # /s/<id>/close
    return httpx.post(base + path, json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key if key is not None else session['api_key']}"})


def test_keys_sessions_and_malformed_requests_get_openai_errors(served):
    gateway, call = served
    s = call(gateway.open("a"))
    other = call(gateway.open("b"))
    assert _post(s, "/chat/completions", CHAT, key=other["api_key"]).status_code == 401  # another session's key
    assert httpx.post(s["base_url"] + "/chat/completions", json=CHAT).status_code == 401  # no key
    gone = {**s, "base_url": s["base_url"].replace("/s/a/", "/s/nope/")}
    r = _post(gone, "/chat/completions", CHAT)
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    r = _post(s, "/chat/completions", {**CHAT, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = _post(s, "/chat/completions", {"messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert httpx.get(s["base_url"] + "/models", headers={"Authorization": f"Bearer {s['api_key']}"}).json()[
        "data"][0]["id"] == "policy"


def test_a_request_is_answered_by_the_driver_and_a_closed_session_refuses_more(served):
    gateway, call = served
    s = call(gateway.open("a"))
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(r=_post(s, "/chat/completions", CHAT)))
    t.start()
    event = call(gateway.exchange("a", None, 10))
    assert event["kind"] == "request" and event["request"]["messages"] == CHAT["messages"]
    second = _post(s, "/chat/completions", CHAT)  # one request at a time per session
    assert second.status_code == 409 and second.json()["error"]["code"] == "concurrent_request"
    done = threading.Thread(target=lambda: box.update(next=call(gateway.exchange(
        "a", Reply(content="4", tool_calls=[], finish_reason="stop", prompt_tokens=5, completion_tokens=1), 10))))
    done.start()
    t.join(10)
    assert box["r"].status_code == 200 and box["r"].json()["choices"][0]["message"]["content"] == "4"
    bad = _post(s, "/close", {"reward": "high"})  # a bad reward: 400, the session stays open
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reward"
    assert _post(s, "/close", {"reward": 1.0}).status_code == 200
    done.join(10)
    assert box["next"] == {"kind": "end", "reward": 1.0, "status": "ok", "error": None}
    r = _post(s, "/chat/completions", CHAT)
    assert r.status_code == 409 and r.json()["error"]["code"] == "session_closed"


def test_a_session_that_waits_past_its_deadline_is_closed_and_its_request_refused(served):
    gateway, call = served
    s = call(gateway.open("a"))
    assert call(gateway.exchange("a", None, 0.2)) == {"kind": "timeout"}
    assert _post(s, "/chat/completions", CHAT).status_code == 409
    err = ProtocolError(400, "too long", param="messages", code="context_length_exceeded")
    assert err.body()["error"]["code"] == "context_length_exceeded"
