"""An environment's reply as token ids to append after a sampled assistant turn, never re-tokenizing history.

The rule ("exact tokens"): an episode's trained sequence is prompt ids + sampled ids + reply ids + sampled ids
+ ...; the sampled ids stay exactly as sampled and only the environment's reply is tokenized, alone. Decoding
the history and tokenizing it again would give other ids wherever the model sampled a non-canonical split or a
reply's first characters would merge with the last sampled token, and the learner would then train on tokens
the behaviour policy never produced.

**Chat mode** (a tokenizer with a chat template): the reply is the template's delta after the assistant turn.
A fixed base conversation ``[user BASE_USER_CONTENT, assistant BASE_ASSISTANT_CONTENT]`` is rendered with
``tokenizer.apply_chat_template(..., tools=tools, tokenize=False)``:

* ``G`` = the user message alone with the generation prompt, then the assistant content: the text the model
  saw and wrote when it sampled the turn;
* ``B`` = the base conversation (no generation prompt): the finished turn as the template closes it;
* ``F`` = the base conversation + the new messages, with the generation prompt for the next assistant turn.

The template is prefix-stable for these messages when ``G`` and ``B`` are both prefixes of ``F``: adding the
reply re-renders nothing the model already saw. Otherwise ``TemplateNotPrefixStable`` is raised (a template that
drops earlier reasoning, re-renders the last assistant turn differently once it is not last, ...). The base
assistant content holds a reasoning block in the form reasoning templates write it (``<think>\\n...\\n</think>
\\n\\n``), so a template that strips earlier reasoning is caught; to any other template it is plain text.

``F[len(G):]`` is what follows the sampled content: the template's closing of the turn (for ChatML
``"<|im_end|>\\n"``), the rendered new messages and the next generation prompt (``"<|im_start|>assistant\\n"``).
How the turn ended (``TurnEnd``) decides how much of the closing the model already sampled:

* ``eos``: the turn ended on an end-of-turn token (its id is the last sampled id). When the closing starts with
  that token's text (ChatML: sampled ``<|im_end|>``), that text is dropped and the delta starts after it
  (``"\\n<|im_start|>user..."``). When it does not (the model sampled ``<|endoftext|>`` where the template closes
  with ``<|im_end|>``), the sampled token stays and the whole closing follows it.
* ``stop``: the turn ended on a tool call's stop string (its closing tag, part of the sampled text); no
  end-of-turn token was sampled, so the delta is the whole closing + messages + generation prompt.
* ``length``: cut at the response limit; as ``stop`` (whether an episode goes on after a cut turn is the
  caller's choice).

The delta text is tokenized alone with ``add_special_tokens=False`` (no BOS; special tokens written in the text,
``<|im_start|>``, map to their single ids).

**Plain mode** (no chat template: the embedded tiny model's character tokenizer): each new message is rendered
by a format string per role (``PLAIN_FORMATS``: ``tool`` -> ``"<result>{content}</result>"``, ``user`` ->
``"<user>{content}</user>"``), the pieces are concatenated with no separator and tokenized alone. Nothing is
added for the turn's end: an EOS the model sampled stays where it is.

The functions take a Hugging Face tokenizer (``apply_chat_template``, ``__call__``, ``decode``) and plain values;
nothing from ``cluster/``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

TURN_END_KINDS = ("eos", "stop", "length")

REPLY_ROLES = ("tool", "user")

BASE_USER_CONTENT = "Base question."

BASE_ASSISTANT_CONTENT = "<think>\nBase reasoning.\n</think>\n\nBase answer."

PLAIN_FORMATS: dict[str, str] = {"tool": "<result>{content}</result>", "user": "<user>{content}</user>"}

# The new-message shapes ``prefix_stability_problem`` checks: a tool result, two tool results, user feedback.
STABILITY_CASES: tuple[tuple[str, ...], ...] = (("tool",), ("tool", "tool"), ("user",))

# Characters of context shown on each side of the first difference in a TemplateNotPrefixStable message.
_CONTEXT_CHARS = 40


class ChatDeltaError(ValueError):
    """The chat template cannot give an exact-token delta for these messages."""


class TemplateNotPrefixStable(ChatDeltaError):
    """Rendering the conversation with the new messages changes text the model already saw or wrote (the
    template is not prefix-stable). The caller refuses the template at config load or starts a new sample."""


class TemplateRenderError(ChatDeltaError):
    """The chat template raised on the conversation (for example it has no ``tool`` role)."""


@dataclass(frozen=True)
class TurnEnd:
    """How a sampled assistant turn ended.

    Attributes:
        kind: ``"eos"`` (an end-of-turn/EOS token, sampled), ``"stop"`` (a stop string: a tool call's closing
            tag, in the sampled text) or ``"length"`` (cut at the response limit).
        token_id: for ``eos``, the sampled end token's id (the turn's last sampled id); None otherwise.
    """

    kind: str
    token_id: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in TURN_END_KINDS:
            raise ValueError(f"TurnEnd.kind must be one of {', '.join(TURN_END_KINDS)}, got {self.kind!r}")
        if (self.kind == "eos") != isinstance(self.token_id, int):
            raise ValueError(f"TurnEnd.token_id must be the sampled end token's id exactly when kind='eos', got "
                             f"kind={self.kind!r}, token_id={self.token_id!r}")

    @classmethod
    def from_sampling(cls, finish_reason: str, stop_reason: int | str | None,
                      last_token_id: int | None) -> TurnEnd:
        """From vLLM's ``CompletionOutput``: ``finish_reason`` (``"stop"``/``"length"``), ``stop_reason`` (None
        for an EOS token, the stop string, or the id of a ``stop_token_ids`` token) and the last sampled id.

        Raises:
            ValueError: another finish reason (``"abort"``), or an EOS end without a last token id.
        """
        if finish_reason == "length":
            return cls("length")
        if finish_reason != "stop":
            raise ValueError(f"finish_reason must be 'stop' or 'length', got {finish_reason!r}")
        if isinstance(stop_reason, str):
            return cls("stop")
        if last_token_id is None:
            raise ValueError("a turn that ended on an end token needs its last sampled token id, got None")
        return cls("eos", int(last_token_id))


def template_label(tokenizer: Any) -> str:
    """``"'NAME' (chat template sha256 PREFIX)"``: the tokenizer's ``name_or_path`` and a digest of its
    template, naming the template in error messages even for a tokenizer built in memory."""
    template = getattr(tokenizer, "chat_template", None)
    digest = hashlib.sha256(str(template).encode()).hexdigest()[:12] if template else "none"
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    return f"{name!r} (chat template sha256 {digest})"


def _check_messages(messages: Sequence[Mapping[str, Any]], roles: Sequence[str]) -> list[dict[str, Any]]:
    """``messages`` as a list of dicts (extra keys such as ``name`` or ``tool_call_id`` kept).

    Raises:
        ValueError: empty, or an item that is not a dict with a ``role`` in ``roles`` and a str ``content``
            (the message names the item).
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"reply messages must be a non-empty list of {{role, content}} dicts, got {messages!r}"[:300])
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in roles or not isinstance(m.get("content"), str):
            raise ValueError(f"reply message {i} must be a dict with role in {tuple(roles)} and str content, "
                             f"got {m!r}"[:300])
        out.append(dict(m))
    return out


def _render(tokenizer: Any, tools: list[dict[str, Any]] | None, messages: list[dict[str, Any]],
            generation_prompt: bool) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except Exception as e:  # jinja's TemplateError, the template's raise_exception, a bad tools schema
        roles = [m["role"] for m in messages]
        raise TemplateRenderError(f"chat template of {template_label(tokenizer)} failed on roles {roles}: "
                                  f"{type(e).__name__}: {e}"[:500]) from e
    if not isinstance(text, str):
        raise TemplateRenderError(f"apply_chat_template(tokenize=False) of {template_label(tokenizer)} returned "
                                  f"{type(text).__name__}, not str")
    return text


def _difference(short: str, long: str, short_name: str) -> str:
    """Where ``short`` stops being a prefix of ``long`` (the conversation with the reply): the offset and both
    texts around it."""
    i = next((k for k, (a, b) in enumerate(zip(short, long)) if a != b), min(len(short), len(long)))
    lo = max(0, i - _CONTEXT_CHARS)
    return (f"first difference at character {i}: {short_name} {short[lo:i + _CONTEXT_CHARS]!r}, with the reply "
            f"{long[lo:i + _CONTEXT_CHARS]!r}")


def _after_content(tokenizer: Any, tools: list[dict[str, Any]] | None, messages: list[dict[str, Any]]) -> str:
    """``F[len(G):]`` (module docstring): the text after the assistant content, closing included.

    Raises:
        TemplateNotPrefixStable, TemplateRenderError.
    """
    user = {"role": "user", "content": BASE_USER_CONTENT}
    assistant = {"role": "assistant", "content": BASE_ASSISTANT_CONTENT}
    sampled = _render(tokenizer, tools, [user], True) + BASE_ASSISTANT_CONTENT
    closed = _render(tokenizer, tools, [user, assistant], False)
    full = _render(tokenizer, tools, [user, assistant, *messages], True)
    roles = [m["role"] for m in messages]
    if not full.startswith(sampled):
        raise TemplateNotPrefixStable(
            f"chat template of {template_label(tokenizer)} is not prefix-stable for reply roles {roles}: the "
            "conversation with the reply does not start with the generation prompt + the assistant's text as "
            f"sampled (the template re-renders or drops what the model wrote, e.g. earlier reasoning); "
            f"{_difference(sampled, full, 'as sampled')}")
    if not full.startswith(closed):
        raise TemplateNotPrefixStable(
            f"chat template of {template_label(tokenizer)} is not prefix-stable for reply roles {roles}: the "
            "conversation rendered alone is not a prefix of the conversation with the reply (the template "
            f"renders a turn differently once more messages follow); {_difference(closed, full, 'alone')}")
    return full[len(sampled):]


def chat_delta_text(tokenizer: Any, tools: list[dict[str, Any]] | None, messages: Sequence[Mapping[str, Any]],
                    turn_end: TurnEnd) -> str:
    """The text to append after a sampled assistant turn in chat mode: the part of the template's closing of
    the turn the model did not sample, the rendered ``messages`` and the next generation prompt (module
    docstring).

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        tools: the tool JSON schemas (``apply_chat_template``'s ``tools=``), or None.
        messages: the environment's reply: dicts with ``role`` ``"tool"`` or ``"user"`` and str ``content``
            (other keys, such as ``name`` or ``tool_call_id``, are passed to the template).
        turn_end: how the sampled turn ended.

    Returns:
        The delta text (str), e.g. ChatML after a sampled ``<|im_end|>``:
        ``"\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n"``.

    Raises:
        ValueError: malformed ``messages``.
        TemplateRenderError: the template raised (no template, no ``tool`` role, ...).
        TemplateNotPrefixStable: the template re-renders history when these messages are added.
    """
    msgs = _check_messages(messages, REPLY_ROLES)
    after = _after_content(tokenizer, tools, msgs)
    if turn_end.kind == "eos":
        end_text = tokenizer.decode([turn_end.token_id], skip_special_tokens=False)
        if end_text and after.startswith(end_text):
            return after[len(end_text):]
    return after


def chat_delta_ids(tokenizer: Any, tools: list[dict[str, Any]] | None, messages: Sequence[Mapping[str, Any]],
                   turn_end: TurnEnd) -> list[int]:
    """``chat_delta_text`` tokenized alone (``add_special_tokens=False``): the ids to append to the episode
    after the sampled ids (which stay as sampled); they carry no loss.

    Returns:
        list of int token ids (length >= 1 for any template that writes a generation prompt).

    Raises:
        ValueError, TemplateRenderError, TemplateNotPrefixStable: as ``chat_delta_text``.
    """
    return list(tokenizer(chat_delta_text(tokenizer, tools, messages, turn_end),
                          add_special_tokens=False)["input_ids"])


def plain_delta_text(messages: Sequence[Mapping[str, Any]], formats: Mapping[str, str] | None = None) -> str:
    """The reply text in plain mode: each message's ``formats[role].format(content=...)``, concatenated.

    Args:
        messages: dicts with a ``role`` that ``formats`` has and str ``content``.
        formats: role -> format string with one ``{content}`` field; None: ``PLAIN_FORMATS``.

    Raises:
        ValueError: malformed ``messages`` (a role ``formats`` lacks included).
    """
    formats = PLAIN_FORMATS if formats is None else formats
    msgs = _check_messages(messages, tuple(formats))
    return "".join(formats[m["role"]].format(content=m["content"]) for m in msgs)


def plain_delta_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                    formats: Mapping[str, str] | None = None) -> list[int]:
    """``plain_delta_text`` tokenized alone (``add_special_tokens=False``): the ids to append after the
    sampled ids. Characters the tokenizer cannot represent become its unknown token, as anywhere else.

    Returns:
        list of int token ids.

    Raises:
        ValueError: malformed ``messages``.
    """
    return list(tokenizer(plain_delta_text(messages, formats), add_special_tokens=False)["input_ids"])


def reply_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]], turn_end: TurnEnd,
              tools: list[dict[str, Any]] | None = None, *, chat: bool | None = None,
              formats: Mapping[str, str] | None = None) -> list[int]:
    """The ids to append for an environment reply, by mode: ``chat_delta_ids`` (chat mode) or
    ``plain_delta_ids`` (plain mode; ``turn_end`` and ``tools`` unused).

    Args:
        chat: True (chat mode), False (plain mode), None (chat mode exactly when the tokenizer has a chat
            template).
        formats: plain mode's format strings (None: ``PLAIN_FORMATS``).

    Raises:
        ValueError, TemplateRenderError, TemplateNotPrefixStable: as ``chat_delta_ids`` / ``plain_delta_ids``.
    """
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))
    if chat:
        return chat_delta_ids(tokenizer, tools, messages, turn_end)
    return plain_delta_ids(tokenizer, messages, formats)


def prefix_stability_problem(tokenizer: Any, tools: list[dict[str, Any]] | None) -> str | None:
    """Why the tokenizer's chat template cannot give exact-token deltas, or None when it can: for a config
    check at load time (chat mode only; plain mode needs no template).

    Checks, for each reply shape of ``STABILITY_CASES`` (one tool result, two, user feedback): the template has
    a chat template, renders the conversation, is prefix-stable (``TemplateNotPrefixStable``), and the delta
    text survives ``tokenize -> decode`` unchanged (a tokenizer that adds a prefix space when it encodes a text
    on its own, for example, would not).

    Returns:
        None, or one line naming the template and what went wrong (the first problem found).
    """
    if not getattr(tokenizer, "chat_template", None):
        return f"{template_label(tokenizer)} has no chat template (use the plain mode)"
    for roles in STABILITY_CASES:
        messages = [{"role": role, "content": f"Reply {i}."} for i, role in enumerate(roles)]
        try:
            text = chat_delta_text(tokenizer, tools, messages, TurnEnd("stop"))
        except ChatDeltaError as e:
            return str(e)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        back = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if back != text:
            return (f"{template_label(tokenizer)}: the reply delta for roles {list(roles)} does not survive "
                    f"tokenize -> decode: {text!r} -> {back!r}"[:500])
    return None
