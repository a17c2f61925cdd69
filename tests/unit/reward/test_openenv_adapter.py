"""The OpenEnv adapter's parts that need no server (``reward.openenv_env``): the model's tool built from an action's
JSON schema, observations as text, and the ``env.openenv`` config section. The adapter against a real server:
``tests/integration/test_openenv.py``."""

from __future__ import annotations

import inspect

import pytest
from pydantic import ValidationError

from reward.config import EnvConfig
from reward.environment import tool_schema
from reward.openenv_env import render, tool_function
from reward.openenv_server import OpenEnvStartError

ACTION = {  # what pydantic gives for an openenv Action with these fields (metadata is the base class's)
    "description": "Move a piece.",
    "properties": {
        "metadata": {"type": "object", "description": "Additional metadata for the action"},
        "square": {"type": "string", "description": "the target square, e.g. e4"},
        "steps": {"type": "integer", "description": "how far"},
        "promote": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "Promote"},
        "side": {"enum": ["white", "black"], "type": "string", "description": "whose move"},
    },
    "required": ["square", "steps", "side"],
    "title": "MoveAction",
    "type": "object",
}


def test_the_tool_is_the_actions_fields_typed_and_described():
    fn = tool_function("move", None, ACTION)
    schema = tool_schema(fn)["function"]
    assert schema["name"] == "move" and schema["description"] == "Move a piece."
    props = schema["parameters"]["properties"]
    assert list(props) == ["square", "steps", "promote", "side"]  # metadata is not the model's to fill
    assert props["square"] == {"type": "string", "description": "the target square, e.g. e4"}
    assert props["steps"] == {"type": "integer", "description": "how far"}
    assert props["promote"] == {"type": "string", "nullable": True, "description": "Promote"}
    assert props["side"]["enum"] == ["white", "black"]
    assert sorted(schema["parameters"]["required"]) == ["side", "square", "steps"]
    assert tool_schema(tool_function("go", "Go  somewhere.\n now", ACTION))["function"]["description"] == \
        "Go somewhere. now"


def test_the_tool_sends_only_the_arguments_given():
    sent = []

    class Episode:
        def act(self, arguments):
            sent.append(arguments)
            return "ok"

    fn = tool_function("move", None, ACTION)
    bound = fn.__get__(Episode())
    assert bound(square="e4", steps=2, side="white") == "ok" and sent == [{"square": "e4", "steps": 2,
                                                                            "side": "white"}]
    with pytest.raises(TypeError):  # the env worker checks a call's arguments against this signature first
        inspect.signature(bound).bind(square="e4", steps=2, side="white", colour="red")
    with pytest.raises(TypeError):
        inspect.signature(bound).bind(square="e4")


def test_an_action_without_fields_is_refused():
    with pytest.raises(OpenEnvStartError, match="no fields besides metadata"):
        tool_function("act", None, {"properties": {"metadata": {"type": "object"}}})


def test_observations_as_text():
    assert render({"message": "higher"}, None) == "higher"  # the only field
    assert render({"message": "higher", "n": 3}, None) == '{"message": "higher", "n": 3}'
    assert render({"message": "higher", "n": 3}, "n") == "3"
    assert render({"board": [[1, 2]]}, None) == "[[1, 2]]"
    with pytest.raises(ValueError, match=r"observation_key='text' is not a field.*\['message', 'n'\]"):
        render({"message": "higher", "n": 3}, "text")
    with pytest.raises(ValueError, match="must be a JSON object"):
        render(["x"], None)


def test_openenv_config_names_the_field_and_value():
    assert EnvConfig(openenv={"app": "m:app"}).enabled and EnvConfig(openenv={"url": "http://h:1"}).enabled
    assert not EnvConfig().openenv.enabled
    cases = [
        ({"openenv": {"app": "m:app", "url": "http://h:1"}}, "are both set"),
        ({"openenv": {"app": "m.app"}}, "env.openenv.app='m.app' must be 'module.path:app'"),
        ({"openenv": {"url": "h:1"}}, "env.openenv.url='h:1' must start with http://"),
        ({"openenv": {"app": "m:app", "tool_name": "a b"}}, "tool_name='a b' must be a Python identifier"),
        ({"openenv": {"app": "m:app"}, "cls": "m:C"}, "set exactly one way"),
        ({"openenv": {"app": "m:app", "prompt": "both"}}, "prompt"),
        ({"openenv": {"app": "m:app", "reward": "mean"}}, "reward"),
        ({"openenv": {"app": "m:app", "start_timeout_s": 0}}, "start_timeout_s"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValidationError, match=message):
            EnvConfig(**kwargs)
