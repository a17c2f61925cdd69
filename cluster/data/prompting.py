"""A row's prompt -> the token ids the rollout engine receives, in one place for every task.

The rules (those of the tokenizer's own ``apply_chat_template`` and of OpenRLHF's ``--apply_chat_template``):

* **Chat template** (``data.apply_chat_template``: ``true``, ``false`` or ``auto`` = when the tokenizer has
  one): the prompt as chat messages (a string becomes one ``user`` message; ``data.system_prompt``, when set
  and the row has no system message of its own, goes first) is rendered by
  ``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`` and the text is
  tokenized with ``add_special_tokens=False``: the template writes the special tokens it wants (a BOS
  included), the tokenizer adds none on top.
* **Plain text**: tokenized with ``add_special_tokens=False``, then a BOS is put first exactly when the
  tokenizer's own settings add one (``tokenizer(text)`` starts with a BOS that
  ``tokenizer(text, add_special_tokens=False)`` lacks) and the text does not already start with it. EOS tokens a
  tokenizer may append (``add_eos_token``) are never added to a prompt.
* Never two BOS: a leading doubled BOS (a template or a prompt text that writes one more) is cut to one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

ChatMode = Literal["auto", True, False]


class PromptError(ValueError):
    """A prompt that cannot be encoded (chat messages without a template, a malformed message list)."""


def tokenizer_adds_bos(tokenizer: Any) -> bool:
    """True when ``tokenizer(text)`` (its default ``add_special_tokens=True``) puts a BOS first.

    Probed on a short text rather than read from an attribute: slow, fast and template-processor tokenizers
    keep the setting in different places (``add_bos_token``, the ``tokenizers`` post-processor)."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    probe = "a"
    with_special = tokenizer(probe)["input_ids"]
    without = tokenizer(probe, add_special_tokens=False)["input_ids"]
    return bool(with_special) and with_special[0] == bos and (not without or without[0] != bos)


def check_messages(messages: Any) -> list[dict[str, str]]:
    """``messages`` as a list of ``{"role", "content"}`` dicts with text values (extra keys are dropped).

    Raises:
        PromptError: not a non-empty list of such dicts (the message says which item and why).
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise PromptError(f"chat prompt must be a non-empty list of {{role, content}} messages, got {messages!r}"[:300])
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise PromptError(f"chat message {i} must be a dict with text 'role' and 'content', got {m!r}"[:300])
        out.append({"role": m["role"], "content": m["content"]})
    return out


@dataclass
class PromptEncoder:
    """Turns a row's prompt (text, or a list of chat messages) into ``(text given to the model, token ids)``.

    Args:
        tokenizer: a ``transformers`` tokenizer (the model folder's).
        apply_chat_template: ``"auto"`` (use the tokenizer's chat template when it has one), True or False.
        system_prompt: system message put before the prompt when the chat template is used (None: none).

    Raises:
        PromptError: ``apply_chat_template=True`` and the tokenizer has no chat template.
    """

    tokenizer: Any
    apply_chat_template: ChatMode = "auto"
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        if self.apply_chat_template is True and not has_template:
            raise PromptError("data.apply_chat_template=true but the model's tokenizer has no chat template "
                              "(set it to false or auto)")
        self.chat = has_template if self.apply_chat_template == "auto" else bool(self.apply_chat_template)
        self.bos_id = self.tokenizer.bos_token_id
        self.adds_bos = tokenizer_adds_bos(self.tokenizer)

    def render(self, prompt: str | list[dict[str, str]]) -> str:
        """The text the model is given for ``prompt`` (the chat template's output, or the text itself).

        Raises:
            PromptError: chat messages while the chat template is off, or malformed messages.
        """
        if isinstance(prompt, str) and not self.chat:
            return prompt
        if not self.chat:
            raise PromptError("the prompt is a list of chat messages but no chat template is applied "
                              f"(data.apply_chat_template={self.apply_chat_template!r}; the tokenizer "
                              f"{'has' if getattr(self.tokenizer, 'chat_template', None) else 'has no'} template)")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else check_messages(prompt)
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, prompt: str | list[dict[str, str]]) -> tuple[str, list[int]]:
        """``(text, token ids)`` of ``prompt`` by the rules in the module docstring (ids: Python ints, no
        padding, at most one leading BOS).

        Raises:
            PromptError: as ``render``.
        """
        text = self.render(prompt)
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        bos = self.bos_id
        if not self.chat and self.adds_bos and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        while bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]
        return text, ids

    def ids(self, text: str) -> list[int]:
        """Only the token ids of ``encode(text)``."""
        return self.encode(text)[1]
