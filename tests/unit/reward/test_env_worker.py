"""The env worker (``reward.env_worker``): episodes from start to outcome, the same seed giving the same
initial state, failures of the environment ending only their episode (``close`` still called), tool calls past
the deadline (status timeout, the abandoned thread counted until it returns), what goes back to the model,
the turn limit, ``on_error``; and the ``env`` config section (``reward.config.EnvConfig``)."""

from __future__ import annotations

import math
import pickle
import time

import pytest
from pydantic import ValidationError

from reward.config import EnvConfig, RewardConfig
from reward.env_worker import EnvOutcome, EnvStart, EnvStep, EnvWorker, UnknownEpisode
from reward.environment import ToolSchemaError
from tests.helpers.envs import EVENTS, release, row

H = "tests.helpers.envs"
ADD = {"name": "add", "arguments": {"a": 2, "b": 3}}


def scripted(**kw) -> EnvWorker:
    return EnvWorker(EnvConfig(cls=f"{H}:Scripted", **kw))


def test_an_episode_from_start_to_outcome():
    w = scripted()
    start = w.start("e1", row("w1"), seed=5)
    assert isinstance(start, EnvStart) and start.status == "ok"
    assert start.messages[1] == {"role": "user", "content": "Add 2 and 3."}
    assert [s["function"]["name"] for s in start.tool_schemas] == ["add", "fail", "wait"]
    assert w.open_episodes() == ["e1"]
    step = w.step("e1", "<tool_call>...</tool_call>", [ADD], [])
    assert isinstance(step, EnvStep)
    assert (step.messages, step.done, step.reward, step.status, step.tool_errors) == (
        [{"role": "tool", "name": "add", "content": "5"}], False, 0.5, "ok", {})
    assert step.seconds >= 0.0
    last = w.step("e1", "It is 5.", [], [])
    assert last.done and last.status == "ok" and last.messages == []
    out = w.finish("e1")
    assert isinstance(out, EnvOutcome)
    assert (out.reward, out.components, out.status, out.turns, out.correct) == (
        1.5, {"base": 1.0, "per_turn": 0.5}, "ok", 2, True)
    assert EVENTS["w1"] == ["init", "initial_messages", "tools", "step", "tools", "step", "tools", "reward", "close"]
    assert w.open_episodes() == []
    for result in (start, step, out):
        assert pickle.loads(pickle.dumps(result)) == result
    m = w.metrics()
    assert (m["env/episodes"], m["env/ok"], m["env/turns"], m["env/abandoned_threads"]) == (1, 1, 2, 0)
    assert m["env/time_s"] > 0 and w.metrics() == {"env/abandoned_threads": 0.0}  # reset by the read


def test_the_same_seed_gives_the_same_initial_state():
    w = scripted()
    a, b, c = (w.start(f"s{i}", row(f"seed{i}"), seed) for i, seed in enumerate((11, 11, 12)))
    assert a.messages == b.messages and a.messages != c.messages
    for i in range(3):
        w.abort(f"s{i}")


def test_an_environment_whose_step_raises_ends_that_episode_with_error_and_is_closed():
    w = scripted(on_error="zero")
    w.start("bad", row("r1", raise_in="step"), 0)
    w.start("good", row("r2"), 0)
    step = w.step("bad", "text", [ADD], [])
    assert step.done and step.status == "error" and step.messages == []
    assert step.detail == {"error": "RuntimeError", "message": "scripted failure in step", "method": "step"}
    assert EVENTS["r1"][-1] == "close"  # closed at once, not at finish
    assert w.step("bad", "again", [], []).status == "error"  # an episode over does not call the env again
    assert EVENTS["r1"].count("step") == 1
    assert w.step("good", "text", [ADD], []).status == "ok"  # the other episode goes on
    out = w.finish("bad")
    assert (out.reward, out.status, out.components, out.correct) == (0.0, "error", {}, False)
    assert out.detail["method"] == "step" and EVENTS["r1"].count("close") == 1
    assert w.metrics()["env/errors"] == 1
    w.abort("good")


@pytest.mark.parametrize("method", ["init", "initial_messages", "tools"])
def test_a_start_that_raises_is_an_error_episode_scored_as_on_error_says(method):
    w = scripted(on_error="drop")
    start = w.start("e", row(f"st-{method}", raise_in=method), 0)
    assert start.status == "error" and start.messages == [] and start.detail["method"] == "start"
    assert "scripted failure" in start.detail["message"]
    assert ("close" in EVENTS[f"st-{method}"]) == (method != "init")  # an env that was built is closed
    out = w.finish("e")
    assert out.status == "error" and math.isnan(out.reward)


def test_a_reward_that_raises_or_is_not_a_number_is_an_error_and_the_env_is_closed():
    w = scripted()
    w.start("a", row("rw1", raise_in="reward"), 0)
    w.start("b", row("rw2", reward={"x": float("nan")}), 0)
    out_a, out_b = w.finish("a"), w.finish("b")
    assert out_a.status == "error" and out_a.detail["method"] == "reward" and out_a.reward == 0.0
    assert out_b.status == "error" and "finite number" in out_b.detail["message"]
    assert EVENTS["rw1"][-1] == "close" and EVENTS["rw2"][-1] == "close"


def test_a_close_that_raises_keeps_the_reward_and_is_counted():
    w = scripted()
    w.start("c", row("cl1", raise_in="close"), 0)
    out = w.finish("c")
    assert out.status == "cut" and out.reward == 1.0  # finished before it said done: scored as it stands
    assert out.detail["close"]["error"] == "RuntimeError"
    assert w.metrics()["env/close_errors"] == 1


def test_a_tool_past_the_deadline_ends_the_episode_with_timeout_and_its_thread_is_counted():
    w = scripted(tool_timeout_s=0.2)
    w.start("slow", row("to1"), 0)
    step = w.step("slow", "waiting", [ADD, {"name": "wait", "arguments": {"seconds": 30}}], [])
    try:
        assert step.done and step.status == "timeout" and step.detail["method"] == "step"
        assert step.detail["message"] == "tool 'wait' did not return within 0.2 s (its thread is abandoned)"
        assert w.abandoned_threads() == 1
        assert EVENTS["to1"][-1] == "close"  # closed while the abandoned call still runs
        out = w.finish("slow")
        assert out.status == "timeout" and out.reward == 0.0
        m = w.metrics()
        assert m["env/timeouts"] == 1 and m["env/abandoned_threads"] == 1
    finally:
        release("to1")
    deadline = time.monotonic() + 30
    while w.abandoned_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.abandoned_threads() == 0  # it returned by itself: no longer held


def test_an_environment_hanging_in_its_own_step_code_is_a_timeout():
    w = scripted(tool_timeout_s=0.2)
    w.start("hs", row("to3", hang_in="step"), 0)
    try:
        step = w.step("hs", "x", [], [])
        assert step.status == "timeout" and "step did not return within 0.2 s" in step.detail["message"]
        assert w.abandoned_threads() == 1 and EVENTS["to3"][-1] == "close"
    finally:
        release("to3")


def test_a_step_that_catches_exception_cannot_swallow_a_tool_timeout():
    w = EnvWorker(EnvConfig(cls=f"{H}:Forgiving", tool_timeout_s=0.2))
    w.start("f", row("to4"), 0)
    try:
        step = w.step("f", "x", [{"name": "wait", "arguments": {"seconds": 30}}], [])
        assert step.status == "timeout" and w.finish("f").status == "timeout"
    finally:
        release("to4")


def test_a_hanging_start_is_a_timeout():
    w = scripted(tool_timeout_s=0.2)
    try:
        start = w.start("h", row("to2", hang_in="initial_messages"), 0)
        assert start.status == "timeout" and w.abandoned_threads() == 1
        assert w.finish("h").status == "timeout"
    finally:
        release("to2")


def test_parse_errors_go_back_to_the_model_and_a_turn_of_only_parse_errors_does_not_end_it():
    w = scripted()
    w.start("p", row("pe1"), 0)
    step = w.step("p", "<tool_call>{oops</tool_call>", [], ["Expecting value: line 1 column 2"])
    assert not step.done and step.tool_errors == {"parse": 1}
    assert step.messages == [{"role": "tool", "content": "Error: the tool call could not be parsed: "
                                                          "Expecting value: line 1 column 2"}]
    step = w.step("p", "mixed", [{"name": "fail", "arguments": {"reason": "no"}}], ["bad json"])
    assert [m["content"][:25] for m in step.messages] == ["Error: the tool call coul", "Error: RuntimeError: no"]
    assert step.tool_errors == {"parse": 1, "raised": 1} and step.status == "ok" and not step.done
    assert w.metrics()["env/tool_errors/raised"] == 1
    w.abort("p")


def test_the_turn_limit_ends_the_episode_and_it_is_still_scored():
    w = scripted(max_turns=2)
    w.start("m", row("mt1"), 0)
    assert w.step("m", "t1", [ADD], []).status == "ok"
    last = w.step("m", "t2", [ADD], [])
    assert last.done and last.status == "max_turns" and last.messages[0]["content"] == "5"
    out = w.finish("m")
    assert out.status == "max_turns" and out.reward == 1.5 and out.turns == 2


def test_a_step_that_breaks_the_contract_is_an_error():
    w = EnvWorker(EnvConfig(cls=f"{H}:BadStep"))
    w.start("b", row("bs1"), 0)
    step = w.step("b", "x", [], [])
    assert step.status == "error" and "must return a StepResult" in step.detail["message"]


def test_a_tool_without_a_schema_is_a_config_error_raised_by_start():
    w = EnvWorker(EnvConfig(cls=f"{H}:UndocumentedTool"))
    with pytest.raises(ToolSchemaError, match="shout"):
        w.start("u", row("us1"), 0)
    assert w.open_episodes() == []


def test_tools_config_runs_a_tools_environment_scored_by_the_rows_verifier():
    w = EnvWorker(EnvConfig(tools=[f"{H}:add"]), RewardConfig())
    start = w.start("t", row("tt1", answer="5"), 0)
    assert start.messages == [{"role": "user", "content": "Add 2 and 3."}]
    assert [s["function"]["name"] for s in start.tool_schemas] == ["add"]
    assert w.step("t", "call", [ADD], []).messages[0]["content"] == "5"
    assert w.step("t", "#### 5", [], []).done
    out = w.finish("t")
    assert (out.reward, out.status, out.correct) == (1.0, "ok", True)
    w.start("u", row("tt2", answer="5", verifier="no_such_verifier"), 0)  # the row's unknown verifier: an error
    assert w.finish("u").status == "error"


def test_worker_construction_refuses_bad_config():
    with pytest.raises(ValueError, match="env section is off"):
        EnvWorker(EnvConfig())
    with pytest.raises(ToolSchemaError, match=r"env.tools\[0\]"):
        EnvWorker(EnvConfig(tools=[f"{H}:undocumented_arg"]))
    with pytest.raises(ValueError, match="not a subclass"):
        EnvWorker(EnvConfig(cls=f"{H}:add"))


def test_unknown_and_duplicate_episode_ids():
    w = scripted()
    w.start("x", row("id1"), 0)
    with pytest.raises(ValueError, match="already open"):
        w.start("x", row("id1"), 0)
    with pytest.raises(UnknownEpisode, match="'nope'"):
        w.step("nope", "", [], [])
    with pytest.raises(UnknownEpisode):
        w.finish("nope")
    assert w.abort("x") is True and w.abort("x") is False and EVENTS["id1"][-1] == "close"
    w.start("y", row("id2"), 0)
    w.close()
    assert w.open_episodes() == [] and EVENTS["id2"][-1] == "close"


def test_env_config_validation_names_the_field_and_value():
    assert not EnvConfig().enabled and EnvConfig(cls="m:C").enabled and EnvConfig(tools=["m:f"]).enabled
    cases = [
        (dict(cls="m:C", tools=["m:f"]), r"env.cls='m:C' and env.tools=\['m:f'\] are both set"),
        (dict(cls="m.C"), "env.cls='m.C' must be 'module.path:name'"),
        (dict(tools=["m:f", ":g"]), r"env.tools\[1\]=':g' must be"),
        (dict(tools=["m:f", "m:f"]), "more than once"),
        (dict(max_turns=0), "max_turns"),
        (dict(tool_timeout_s=0), "tool_timeout_s"),
        (dict(tool_timeout_s=float("inf")), "tool_timeout_s"),
        (dict(on_error="skip"), "on_error"),
        (dict(tool_format=""), "env.tool_format=''"),
        (dict(unknown_key=1), "unknown_key"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValidationError, match=message):
            EnvConfig(**kwargs)
    cfg = EnvConfig(tools=["m:f"])
    with pytest.raises(ValidationError, match="both set"):
        cfg.cls = "m:C"  # checked on assignment too


def test_episodes_on_one_worker_can_be_driven_from_several_threads_at_once():
    """As a Ray actor with max_concurrency > 1: calls for different episodes interleave."""
    from concurrent.futures import ThreadPoolExecutor

    w = scripted()

    def episode(i: int) -> EnvOutcome:
        w.start(f"t{i}", row(f"thr{i}"), i)
        for _ in range(i % 3 + 1):
            assert w.step(f"t{i}", "call", [ADD], []).messages[0]["content"] == "5"
        w.step(f"t{i}", "done", [], [])
        return w.finish(f"t{i}")

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(episode, range(16)))
    assert [o.turns for o in outcomes] == [i % 3 + 2 for i in range(16)]
    assert [o.reward for o in outcomes] == [1.0 + 0.25 * (i % 3 + 2) for i in range(16)]
    m = w.metrics()
    assert (m["env/episodes"], m["env/turns"], w.open_episodes()) == (16, sum(i % 3 + 2 for i in range(16)), [])
