"""Tool-call parsers by format (rollout/tool_calls.py): every well-formed and malformed case, the stop strings,
the error observation text and the counts by kind."""

from __future__ import annotations

import pytest

from rollout import tool_calls
from rollout.tool_calls import (
    ERROR_KINDS,
    TAG_ARGUMENT_KEY,
    ToolCall,
    ToolCallError,
    ToolCallFormat,
    error_counts,
    error_observation,
    get_format,
    parse,
    register_format,
    stop_strings,
)

CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "3+4"}}\n</tool_call>'


def test_formats_and_their_stop_strings():
    assert {"hermes", "tag"} <= set(tool_calls.FORMATS)
    assert stop_strings("hermes") == ["</tool_call>"]
    assert stop_strings("tag") == ["</call>"]
    assert get_format("tag").stop_strings == ("</call>",)


@pytest.mark.parametrize("call", [lambda: parse("json", "x"), lambda: stop_strings("Hermes"),
                                  lambda: get_format(None)])
def test_unknown_format_names_the_known_ones(call):
    with pytest.raises(ValueError, match=r"unknown tool-call format .*known formats: hermes, tag"):
        call()


def test_parse_rejects_text_that_is_not_a_string():
    with pytest.raises(TypeError, match="bytes"):
        parse("hermes", CALL.encode())


# ------------------------------------------------------------------------------------------------------------
# hermes


def test_hermes_one_call_as_sampled_up_to_its_stop_string():
    text = "I will compute it.\n" + CALL
    turn = parse("hermes", text)
    assert turn.calls == [ToolCall("calc", {"expression": "3+4"}, (19, len(text)))]
    assert text[slice(*turn.calls[0].span)] == CALL
    assert turn.errors == [] and turn.content == "I will compute it."


def test_hermes_several_calls_with_content_between_and_after():
    text = ('a <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> b\n'
            '<tool_call> {"name": "g", "arguments": {"y": [1, {"z": null}]}} </tool_call> c')
    turn = parse("hermes", text)
    assert [(c.name, c.arguments) for c in turn.calls] == [("f", {"x": 1}), ("g", {"y": [1, {"z": None}]})]
    assert [text[slice(*c.span)].startswith("<tool_call>") and text[slice(*c.span)].endswith("</tool_call>")
            for c in turn.calls] == [True, True]
    assert turn.content == "a  b\n c" and turn.errors == []


def test_hermes_missing_arguments_mean_none_and_extra_keys_are_ignored():
    turn = parse("hermes", '<tool_call>{"name": "now", "id": 7}</tool_call>')
    assert turn.calls == [ToolCall("now", {}, (0, 47))] and turn.errors == []


@pytest.mark.parametrize("body, kind, message", [
    ('{"name": "calc", "arguments": {"expression": "3+4"},}', "bad_json",
     "not valid JSON (Expecting property name enclosed in double quotes at character 52)"),
    ("", "bad_json", "not valid JSON (Expecting value at character 0)"),
    ('{"name": "calc"} {"name": "calc"}', "bad_json", "not valid JSON (Extra data at character 17)"),
    ('<tool_call>{"name": "calc"}', "bad_json", "not valid JSON (Expecting value at character 0)"),  # nested open
    ('["calc", {}]', "not_an_object", "expected a JSON object, got a JSON list"),
    ('"calc"', "not_an_object", "expected a JSON object, got a JSON str"),
    ('{"arguments": {}}', "missing_name", "\"name\" must be a non-empty string, got 'null'"),
    ('{"name": 3, "arguments": {}}', "missing_name", "\"name\" must be a non-empty string, got '3'"),
    ('{"name": "  ", "arguments": {}}', "missing_name", "\"name\" must be a non-empty string, got '\"  \"'"),
    ('{"name": "calc", "arguments": "{\\"expression\\": \\"3+4\\"}"}', "bad_arguments",
     "\"arguments\" of 'calc' must be a JSON object, got a JSON str"),
    ('{"name": "calc", "arguments": [1]}', "bad_arguments", "\"arguments\" of 'calc' must be a JSON object, got a "
     "JSON list"),
])
def test_hermes_malformed_calls_become_errors(body, kind, message):
    text = f"pre <tool_call>{body}</tool_call> post"
    turn = parse("hermes", text)
    assert turn.calls == []
    assert turn.errors == [ToolCallError(kind, message, (4, len(text) - 5), "hermes",
                                         "calc" if kind == "bad_arguments" else None)]
    assert turn.content == "pre  post"


def test_hermes_unclosed_call_runs_to_the_end_and_keeps_the_calls_before_it():
    text = CALL + ' then <tool_call>{"name": "calc", "argum'  # cut by length (or EOS) inside a call
    turn = parse("hermes", text)
    assert [c.name for c in turn.calls] == ["calc"]
    assert turn.errors == [ToolCallError("unclosed", "<tool_call> without </tool_call>",
                                         (len(CALL) + 6, len(text)), "hermes")]
    assert turn.content == "then"


def test_hermes_stray_closing_tag_is_content():
    turn = parse("hermes", "no call here </tool_call> at all")
    assert turn.calls == [] and turn.errors == [] and turn.content == "no call here </tool_call> at all"


def test_unknown_tool_names_only_when_a_tool_set_is_given():
    text = CALL + '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'
    turn = parse("hermes", text, tool_names={"calc", "python"})
    assert [c.name for c in turn.calls] == ["calc"]
    assert turn.errors == [ToolCallError("unknown_tool", "no tool named 'search' (tools: calc, python)",
                                         (len(CALL), len(text)), "hermes", "search")]
    assert [c.name for c in parse("hermes", text).calls] == ["calc", "search"]  # no set: any name
    assert parse("hermes", CALL, tool_names=[]).errors[0].message == "no tool named 'calc' (tools: none)"


def test_text_without_calls_is_all_content():
    turn = parse("hermes", "  The answer is 7.\n")
    assert turn.calls == [] and turn.errors == [] and turn.content == "The answer is 7."


# ------------------------------------------------------------------------------------------------------------
# tag


@pytest.mark.parametrize("text, name, argument", [
    ("<call>calc 3+4</call>", "calc", "3+4"),
    ("<call>  search   two words here \n</call>", "search", "two words here"),
    ("<call>now</call>", "now", ""),
    ("<call>py\nprint(1 < 2)\nprint(3)</call>", "py", "print(1 < 2)\nprint(3)"),
    ("<call>my_tool.v-2 x</call>", "my_tool.v-2", "x"),
])
def test_tag_calls(text, name, argument):
    turn = parse("tag", "think " + text)
    assert turn.calls == [ToolCall(name, {TAG_ARGUMENT_KEY: argument}, (6, 6 + len(text)))]
    assert TAG_ARGUMENT_KEY == "input" and turn.errors == [] and turn.content == "think"


def test_tag_several_calls():
    turn = parse("tag", "<call>calc 1+1</call>and<call>calc 2+2</call>")
    assert [c.arguments["input"] for c in turn.calls] == ["1+1", "2+2"] and turn.content == "and"


@pytest.mark.parametrize("body, message", [
    ("", "empty call: expected a tool name"),
    ("  \n ", "empty call: expected a tool name"),
    ("3calc 1+1", "'3calc' is not a tool name (letters, digits, _ . -)"),
    ('{"name":"calc"}', "'{\"name\":\"calc\"}' is not a tool name (letters, digits, _ . -)"),
])
def test_tag_without_a_name(body, message):
    turn = parse("tag", f"<call>{body}</call>")
    assert turn.calls == [] and turn.errors == [ToolCallError("missing_name", message, (0, len(body) + 13), "tag")]


def test_tag_unclosed_and_unknown_tool():
    turn = parse("tag", "<call>calc 1+1</call><call>calc 2+", tool_names={"calc"})
    assert [c.arguments for c in turn.calls] == [{"input": "1+1"}]
    assert [(e.kind, e.span) for e in turn.errors] == [("unclosed", (21, 34))]
    turn = parse("tag", "<call>wiki cats</call>", tool_names=("calc",))
    assert [(e.kind, e.name, e.message) for e in turn.errors] == [
        ("unknown_tool", "wiki", "no tool named 'wiki' (tools: calc)")]


def test_tag_format_ignores_the_other_formats_tags():
    turn = parse("tag", CALL)
    assert turn.calls == [] and turn.errors == [] and turn.content == CALL.strip()


# ------------------------------------------------------------------------------------------------------------
# error observations and counts


def test_error_observation_text():
    bad = parse("hermes", "<tool_call>{oops}</tool_call>").errors[0]
    assert error_observation(bad) == (
        "Tool call error (bad_json): not valid JSON (Expecting property name enclosed in double quotes at "
        'character 1). Expected: <tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>')
    unknown = parse("tag", "<call>wiki cats</call>", tool_names={"calc"}).errors[0]
    assert error_observation(unknown) == "Tool call error (unknown_tool): no tool named 'wiki' (tools: calc)."
    unclosed = parse("tag", "<call>calc 1").errors[0]
    assert error_observation(unclosed) == (
        "Tool call error (unclosed): <call> without </call>. Expected: <call>TOOL ARGUMENT</call>")


def test_error_observation_is_short_for_long_model_text():
    name = "x" * 5000
    err = parse("hermes", '<tool_call>{"name": "%s", "arguments": 1}</tool_call>' % name).errors[0]
    text = error_observation(err)
    assert err.kind == "bad_arguments" and len(text) < 250 and "x" * 41 not in text and "xxx..." in text
    many = {f"tool{i:02d}" for i in range(30)}
    text = error_observation(parse("tag", "<call>nope x</call>", tool_names=many).errors[0])
    assert text.endswith("tool10, tool11, ...).") and len(text) < 200


def test_error_observation_rejects_an_unknown_kind():
    with pytest.raises(ValueError, match="'weird' is not one of unclosed, bad_json"):
        error_observation(ToolCallError("weird", "m", (0, 1), "hermes"))


def test_error_counts_have_every_kind():
    errors = parse("hermes", "<tool_call>x</tool_call><tool_call>[]</tool_call><tool_call>{}</tool_call>"
                             "<tool_call>y</tool_call><tool_call>").errors
    assert error_counts(errors) == {"unclosed": 1, "bad_json": 2, "not_an_object": 1, "missing_name": 1,
                                    "bad_arguments": 0, "unknown_tool": 0}
    assert list(error_counts([])) == list(ERROR_KINDS) and sum(error_counts([]).values()) == 0


# ------------------------------------------------------------------------------------------------------------
# the registry


def test_register_a_format(monkeypatch):
    monkeypatch.setattr(tool_calls, "FORMATS", dict(tool_calls.FORMATS))

    def read(body):
        return body.strip(), {}

    register_format(ToolCallFormat("bang", "!!", ";;", "!!TOOL;;", read))
    assert parse("bang", "a !!ping;; b").calls == [ToolCall("ping", {}, (2, 10))]
    assert stop_strings("bang") == [";;"]
    with pytest.raises(ValueError, match="'bang' is already registered"):
        register_format(ToolCallFormat("bang", "!!", ";;", "", read))
    with pytest.raises(ValueError, match="needs non-empty tags"):
        register_format(ToolCallFormat("empty", "", "</x>", "", read))
