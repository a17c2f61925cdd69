"""Tokenizers with chat templates, built in memory for the agent tests (no hub): a small byte-level BPE with real
merges trained on a tiny corpus, ChatML special tokens and a ChatML template with a tools section, and template
variants that break the prefix property the way real ones do.

The BPE has no pre-tokenizer split (``ByteLevel(use_regex=False)``): merges run across punctuation, digits and
whitespace, so a reply's first characters can merge with the text before them (``"</call><result>"`` is one
token), which is what makes re-tokenizing a history drift from the sampled ids.
"""

from __future__ import annotations

from functools import lru_cache

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}

# The system section a tool-aware template writes when ``tools`` is given.
_TOOLS_SECTION = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\nCall a tool as <tool_call>{\"name\": NAME, \"arguments\": ARGS}</tool_call>. "
    "Tools:\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
)

# Consecutive tool results share one user turn, each in <tool_response> tags (Qwen2.5's layout, written anew).
_TOOL_MESSAGE = (
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user\\n' }}"
    "{%- else %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
)

_GENERATION_PROMPT = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"


def _chatml(content: str = "message.content", after_message: str = "", tool_message: str = _TOOL_MESSAGE,
            before: str = "") -> str:
    """A ChatML template with a tools section; ``content`` is the Jinja expression an assistant message's text
    is rendered from, ``after_message`` Jinja run after each non-tool message, ``before`` Jinja run first."""
    return (
        before + _TOOLS_SECTION
        + "{%- for message in messages %}"
        + "{%- if message.role == 'tool' %}" + tool_message
        + "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + " + content + " + '<|im_end|>\\n' }}"
        + "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
        + "{%- endif %}" + after_message
        + "{%- endfor %}" + _GENERATION_PROMPT
    )


CHATML_TOOLS_TEMPLATE = _chatml()

# Qwen3's behaviour, written anew: an assistant turn before the last user message loses its reasoning block.
_LAST_USER = ("{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}"
              "{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}")
REASONING_DROPPING_TEMPLATE = _chatml(
    content="((message.content.split('</think>')[-1].lstrip('\\n')) if loop.index0 < ns.last_user "
            "else message.content)",
    before=_LAST_USER)

# DeepSeek-R1's behaviour, written anew: every assistant turn in the history is rendered without its reasoning.
REASONING_STRIPPING_TEMPLATE = _chatml(content="message.content.split('</think>')[-1].lstrip('\\n')")

# A template that closes the conversation's last assistant turn with an extra EOS (for supervised training):
# the turn renders differently once more messages follow it.
LAST_TURN_EOS_TEMPLATE = _chatml(
    after_message="{%- if loop.last and message.role == 'assistant' %}{{- '<|endoftext|>' }}{%- endif %}")

# A template without a tool role.
NO_TOOL_ROLE_TEMPLATE = _chatml(tool_message="{{- raise_exception('only user and assistant roles') }}")


def _corpus() -> list[str]:
    lines = [f"{a}+{b}={a + b}\n" for a in range(10) for b in range(10)]
    lines += ['<tool_call>\n{"name": "calc", "arguments": {"expression": "%d+%d"}}\n</tool_call>' % (a, a + 1)
              for a in range(10)] * 3
    lines += [f"<tool_response>\n{a}\n</tool_response>" for a in range(20)]
    lines += [f"<call>calc {a}+1</call><result>{a + 1}</result>" for a in range(10)] * 3
    lines += ["user\n", "assistant\n", "system\n"] * 10
    return lines


@lru_cache(maxsize=None)
def _trained_bpe_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    return tok.to_str()


def build_bpe_tokenizer(chat_template: str | None = CHATML_TOOLS_TEMPLATE, name: str = "test-bpe-chatml"):
    """A ``transformers.PreTrainedTokenizerFast``: byte-level BPE (400 tokens, real merges) trained on a tiny
    arithmetic / tool-call corpus (deterministic), ChatML special tokens (``<|endoftext|>`` = 0 the pad,
    ``<|im_start|>`` = 1, ``<|im_end|>`` = 2 the EOS), and ``chat_template`` (None: no template). The training
    runs once per process; each call returns a new tokenizer object."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_trained_bpe_json()),
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False, name_or_path=name)
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast
