"""The OpenAI Responses API wire protocol of the agent gateway (``/v1/responses``): pure Python.

The Responses API is the OpenAI Agents SDK's default. Its requests normalize to the same ``ChatRequest`` as
Chat Completions (``rollout/openai_protocol.py``, whose docstring gives the normal form of a message), so the
gateway renders and matches one kind of conversation:

* ``instructions`` -> a leading ``system`` message; ``input`` as a string -> one ``user`` message;
* an input ``message`` item (``type`` may be omitted) -> a message of its role, its ``input_text`` /
  ``output_text`` parts joined by newlines;
* ``function_call`` items -> ``tool_calls`` of an assistant message: appended to the assistant message just
  before them (the text and the calls of one sampled turn come back as a message item and call items), else
  to a new assistant message with empty content; ``arguments`` kept as the JSON string sent, ``call_id`` as the
  call's id;
* ``function_call_output`` -> a ``tool`` message (``tool_call_id`` = ``call_id``);
* ``reasoning`` items are dropped (the gateway never returns them; a client replaying another model's reasoning
  loses nothing the engine sampled);
* tools ``{"type": "function", "name", "description", "parameters"}`` -> chat format; any other tool type
  (web search, file search, computer use, MCP, custom) is a 400.

Stateless: ``previous_response_id`` and ``conversation`` (server-side history) are refused with 400, because
the gateway keeps token ids per session, not responses; the Agents SDK sends neither unless asked.

Output: a ``response`` object whose ``output`` holds a ``message`` item (``msg_<request_id>``) when there is
text or no call, then one ``function_call`` item per call (``fc_<request_id>_<k>``, ``call_id`` =
``tool_call_id(request_id, k)``). A reply cut by length is ``status: "incomplete"`` with
``incomplete_details.reason = "max_output_tokens"``. Streaming is emulated as the event sequence OpenAI sends
(created, in_progress, each item added / its deltas / done, then completed or incomplete).
"""

from __future__ import annotations

from typing import Any

from rollout.openai_protocol import (
    ChatRequest,
    Reply,
    arguments_json,
    check_reply,
    check_tool_choice,
    fail,
    function_tool,
    max_tokens_of,
    optional_bool,
    optional_number,
    optional_str,
    require_object,
    text_of,
    tool_call_id,
)

_INPUT_ROLES = ("system", "developer", "user", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
_STATEFUL = ("previous_response_id", "conversation")


def _text_of(content: Any, param: str) -> str:
    """Input content as one string: a str, or a list of text parts (input_text, output_text) joined by "\\n"."""
    return text_of(content, param, _TEXT_PARTS, allow_none=False)


def _function_call(item: dict, where: str) -> dict:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise fail(f"'{where}.{key}' must be a string, got {type(item.get(key)).__name__}", f"{where}.{key}")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _input_item(item: Any, where: str, messages: list[dict], merge_calls: bool) -> bool:
    """Append ``item``'s message to ``messages`` (or its call to the last one); returns whether the next
    ``function_call`` may join the last message (it is an assistant turn still being read)."""
    if not isinstance(item, dict):
        raise fail(f"'{where}' must be an object, got {type(item).__name__}", where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _INPUT_ROLES:
            raise fail(f"'{where}.role' must be one of {', '.join(_INPUT_ROLES)}, got {role!r}", f"{where}.role")
        messages.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
        return role == "assistant"
    if kind == "function_call":
        call = _function_call(item, where)
        if merge_calls:
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        return True
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise fail(f"'{where}.call_id' must be a string", f"{where}.call_id")
        messages.append({"role": "tool", "content": _text_of(item.get("output"), f"{where}.output"),
                         "tool_call_id": item["call_id"]})
        return False
    if kind == "reasoning":
        return merge_calls
    raise fail(f"'{where}.type' {kind!r} is not supported (message, function_call, function_call_output, "
                f"reasoning are)", f"{where}.type")


def _messages_of(body: dict) -> list[dict]:
    messages: list[dict] = []
    instructions = optional_str(body, "instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        merge = False
        for i, item in enumerate(given):
            merge = _input_item(item, f"input[{i}]", messages, merge)
    elif given is not None:
        raise fail(f"'input' must be a string or a list of items, got {type(given).__name__}", "input")
    if not any(message["role"] != "system" for message in messages):
        raise fail("'input' must hold at least one message or item", "input")
    return messages


def _tools_of(tools: Any) -> list[dict] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise fail(f"'tools' must be a list, got {type(tools).__name__}", "tools")
    out: list[dict] = []
    seen: set[str] = set()
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise fail(f"'tools[{k}].type' must be 'function' (only function tools are supported), got {kind!r}",
                        f"tools[{k}].type")
        out.append(function_tool(tool, f"tools[{k}]", seen))
    return out


def parse_responses_request(body: Any) -> ChatRequest:
    """A ``/v1/responses`` request body (decoded JSON) checked and normalized (module docstring: the mapping).

    Returns:
        ChatRequest with ``api="responses"``, ``stop`` empty and ``include_usage`` False (a Responses stream
        always ends with the usage).

    Raises:
        ProtocolError: 400 with ``param``: ``input`` missing, of a wrong type or without a message; an item of an
            unsupported type, role or content; ``previous_response_id`` or ``conversation`` given (code
            ``unsupported_parameter``); a non-function tool or malformed tool; an invalid ``tool_choice``;
            ``max_output_tokens`` below 1; ``stream`` not a bool; ``temperature``/``top_p`` out of range.
    """
    body = require_object(body)
    for key in _STATEFUL:
        if body.get(key) is not None:
            raise fail(f"'{key}' is not supported: the gateway keeps no responses, send the whole input",
                        key, "unsupported_parameter")
    tools = _tools_of(body.get("tools"))
    return ChatRequest(
        messages=_messages_of(body),
        tools=tools,
        tool_choice=check_tool_choice(body.get("tool_choice"), tools),
        max_tokens=max_tokens_of(body, ("max_output_tokens",)),
        stop=[],
        stream=optional_bool(body, "stream"),
        include_usage=False,
        temperature=optional_number(body, "temperature", 0.0, 2.0),
        top_p=optional_number(body, "top_p", 0.0, 1.0),
        model=optional_str(body, "model"),
        api="responses",
    )


# ------------------------------------------------------------------------------------------------------------
# Responses output


def _message_item(reply: Reply, request_id: str, status: str) -> dict:
    content = [] if status == "in_progress" else [
        {"type": "output_text", "text": reply.content, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": f"msg_{request_id}", "role": "assistant", "status": status,
            "content": content}


def _call_items(reply: Reply, request_id: str) -> list[dict]:
    return [{"type": "function_call", "id": f"fc_{request_id}_{k}", "call_id": tool_call_id(request_id, k),
             "name": call["name"], "arguments": arguments_json(call["arguments"]), "status": "completed"}
            for k, call in enumerate(reply.tool_calls)]


def _output_items(reply: Reply, request_id: str) -> list[dict]:
    message = [_message_item(reply, request_id, "completed")] if reply.content or not reply.tool_calls else []
    return message + _call_items(reply, request_id)


def _request_echo(request: ChatRequest | None) -> dict:
    """The request fields a Response repeats (tools back in Responses form)."""
    if request is None:
        return {"tools": [], "tool_choice": "auto", "temperature": None, "top_p": None, "max_output_tokens": None}
    choice = request.tool_choice or "auto"
    if isinstance(choice, dict):
        choice = {"type": "function", "name": choice["function"]["name"]}
    return {"tools": [{"type": "function", "parameters": None, "strict": None, **tool["function"]}
                      for tool in request.tools or []],
            "tool_choice": choice, "temperature": request.temperature, "top_p": request.top_p,
            "max_output_tokens": request.max_tokens}


def response_object(reply: Reply, *, request_id: str, model: str, created: int,
                    request: ChatRequest | None = None, status: str | None = None) -> dict:
    """A Responses API ``response`` object (id ``resp_<request_id>``; module docstring: the output items).

    ``request``, when given, is echoed (tools, tool choice, temperature, top-p, max output tokens) as OpenAI
    does; ``status`` overrides the status (``"in_progress"`` with no output, for the stream's first events).
    ``created`` is Unix seconds.

    Raises:
        ValueError: a malformed reply (``rollout.openai_protocol.check_reply``).
    """
    check_reply(reply)
    final = "incomplete" if reply.finish_reason == "length" else "completed"
    status = status or final
    done = status != "in_progress"
    usage = {"input_tokens": reply.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
             "output_tokens": reply.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": reply.prompt_tokens + reply.completion_tokens}
    return {"id": f"resp_{request_id}", "object": "response", "created_at": created, "model": model,
            "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if done and final == "incomplete" else None,
            "instructions": None, "metadata": {}, "parallel_tool_calls": True,
            "output": _output_items(reply, request_id) if done else [],
            "usage": usage if done else None, **_request_echo(request)}


def response_events(reply: Reply, *, request_id: str, model: str, created: int,
                    request: ChatRequest | None = None) -> list[dict]:
    """The streaming events of a reply, in order, numbered by ``sequence_number`` from 0.

    ``response.created`` and ``response.in_progress``; for the message item ``output_item.added``,
    ``content_part.added``, one ``output_text.delta`` (the whole text), ``output_text.done``,
    ``content_part.done``, ``output_item.done``; for each call item ``output_item.added`` (empty arguments),
    one ``function_call_arguments.delta``, ``function_call_arguments.done``, ``output_item.done``; then
    ``response.completed`` (``response.incomplete`` when cut by length) with the whole response.

    Raises:
        ValueError: a malformed reply (``rollout.openai_protocol.check_reply``).
    """
    kwargs = dict(request_id=request_id, model=model, created=created, request=request)
    final = response_object(reply, **kwargs)
    started = response_object(reply, status="in_progress", **kwargs)
    events: list[dict] = [{"type": "response.created", "response": started},
                          {"type": "response.in_progress", "response": started}]
    for index, item in enumerate(final["output"]):
        at = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            part = item["content"][0]
            events += [{"type": "response.output_item.added", "output_index": index,
                        "item": _message_item(reply, request_id, "in_progress")},
                       {"type": "response.content_part.added", **at, "content_index": 0,
                        "part": {**part, "text": ""}},
                       {"type": "response.output_text.delta", **at, "content_index": 0, "delta": part["text"],
                        "logprobs": []},
                       {"type": "response.output_text.done", **at, "content_index": 0, "text": part["text"],
                        "logprobs": []},
                       {"type": "response.content_part.done", **at, "content_index": 0, "part": part}]
        else:
            events += [{"type": "response.output_item.added", "output_index": index,
                        "item": {**item, "arguments": "", "status": "in_progress"}},
                       {"type": "response.function_call_arguments.delta", **at, "delta": item["arguments"]},
                       {"type": "response.function_call_arguments.done", **at, "name": item["name"],
                        "arguments": item["arguments"]}]
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    events.append({"type": f"response.{final['status']}", "response": final})
    return [{**event, "sequence_number": n} for n, event in enumerate(events)]
