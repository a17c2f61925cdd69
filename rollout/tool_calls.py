"""Tool calls in a sampled assistant turn, parsed by format: pure Python, no tokenizer.

An agent episode's assistant turn is sampled until the end of turn or a tool call's closing tag (the engine's
stop strings, ``include_stop_str_in_output`` semantics: the closing tag is part of the sampled text). This
module finds the calls in that text. Model output is untrusted: a malformed call never raises, it becomes a
``ToolCallError`` of a fixed kind, which the episode loop sends back to the model as an error observation
(``error_observation``) and counts by kind (``error_counts``).

Formats (``FORMATS``; ``register_format`` adds one):

* ``hermes``: ``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>``, what tool-aware chat templates
  (Qwen2.5/Qwen3, Hermes, SmolLM3 style) ask for; the JSON may be surrounded by whitespace (they write
  ``<tool_call>\\n{...}\\n</tool_call>``). ``arguments`` must be a JSON object; a missing ``arguments`` key
  means no arguments (``{}``); arguments given as a string (OpenAI's wire form) are an error, not parsed again.
  Several calls may follow one another in one turn.
* ``tag``: ``<call>NAME ARGUMENT</call>``, a plain format a tiny character-level model can learn. NAME is the
  first run of non-space characters after ``<call>`` (it must match ``[A-Za-z_][A-Za-z0-9_.-]*``); ARGUMENT is
  the rest up to ``</call>``, stripped (possibly empty), and goes to the tool's one string parameter under the
  key ``TAG_ARGUMENT_KEY`` (``"input"``): ``<call>calc 3+4</call>`` -> ``ToolCall("calc", {"input": "3+4"})``.
  The caller maps ``"input"`` to the tool's own parameter name.

Error kinds (``ERROR_KINDS``, fixed):

* ``unclosed``: an opening tag with no closing tag after it (the turn ended on EOS or was cut by length
  inside a call); the call runs to the end of the text.
* ``bad_json``: (hermes) the text between the tags is not one JSON value.
* ``not_an_object``: (hermes) it is JSON but not an object.
* ``missing_name``: no tool name: (hermes) ``name`` absent, not a string or blank; (tag) an empty call or a
  first word that is not a name.
* ``bad_arguments``: (hermes) ``arguments`` present but not a JSON object.
* ``unknown_tool``: a well-formed call naming a tool outside the ``tool_names`` given to ``parse``.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterable

ERROR_KINDS = ("unclosed", "bad_json", "not_an_object", "missing_name", "bad_arguments", "unknown_tool")

TAG_ARGUMENT_KEY = "input"

# Longest model-written text (a tool name) quoted back in an error message.
_QUOTE_CHARS = 40

# Most tool names listed in an unknown_tool message.
_LISTED_TOOLS = 12

_TAG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")


@dataclass(frozen=True)
class ToolCall:
    """One well-formed tool call.

    Attributes:
        name: the tool's name as written.
        arguments: the call's arguments (a JSON object: str keys, JSON values).
        span: ``(start, end)`` character offsets of the whole call in the turn's text, tags included
            (``text[start:end]`` is the call).
    """

    name: str
    arguments: dict[str, Any]
    span: tuple[int, int]


@dataclass(frozen=True)
class ToolCallError:
    """One malformed call (or a call to an unknown tool).

    Attributes:
        kind: one of ``ERROR_KINDS``.
        message: a short, deterministic description (what was wrong, no more than a short quote of the text).
        span: ``(start, end)`` character offsets of the call in the turn's text, tags included; an
            ``unclosed`` call ends at the end of the text.
        format: the name of the format the turn was parsed with (``error_observation`` shows its usage).
        name: the tool name when one was read (``unknown_tool``, ``bad_arguments``), else None.
    """

    kind: str
    message: str
    span: tuple[int, int]
    format: str
    name: str | None = None


@dataclass(frozen=True)
class ParsedTurn:
    """What one assistant turn holds.

    Attributes:
        content: the text outside every call (well-formed or not), pieces joined as they stand, then stripped.
        calls: the well-formed calls, in the order they appear.
        errors: the malformed calls, in the order they appear.
    """

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ToolCallError] = field(default_factory=list)


class _BodyError(Exception):
    """A call body that is not a call (internal: ``parse`` turns it into a ``ToolCallError``)."""

    def __init__(self, kind: str, message: str, name: str | None = None):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.name = name


@dataclass(frozen=True)
class ToolCallFormat:
    """One tool-call format: a call is ``open_tag BODY close_tag`` and ``read_body`` reads BODY.

    Attributes:
        name: the registry name.
        open_tag: the text that opens a call.
        close_tag: the text that closes it; also the engine's stop string.
        usage: one line showing the expected form, quoted to the model in error observations.
        read_body: BODY (the raw text between the tags) -> ``(name, arguments)``; raises ``_BodyError`` for a
            malformed body.
    """

    name: str
    open_tag: str
    close_tag: str
    usage: str
    read_body: Callable[[str], tuple[str, dict[str, Any]]]

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The strings the engine stops sampling on right after a call: ``(close_tag,)``."""
        return (self.close_tag,)


def _quote(text: str) -> str:
    """``repr`` of ``text`` cut to ``_QUOTE_CHARS`` characters (model output quoted back stays short)."""
    return repr(text if len(text) <= _QUOTE_CHARS else text[:_QUOTE_CHARS] + "...")


def _read_hermes(body: str) -> tuple[str, dict[str, Any]]:
    """``{"name": ..., "arguments": {...}}`` -> ``(name, arguments)``; ``_BodyError`` otherwise."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        raise _BodyError("bad_json", f"not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, dict):
        raise _BodyError("not_an_object", f"expected a JSON object, got a JSON {type(value).__name__}")
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        raise _BodyError("missing_name", f'"name" must be a non-empty string, got {_quote(json.dumps(name))}')
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        raise _BodyError("bad_arguments", f'"arguments" of {_quote(name)} must be a JSON object, got a JSON '
                         f"{type(arguments).__name__}", name=name)
    return name, arguments


def _read_tag(body: str) -> tuple[str, dict[str, Any]]:
    """``NAME ARGUMENT`` -> ``(NAME, {TAG_ARGUMENT_KEY: ARGUMENT})``; ``_BodyError`` otherwise."""
    parts = body.strip().split(None, 1)
    if not parts:
        raise _BodyError("missing_name", "empty call: expected a tool name")
    name = parts[0]
    if not _TAG_NAME.fullmatch(name):
        raise _BodyError("missing_name", f"{_quote(name)} is not a tool name (letters, digits, _ . -)")
    return name, {TAG_ARGUMENT_KEY: parts[1].strip() if len(parts) > 1 else ""}


FORMATS: dict[str, ToolCallFormat] = {}


def register_format(fmt: ToolCallFormat) -> ToolCallFormat:
    """Add ``fmt`` to ``FORMATS`` under ``fmt.name`` and return it.

    Raises:
        ValueError: the name is taken, or a tag is empty.
    """
    if fmt.name in FORMATS:
        raise ValueError(f"tool-call format {fmt.name!r} is already registered")
    if not fmt.open_tag or not fmt.close_tag:
        raise ValueError(f"tool-call format {fmt.name!r} needs non-empty tags, got {fmt.open_tag!r}, "
                         f"{fmt.close_tag!r}")
    FORMATS[fmt.name] = fmt
    return fmt


register_format(ToolCallFormat(
    name="hermes", open_tag="<tool_call>", close_tag="</tool_call>",
    usage='<tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>', read_body=_read_hermes))
register_format(ToolCallFormat(
    name="tag", open_tag="<call>", close_tag="</call>", usage="<call>TOOL ARGUMENT</call>", read_body=_read_tag))


def get_format(name: str) -> ToolCallFormat:
    """The registered format called ``name``.

    Raises:
        ValueError: no such format (the message lists the known ones).
    """
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown tool-call format {name!r}; known formats: {', '.join(sorted(FORMATS))}") from None


def stop_strings(format: str) -> list[str]:
    """The stop strings of format ``format`` (its closing tag), for the engine's sampling call with
    ``include_stop_str_in_output=True``.

    Raises:
        ValueError: unknown format.
    """
    return list(get_format(format).stop_strings)


def _unknown_tool_message(name: str, tool_names: Collection[str]) -> str:
    known = sorted(tool_names)
    listed = ", ".join(known[:_LISTED_TOOLS]) + (", ..." if len(known) > _LISTED_TOOLS else "")
    return f"no tool named {_quote(name)} (tools: {listed or 'none'})"


def parse(format: str, text: str, tool_names: Collection[str] | None = None) -> ParsedTurn:
    """The tool calls in one assistant turn's text, read in format ``format``. Never raises on the text.

    Calls are found left to right: an ``open_tag``, then the first ``close_tag`` after it (a call does not
    nest; text that is not inside a call, a stray closing tag included, is content). An opening tag without a
    closing tag is an ``unclosed`` error running to the end of the text.

    Args:
        format: a name in ``FORMATS`` (``"hermes"``, ``"tag"``).
        text: the sampled turn as text (the closing tag of the last call included when sampling stopped on it).
        tool_names: the tools the episode offers; a well-formed call to another name becomes an ``unknown_tool``
            error. None: any name is accepted.

    Returns:
        ``ParsedTurn``: the content outside the calls, the well-formed calls and the errors, with their
        character spans in ``text``.

    Raises:
        ValueError: unknown ``format`` (the message lists the known ones).
        TypeError: ``text`` is not a str.
    """
    fmt = get_format(format)
    if not isinstance(text, str):
        raise TypeError(f"turn text must be a str, got {type(text).__name__}")
    names = None if tool_names is None else frozenset(tool_names)
    calls: list[ToolCall] = []
    errors: list[ToolCallError] = []
    content: list[str] = []
    pos = 0
    while (start := text.find(fmt.open_tag, pos)) >= 0:
        content.append(text[pos:start])
        body_start = start + len(fmt.open_tag)
        close = text.find(fmt.close_tag, body_start)
        if close < 0:
            errors.append(ToolCallError("unclosed", f"{fmt.open_tag} without {fmt.close_tag}",
                                        (start, len(text)), fmt.name))
            pos = len(text)
            break
        pos = close + len(fmt.close_tag)
        try:
            name, arguments = fmt.read_body(text[body_start:close])
        except _BodyError as e:
            errors.append(ToolCallError(e.kind, e.message, (start, pos), fmt.name, e.name))
            continue
        if names is not None and name not in names:
            errors.append(ToolCallError("unknown_tool", _unknown_tool_message(name, names), (start, pos), fmt.name,
                                        name))
        else:
            calls.append(ToolCall(name, arguments, (start, pos)))
    content.append(text[pos:])
    return ParsedTurn("".join(content).strip(), calls, errors)


def error_observation(error: ToolCallError) -> str:
    """The observation text the episode loop sends back for a malformed call: one line, deterministic (the
    same error gives the same text), at most a short quote of the model's text.

    Form: ``"Tool call error (KIND): MESSAGE."``, then, for the kinds about the call's form (all but
    ``unknown_tool``), ``" Expected: USAGE"`` with the format's usage line.

    Raises:
        ValueError: ``error.kind`` is not in ``ERROR_KINDS``, or ``error.format`` is not a registered format.
    """
    if error.kind not in ERROR_KINDS:
        raise ValueError(f"tool-call error kind {error.kind!r} is not one of {', '.join(ERROR_KINDS)}")
    text = f"Tool call error ({error.kind}): {error.message}."
    if error.kind != "unknown_tool":
        text += f" Expected: {get_format(error.format).usage}"
    return text


def error_counts(errors: Iterable[ToolCallError]) -> dict[str, int]:
    """Errors counted by kind, every kind of ``ERROR_KINDS`` present (0 when none), in that order: a metrics
    dict whose keys do not depend on what happened this step."""
    counts = Counter(e.kind for e in errors)
    return {kind: counts.get(kind, 0) for kind in ERROR_KINDS}
