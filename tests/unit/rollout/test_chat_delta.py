"""An environment reply as token ids after a sampled turn (rollout/chat_delta.py), on tokenizers built here: a
byte-level BPE with real merges and a ChatML template with tools (tests/helpers/chat_tokenizers.py), and the
embedded tiny model's character tokenizer.

The exact-token rule is checked both ways: the trained ids (prompt + sampled + reply ids) decode to the text the
template renders for the whole conversation, and tokenizing that text again gives other ids (the drift exists,
and these functions avoid it)."""

from __future__ import annotations

import pytest

from cluster.models.tiny_model import build_char_tokenizer
from rollout.chat_delta import (
    BASE_ASSISTANT_CONTENT,
    PLAIN_FORMATS,
    STABILITY_CASES,
    TemplateNotPrefixStable,
    TemplateRenderError,
    TurnEnd,
    chat_delta_ids,
    chat_delta_text,
    plain_delta_ids,
    plain_delta_text,
    prefix_stability_problem,
    reply_ids,
)
from rollout.tool_calls import parse, stop_strings
from tests.helpers.chat_tokenizers import (
    CALC_TOOL,
    LAST_TURN_EOS_TEMPLATE,
    NO_TOOL_ROLE_TEMPLATE,
    REASONING_DROPPING_TEMPLATE,
    REASONING_STRIPPING_TEMPLATE,
    build_bpe_tokenizer,
)

TOOLS = [CALC_TOOL]

QUESTION = [{"role": "user", "content": "What is 3+1?"}]

TOOL_CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "3+1"}}\n</tool_call>'

TOOL_REPLY = [{"role": "tool", "content": "4"}]


@pytest.fixture(scope="module")
def bpe():
    return build_bpe_tokenizer()


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _render(tok, messages, generation_prompt=True):
    return tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=generation_prompt)


def test_the_test_tokenizer_has_real_merges_and_single_special_ids(bpe):
    assert [bpe.convert_ids_to_tokens(i) for i in (0, 1, 2)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert _ids(bpe, "<|im_start|>assistant\n")[0] == 1 and bpe.eos_token_id == 2
    assert len(_ids(bpe, TOOL_CALL)) < len(TOOL_CALL) // 4  # merges across punctuation and whitespace


def test_tool_call_turn_keeps_the_sampled_ids_where_retokenizing_drifts(bpe):
    prompt_ids = _ids(bpe, _render(bpe, QUESTION))
    # The model sampled the call in two pieces, each a canonical split of its own text, and stopped on the
    # call's closing tag (a stop string, in the output). Together they are not the canonical split of the call.
    sampled = _ids(bpe, TOOL_CALL[:-14]) + _ids(bpe, TOOL_CALL[-14:])
    assert bpe.decode(sampled) == TOOL_CALL and parse("hermes", TOOL_CALL).calls[0].name == "calc"
    assert TOOL_CALL.endswith(stop_strings("hermes")[0])

    delta = chat_delta_ids(bpe, TOOLS, TOOL_REPLY, TurnEnd("stop"))
    trained = prompt_ids + sampled + delta
    assert trained[len(prompt_ids):len(prompt_ids) + len(sampled)] == sampled
    conversation = [*QUESTION, {"role": "assistant", "content": TOOL_CALL}, *TOOL_REPLY]
    assert bpe.decode(trained) == _render(bpe, conversation)  # the template's text, token for token
    assert _ids(bpe, _render(bpe, conversation)) != trained  # re-tokenizing the history would drift
    assert delta == _ids(bpe, "<|im_end|>\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
                              "<|im_start|>assistant\n")


def test_reply_that_would_merge_with_the_last_sampled_token_stays_apart():
    bpe = build_bpe_tokenizer(chat_template=None)
    sampled_text = "<call>calc 3+1</call>"
    sampled = _ids(bpe, sampled_text)  # the canonical split of the turn alone: the most innocent sample
    delta = reply_ids(bpe, TOOL_REPLY, TurnEnd("stop"))  # no template: plain mode
    assert bpe.decode(delta) == "<result>4</result>"
    trained = sampled + delta
    full = bpe(sampled_text + "<result>4</result>", add_special_tokens=False, return_offsets_mapping=True)
    # Re-tokenized, one token spans the boundary: the reply's first characters merge with the sampled tail.
    assert any(start < len(sampled_text) < end for start, end in full["offset_mapping"])
    assert full["input_ids"] != trained and bpe.decode(full["input_ids"]) == bpe.decode(trained)


@pytest.mark.parametrize("end, sampled_text, closing", [
    ("eos", "3+1=4", ""),  # sampled <|im_end|>: only the "\n" after it is the template's
    ("stop", TOOL_CALL, "<|im_end|>"),  # stopped on </tool_call>: the whole closing is the template's
    ("length", "3+1=", "<|im_end|>"),  # cut: as stop
])
def test_the_three_ends_of_a_turn(bpe, end, sampled_text, closing):
    sampled = _ids(bpe, sampled_text) + ([bpe.eos_token_id] if end == "eos" else [])
    turn_end = TurnEnd(end, sampled[-1] if end == "eos" else None)
    text = chat_delta_text(bpe, TOOLS, TOOL_REPLY, turn_end)
    assert text == (closing + "\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n")
    delta = chat_delta_ids(bpe, TOOLS, TOOL_REPLY, turn_end)
    assert delta == _ids(bpe, text) and bpe.decode(delta) == text
    assert delta.count(1) == 2 and delta.count(2) == 1 + (end != "eos")  # special tokens: one id each
    prompt_ids = _ids(bpe, _render(bpe, QUESTION))
    conversation = [*QUESTION, {"role": "assistant", "content": sampled_text}, *TOOL_REPLY]
    assert bpe.decode(prompt_ids + sampled + delta) == _render(bpe, conversation)


def test_an_end_token_the_template_does_not_close_with_stays_and_the_whole_closing_follows(bpe):
    endoftext = bpe.convert_tokens_to_ids("<|endoftext|>")
    text = chat_delta_text(bpe, TOOLS, TOOL_REPLY, TurnEnd("eos", endoftext))
    assert text == chat_delta_text(bpe, TOOLS, TOOL_REPLY, TurnEnd("stop"))
    sampled = _ids(bpe, "4") + [endoftext]
    assert bpe.decode(sampled + _ids(bpe, text)).startswith("4<|endoftext|><|im_end|>\n<|im_start|>user\n")


def test_several_tool_results_and_user_feedback(bpe):
    two = [{"role": "tool", "content": "4"}, {"role": "tool", "content": "5", "name": "calc"}]
    assert chat_delta_text(bpe, TOOLS, two, TurnEnd("eos", 2)) == (
        "\n<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\n5\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")
    feedback = [{"role": "user", "content": "Wrong, try again."}]
    assert chat_delta_text(bpe, None, feedback, TurnEnd("eos", 2)) == (
        "\n<|im_start|>user\nWrong, try again.<|im_end|>\n<|im_start|>assistant\n")


def test_a_whole_episode_is_the_templates_text_and_keeps_every_sampled_id(bpe):
    """Tool call (stop), tool result, answer (EOS), user feedback, answer (EOS): every sampled segment sits
    where it was sampled, and the decoded episode is the template's rendering of the conversation."""
    ids = _ids(bpe, _render(bpe, QUESTION))
    turns = [(TOOL_CALL, "stop", TOOL_REPLY), ("3+1=4", "eos", [{"role": "user", "content": "Sure?"}]),
             ("Yes, 4.", "eos", None)]
    conversation, spans = list(QUESTION), []
    for text, end, reply in turns:
        sampled = [i for piece in text.split("+") for i in _ids(bpe, piece) + _ids(bpe, "+")][:-1]  # non-canonical
        sampled += [2] if end == "eos" else []
        spans.append((len(ids), sampled))
        ids += sampled
        conversation.append({"role": "assistant", "content": text})
        if reply:
            ids += chat_delta_ids(bpe, TOOLS, reply, TurnEnd(end, 2 if end == "eos" else None))
            conversation += reply
    assert all(ids[start:start + len(s)] == s for start, s in spans)
    # the last turn ended on its sampled <|im_end|>; the template writes a "\n" after it
    assert bpe.decode(ids) + "\n" == _render(bpe, conversation, generation_prompt=False)
    assert _ids(bpe, bpe.decode(ids)) != ids


# ------------------------------------------------------------------------------------------------------------
# templates that are not prefix-stable


def test_chatml_with_tools_is_prefix_stable(bpe):
    assert prefix_stability_problem(bpe, TOOLS) is None and prefix_stability_problem(bpe, None) is None
    assert {r for case in STABILITY_CASES for r in case} == {"tool", "user"}


def test_template_dropping_earlier_reasoning_at_a_new_user_message_is_refused():
    tok = build_bpe_tokenizer(REASONING_DROPPING_TEMPLATE, name="qwen3-like")
    assert chat_delta_text(tok, TOOLS, TOOL_REPLY, TurnEnd("stop")).startswith("<|im_end|>\n")  # tools: fine
    with pytest.raises(TemplateNotPrefixStable) as err:
        chat_delta_text(tok, TOOLS, [{"role": "user", "content": "Sure?"}], TurnEnd("eos", 2))
    message = str(err.value)
    assert "'qwen3-like' (chat template sha256 " in message and "reply roles ['user']" in message
    assert "drops what the model wrote" in message
    assert "as sampled 'estion.<|im_end|>\\n<|im_start|>assistant\\n<think>\\nBase reasoning" in message
    assert "with the reply 'estion.<|im_end|>\\n<|im_start|>assistant\\nBase answer.<|im_end|>" in message
    problem = prefix_stability_problem(tok, TOOLS)
    assert problem is not None and "reply roles ['user']" in problem and "qwen3-like" in problem
    assert "<think>" in BASE_ASSISTANT_CONTENT


def test_template_stripping_reasoning_from_every_earlier_turn_is_refused_for_tool_replies():
    tok = build_bpe_tokenizer(REASONING_STRIPPING_TEMPLATE, name="r1-like")
    with pytest.raises(TemplateNotPrefixStable, match=r"'r1-like' .*reply roles \['tool'\]"):
        chat_delta_ids(tok, TOOLS, TOOL_REPLY, TurnEnd("stop"))
    assert "reply roles ['tool']" in prefix_stability_problem(tok, TOOLS)


def test_template_closing_the_last_turn_differently_is_refused():
    tok = build_bpe_tokenizer(LAST_TURN_EOS_TEMPLATE, name="sft-eos")
    with pytest.raises(TemplateNotPrefixStable, match="renders a turn differently once more messages follow") as e:
        chat_delta_text(tok, TOOLS, TOOL_REPLY, TurnEnd("eos", 2))
    assert "alone 'ing.\\n</think>\\n\\nBase answer.<|im_end|>\\n<|endoftext|>', with the reply 'ing." in str(e.value)


def test_template_without_a_tool_role_and_tokenizer_without_template():
    tok = build_bpe_tokenizer(NO_TOOL_ROLE_TEMPLATE, name="no-tools")
    with pytest.raises(TemplateRenderError, match=r"'no-tools' .*failed on roles \['user', 'assistant', 'tool'\]: "
                                                  r"TemplateError: only user and assistant roles"):
        chat_delta_text(tok, TOOLS, TOOL_REPLY, TurnEnd("stop"))
    assert "only user and assistant roles" in prefix_stability_problem(tok, TOOLS)
    assert chat_delta_text(tok, TOOLS, [{"role": "user", "content": "x"}], TurnEnd("stop")).endswith("assistant\n")
    plain = build_bpe_tokenizer(chat_template=None, name="plain")
    assert prefix_stability_problem(plain, TOOLS) == "'plain' (chat template sha256 none) has no chat template " \
                                                     "(use the plain mode)"
    with pytest.raises(TemplateRenderError):
        chat_delta_ids(plain, TOOLS, TOOL_REPLY, TurnEnd("stop"))


def test_a_tokenizer_that_cannot_spell_the_templates_text_is_a_problem():
    tok = build_char_tokenizer()  # printable ASCII only
    tok.chat_template = ("{%- for m in messages %}{{- m.role + ' \u2192 ' + m.content + '\\n' }}{%- endfor %}"
                         "{%- if add_generation_prompt %}{{- 'assistant \u2192 ' }}{%- endif %}")
    problem = prefix_stability_problem(tok, None)
    assert problem is not None and "does not survive tokenize -> decode" in problem and "<unk>" in problem


# ------------------------------------------------------------------------------------------------------------
# plain mode: the tiny model's character tokenizer


def test_plain_mode_on_the_character_tokenizer():
    tok = build_char_tokenizer()
    sampled = _ids(tok, "<call>calc 3+4</call>")
    delta = reply_ids(tok, [{"role": "tool", "content": "7"}], TurnEnd("stop"))
    assert delta == [tok.convert_tokens_to_ids(c) for c in "<result>7</result>"]
    assert tok.decode(sampled + delta) == "<call>calc 3+4</call><result>7</result>"
    eos = tok.eos_token_id
    feedback = reply_ids(tok, [{"role": "user", "content": "no"}], TurnEnd("eos", eos))
    assert tok.decode(_ids(tok, "8") + [eos] + feedback, skip_special_tokens=False) == "8<eos><user>no</user>"
    assert plain_delta_ids(tok, [{"role": "tool", "content": "caf\u00e9"}])[-10] == tok.unk_token_id
    assert PLAIN_FORMATS == {"tool": "<result>{content}</result>", "user": "<user>{content}</user>"}


def test_plain_mode_formats_and_forced_modes(bpe):
    two = [{"role": "tool", "content": "1"}, {"role": "user", "content": "2"}]
    assert plain_delta_text(two) == "<result>1</result><user>2</user>"
    assert plain_delta_text(two, {"tool": "[{content}]\n", "user": "U: {content}\n"}) == "[1]\nU: 2\n"
    assert bpe.decode(reply_ids(bpe, two, TurnEnd("stop"), chat=False)) == "<result>1</result><user>2</user>"
    assert reply_ids(bpe, two, TurnEnd("stop"), TOOLS) == chat_delta_ids(bpe, TOOLS, two, TurnEnd("stop"))
    with pytest.raises(ValueError, match=r"reply message 1 must be a dict with role in \('tool',\)"):
        plain_delta_text(two, {"tool": "{content}"})


# ------------------------------------------------------------------------------------------------------------
# inputs


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"),
    ("4", "non-empty list"),
    ([{"role": "assistant", "content": "x"}], r"reply message 0 must be a dict with role in \('tool', 'user'\)"),
    ([{"role": "tool", "content": "4"}, {"role": "system", "content": "x"}], "reply message 1"),
    ([{"role": "tool", "content": 4}], "str content"),
    (["4"], "reply message 0"),
])
def test_malformed_messages(bpe, messages, match):
    with pytest.raises(ValueError, match=match):
        chat_delta_ids(bpe, TOOLS, messages, TurnEnd("stop"))


def test_turn_end():
    assert TurnEnd.from_sampling("length", None, 5) == TurnEnd("length")
    assert TurnEnd.from_sampling("stop", "</tool_call>", 5) == TurnEnd("stop")
    assert TurnEnd.from_sampling("stop", None, 2) == TurnEnd("eos", 2)  # EOS
    assert TurnEnd.from_sampling("stop", 2, 2) == TurnEnd("eos", 2)  # a stop_token_ids token
    with pytest.raises(ValueError, match="'abort'"):
        TurnEnd.from_sampling("abort", None, 2)
    with pytest.raises(ValueError, match="needs its last sampled token id"):
        TurnEnd.from_sampling("stop", None, None)
    with pytest.raises(ValueError, match="kind must be one of eos, stop, length, got 'tool'"):
        TurnEnd("tool")
    with pytest.raises(ValueError, match="exactly when kind='eos'"):
        TurnEnd("eos")
    with pytest.raises(ValueError, match="exactly when kind='eos'"):
        TurnEnd("stop", 2)
