"""A gateway session's history against what it sampled: continue on the sampled ids, or fork (docs/agents.md).

An agent program sends its whole history as OpenAI chat messages with every request. The gateway keeps, per
episode, the messages the current branch stands for (``known``: the request messages it has seen and the assistant
messages it returned) beside the branch's exact ids (prompt ids, then each turn's sampled ids and each reply's
delta ids). For a new request:

* **continue**: ``known`` is a prefix of the request's messages (compared by ``canonical_message``: role, text,
  tool calls by name and parsed arguments, tool call ids; formatting a client may change, such as ``None``
  against ``""`` content or the JSON spacing of arguments, is not a difference), the last known message is the
  assistant turn the gateway returned, and what follows is tool results or user messages. The engine continues
  from the branch's ids: the sampled ids stay as sampled and only the new messages are rendered, as the chat
  template's delta after the turn (``rollout.chat_delta``), never re-tokenizing the history.
* **fork**: anything else (an edited or summarised history, a dropped tool result, earlier reasoning stripped, a
  new system message, or a template whose delta is not prefix-stable). The request's messages are rendered whole
  and start a new branch: a separate trajectory whose rendered prompt carries no loss and whose sampled ids are its
  own. The earlier branch keeps what it sampled.

Plain mode (a tokenizer without a chat template: the embedded tiny model) renders messages with
``PLAIN_FORMATS``-style text (``render_plain``): the first user message as its text, later user messages and
tool results in tags, an assistant message as its text with its calls written in the run's tool-call format.

Pure functions of plain values (and a Hugging Face tokenizer where named); nothing from ``cluster/``.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from rollout.chat_delta import PLAIN_FORMATS, REPLY_ROLES
from rollout.tool_calls import TAG_ARGUMENT_KEY, get_format


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as a JSON value: a JSON string parsed (an unparsable string kept as text)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def canonical_message(m: dict[str, Any]) -> str:
    """A chat message as one comparable string: role, text content (None = ""), tool calls (name and parsed
    arguments, in order; their ids left out, since clients may rewrite them), ``tool_call_id`` and ``name``.

    Args:
        m: a chat message dict (``rollout.openai_protocol.ChatRequest.messages`` form).

    Returns:
        A JSON string with sorted keys: equal for messages an agent sent back unchanged in meaning.
    """
    calls = [(c.get("function", c).get("name"), _arguments(c.get("function", c).get("arguments")))
             for c in (m.get("tool_calls") or [])]
    return json.dumps({"role": m.get("role"), "content": m.get("content") or "", "calls": calls,
                       "tool_call_id": m.get("tool_call_id"), "name": m.get("name")}, sort_keys=True, default=str)


def continuation(known: Sequence[dict[str, Any]], messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The messages that continue a branch, or None when the request forks (module docstring).

    Args:
        known: the branch's messages: the requests' messages so far and the assistant messages returned.
        messages: the new request's messages.

    Returns:
        ``messages[len(known):]`` when ``known`` is a canonical prefix of ``messages``, ends with an assistant
        message, and the rest is one or more ``tool`` / ``user`` messages; else None.
    """
    if not known or known[-1].get("role") != "assistant" or len(messages) <= len(known):
        return None
    if any(canonical_message(a) != canonical_message(b) for a, b in zip(known, messages)):
        return None
    rest = [dict(m) for m in messages[len(known):]]
    return rest if all(m.get("role") in REPLY_ROLES for m in rest) else None


def format_call(tool_format: str, name: str, arguments: dict[str, Any]) -> str:
    """A tool call written in ``tool_format`` as the model writes it (for rendering a history in plain mode).

    ``tag``: ``<call>NAME ARG</call>`` with the call's one argument's value; ``hermes``: ``<tool_call>{"name":
    NAME, "arguments": {...}}</tool_call>``.

    Raises:
        ValueError: an unknown format.
    """
    fmt = get_format(tool_format)
    if fmt.name == "tag":
        values = list((arguments or {}).values())
        arg = values[0] if len(values) == 1 else (arguments or {}).get(TAG_ARGUMENT_KEY, "")
        return f"{fmt.open_tag}{name} {arg}{fmt.close_tag}"
    return f"{fmt.open_tag}{json.dumps({'name': name, 'arguments': arguments or {}})}{fmt.close_tag}"


def render_plain(messages: Sequence[dict[str, Any]], tool_format: str, raw_text: dict[str, str] | None = None) -> str:
    """A whole history as plain-mode text (no chat template): the first user (or system) message's text as it
    is, later ``user`` / ``tool`` messages in ``PLAIN_FORMATS``, an assistant message as the raw text the engine
    sampled for it when ``raw_text`` has it (by ``canonical_message``), else its content followed by its calls
    in ``tool_format`` (``format_call``).

    Raises:
        ValueError: a message with a role plain mode cannot write (anything but system, developer, user,
            assistant, tool).
    """
    raw_text = raw_text or {}
    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant":
            key = canonical_message(m)
            out.append(raw_text[key] if key in raw_text else content + "".join(
                format_call(tool_format, c["function"]["name"], _arguments(c["function"].get("arguments")) or {})
                for c in (m.get("tool_calls") or [])))
        elif role in ("system", "developer") or (role == "user" and i == 0):
            out.append(content)
        elif role in PLAIN_FORMATS:
            out.append(PLAIN_FORMATS[role].format(content=content))
        else:
            raise ValueError(f"message {i} has role {role!r}, which plain mode (no chat template) cannot render")
    return "".join(out)


def render_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    """A whole history rendered with the tokenizer's chat template and the generation prompt, as ids.

    Raises:
        ValueError: the template raised on these messages (the message names its error).
    """
    try:
        return list(tokenizer.apply_chat_template(list(messages), tools=tools or None, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    except Exception as e:  # jinja's TemplateError, a template's raise_exception, a bad tools schema
        raise ValueError(f"the chat template failed on these messages: {type(e).__name__}: {e}"[:400]) from e
