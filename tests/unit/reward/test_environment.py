"""The environment interface (``reward.environment``): its defaults, tool schemas from typed docstring'd tools
and the error naming a tool without them, tool calls as observations (errors included), the tools-only
environment scored by a verifier, reward checks and the ``module:name`` resolver."""

from __future__ import annotations

import math
import pickle

import pytest

from reward.environment import (
    Environment,
    StepResult,
    ToolsEnvironment,
    ToolSchemaError,
    episode_reward,
    load_environment_class,
    load_tools,
    resolve_user_object,
    run_tool_call,
    tool,
    tool_schema,
    tool_schemas,
)
from reward.verifiers import get_verifier
from rollout.contracts import PromptRow
from tests.helpers.envs import Scripted, UndocumentedTool, add, row

H = "tests.helpers.envs"


class Plain(Environment):
    """Only the required method."""

    def reward(self) -> float:
        return 0.0


def test_defaults_prompt_as_user_message_no_tools_done_without_calls_and_no_reward():
    env = Plain(row("d1", prompt="What is 2+3?"), 7)
    assert env.seed == 7 and env.row["uid"] == "d1"
    assert env.initial_messages() == [{"role": "user", "content": "What is 2+3?"}]
    assert env.tools() == []
    result = env.step("It is 5.", [])
    assert result == StepResult([], done=True, reward=None, tool_errors={})
    env.close()  # the default does nothing and does not raise
    class NoReward(Environment):
        pass

    with pytest.raises(NotImplementedError, match="NoReward.reward"):
        NoReward(row("d2"), 0).reward()


def test_a_prompt_row_dataclass_is_accepted_and_the_seed_must_be_an_int():
    pr = PromptRow(uid="p", prompt="Say hi.", prompt_token_ids=[1, 2], answer="hi")
    assert Plain(pr, 1).initial_messages() == [{"role": "user", "content": "Say hi."}]
    with pytest.raises(TypeError, match="seed must be an int"):
        Plain(pr, True)
    with pytest.raises(TypeError, match="seed must be an int"):
        Plain(pr, "3")


def test_tools_default_to_the_public_tool_methods_bound_in_definition_order():
    env = Scripted(row("t1"), 0)
    tools = env.tools()
    assert [t.__name__ for t in tools] == ["add", "fail", "wait"]  # `helper` is public but not a @tool
    assert all(t.__self__ is env for t in tools)

    class Child(Scripted):
        def fail(self, reason: str) -> str:  # overridden without @tool: no longer a tool
            return reason

        @tool
        def mul(self, a: int, b: int) -> int:
            """Multiply.

            Args:
                a: one
                b: other
            """
            return a * b

    assert [t.__name__ for t in Child(row("t2"), 0).tools()] == ["add", "wait", "mul"]


def test_tool_decorator_refuses_private_names():
    with pytest.raises(ToolSchemaError, match="_secret"):
        @tool
        def _secret(x: int) -> int:
            """Nope.

            Args:
                x: a number
            """
            return x


def test_schemas_come_from_type_hints_and_google_docstrings():
    env = Scripted(row("s1"), 0)
    schemas = tool_schemas(env.tools())
    assert schemas[0] == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "description": "the first integer"},
                               "b": {"type": "integer", "description": "the second integer"}},
                "required": ["a", "b"],
            },
            "return": {"type": "integer"},
        },
    }
    assert schemas[2]["function"]["parameters"]["properties"]["seconds"]["type"] == "number"
    assert tool_schema(add) == {**schemas[0]}  # a function and a bound method of the same shape agree
    schemas[0]["function"]["name"] = "changed"
    assert tool_schema(env.add)["function"]["name"] == "add"  # each caller gets its own copy of the cache
    pickle.dumps(schemas)


@pytest.mark.parametrize("name, missing", [
    ("untyped", "missing a type hint"),
    ("undocumented_arg", "no description for the argument 'b'"),
])
def test_a_tool_without_type_hints_or_argument_docs_is_refused_by_name(name, missing):
    from tests.helpers import envs

    with pytest.raises(ToolSchemaError, match=name) as err:
        tool_schema(getattr(envs, name))
    assert missing in str(err.value) and "Google-style docstring" in str(err.value)


def test_a_tool_method_without_a_docstring_is_refused_by_name():
    with pytest.raises(ToolSchemaError, match="UndocumentedTool.shout.*no docstring"):
        tool_schemas(UndocumentedTool(row("u1"), 0).tools())


def test_two_tools_of_one_name_are_refused():
    with pytest.raises(ToolSchemaError, match=r"\['add'\].*more than once"):
        tool_schemas([add, Scripted(row("n1"), 0).add])


def test_tool_calls_become_observations_and_errors_go_back_to_the_model():
    env = Scripted(row("c1"), 0)
    calls = [
        {"name": "add", "arguments": {"a": 2, "b": 3}},
        {"name": "add", "arguments": '{"a": 4, "b": 5}'},  # arguments as a JSON string
        {"name": "fail", "arguments": {"reason": "disk on fire"}},
        {"name": "mul", "arguments": {}},
        {"name": "add", "arguments": {"a": 1}},
        {"name": "add", "arguments": "not json"},
        {"name": "add", "arguments": [1, 2]},
        {"arguments": {}},
    ]
    result = env.step("calling", calls)
    contents = [m["content"] for m in result.messages]
    assert result.done is False and len(result.messages) == len(calls)
    assert result.messages[0] == {"role": "tool", "name": "add", "content": "5"}
    assert contents[1] == "9"
    assert contents[2] == "Error: RuntimeError: disk on fire" and result.messages[2]["name"] == "fail"
    assert contents[3].startswith("Error: unknown tool 'mul'; the tools are: add, fail, wait")
    assert "missing a required argument: 'b'" in contents[4]
    assert "not valid JSON" in contents[5] and "must be an object" in contents[6]
    assert "name" not in result.messages[7] and contents[7].startswith("Error: unknown tool None")
    assert result.tool_errors == {"raised": 1, "unknown_tool": 2, "bad_arguments": 3}
    assert all(m["role"] == "tool" for m in result.messages)


def test_a_type_error_inside_a_tool_is_raised_not_bad_arguments():
    def picky(x: int) -> int:
        """Picky.

        Args:
            x: a number
        """
        return x + "1"

    message, kind = run_tool_call({"name": "picky", "arguments": {"x": 1}}, {"picky": picky})
    assert kind == "raised" and message["content"].startswith("Error: TypeError: unsupported operand")


def test_a_calls_arguments_are_read_one_way():
    from reward.environment import call_arguments

    assert call_arguments("f", {"a": 1}) == {"a": 1}
    assert call_arguments("f", '{"a": 1}') == {"a": 1}  # the OpenAI wire form
    assert call_arguments("f", None) == {} and call_arguments("f", "  ") == {}
    with pytest.raises(ValueError, match="arguments of 'f' are not valid JSON"):
        call_arguments("f", "{a")
    with pytest.raises(ValueError, match=r"arguments of 'f' must be an object, got \[1\]"):
        call_arguments("f", "[1]")


def test_a_tool_error_observation_is_truncated():
    def loud(n: int) -> str:
        """Loud.

        Args:
            n: how loud
        """
        raise ValueError("x" * n)

    message, kind = run_tool_call({"name": "loud", "arguments": {"n": 10_000}}, {"loud": loud})
    assert kind == "raised" and len(message["content"]) == 500


def test_tools_environment_scores_the_final_answer_with_the_rows_verifier():
    exact = get_verifier("exact")
    env = ToolsEnvironment(row("v1", answer="5"), 3, [add], exact)
    assert [t.__name__ for t in env.tools()] == ["add"]
    first = env.step("<tool_call>add</tool_call>", [{"name": "add", "arguments": {"a": 2, "b": 3}}])
    assert first.messages == [{"role": "tool", "name": "add", "content": "5"}] and not first.done
    assert env.reward() == 0.0  # the tool call turn is not the answer
    final = env.step("#### 5", [])
    assert final.done and env.final_text == "#### 5" and env.reward() == 1.0
    wrong = ToolsEnvironment(row("v2", answer="5"), 3, [add], exact)
    wrong.step("#### 6", [])
    assert wrong.reward() == 0.0


def test_tools_environment_reads_a_dict_verdict_and_refuses_junk_as_the_reward_worker_does():
    from tests.helpers.userfns import half_with_extra, returns_junk

    env = ToolsEnvironment(row("v3"), 0, [add], half_with_extra)
    env.step("anything", [])
    assert env.reward() == 0.5
    junk = ToolsEnvironment(row("v4"), 0, [add], returns_junk)
    junk.step("nan", [])
    with pytest.raises(ValueError, match="InvalidScore"):
        junk.reward()


def test_episode_reward_of_floats_and_components():
    assert episode_reward(1) == (1.0, {})
    assert episode_reward({"a": 0.5, "b": 0.25}) == (0.75, {"a": 0.5, "b": 0.25})
    for bad in (True, math.nan, math.inf, {}, {"a": math.nan}, {1: 1.0}, {"a": "1"}, None, "1"):
        with pytest.raises(ValueError, match="finite number"):
            episode_reward(bad)


def test_user_objects_resolve_by_name_with_errors_naming_the_key():
    assert resolve_user_object(f"{H}:add", "env.tools[0]") is add
    assert load_environment_class(f"{H}:Scripted") is Scripted
    assert load_tools([f"{H}:add"]) == [add]
    with pytest.raises(ValueError, match=r"env.cls='no_such_module_xyz:E': cannot import module"):
        load_environment_class("no_such_module_xyz:E")
    with pytest.raises(ValueError, match=r"env.cls='tests.helpers.envs:Nope': module .* has no 'Nope'"):
        load_environment_class(f"{H}:Nope")
    with pytest.raises(ValueError, match="not a subclass of reward.environment.Environment"):
        load_environment_class(f"{H}:add")
    with pytest.raises(ValueError, match="set env.tools"):
        load_environment_class("reward.environment:ToolsEnvironment")
    with pytest.raises(ValueError, match="must be 'module.path:name'"):
        resolve_user_object("justaname", "env.cls")
    with pytest.raises(ValueError, match=r"env.tools\[1\]='tests.helpers.envs:NOT_A_FUNCTION'.*not a function"):
        load_tools([f"{H}:add", f"{H}:NOT_A_FUNCTION"])
    with pytest.raises(ToolSchemaError, match=r"env.tools\[0\]='tests.helpers.envs:untyped'.*missing a type hint"):
        load_tools([f"{H}:untyped"])
