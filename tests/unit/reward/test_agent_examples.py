"""The example agent programs of ``reward/envs/`` (MCP, CLI harness, OpenAI Agents SDK, summarising) run
unmodified against the real session gateway served in-process, with a script in the driver's place
(``tests.helpers.gateway_script``): what each sends over HTTP, and how its session ends."""

from __future__ import annotations

import psutil
import pytest

from rollout.openai_protocol import Reply
from tests.helpers.gateway_script import call_reply, play, text_reply

ROW = {"prompt": "What is 6*7?", "answer": "42"}


def _mcp_servers() -> list[psutil.Process]:
    """This process's descendants that are the calculator's MCP server."""
    return [p for p in psutil.Process().children(recursive=True)
            if "reward.envs.mcp_calc_server" in " ".join(p.cmdline())]


def test_mcp_agent_calls_the_servers_tool_and_sends_back_its_result():
    from reward.envs import mcp_agent

    servers: list[psutil.Process] = []

    def answer_while_the_server_runs(request: dict) -> Reply:
        servers.extend(_mcp_servers())
        return text_reply("The answer is 42.")

    played = play(mcp_agent.run, ROW, [call_reply("calc", expression="2**3"), call_reply("calc", expression="6*7"),
                                       answer_while_the_server_runs])
    first, second, third = played.requests
    tool = first["tools"][0]["function"]
    assert tool["name"] == "calc" and tool["parameters"]["required"] == ["expression"]
    assert "+, - and *" in tool["description"]
    error = second["messages"][-1]
    assert error["role"] == "tool" and "only integers, + - * and parentheses" in error["content"]
    assert third["messages"][-1] == {"role": "tool", "content": "42", "tool_call_id": "call_scripted-2_0"}
    assert third["messages"][:len(second["messages"])] == second["messages"]
    assert played.end == {"kind": "end", "reward": None, "status": "ok", "error": None}
    assert played.agent_done and played.exhausted == 0
    assert len(servers) == 1, "the MCP server was not running during the episode"
    assert not servers[0].is_running(), "the MCP server outlived its episode"


@pytest.mark.parametrize("answer,reward", [("It is 42.", 1.0), ("It is 41.", 0.0)])
def test_cli_agent_program_closes_its_session_with_its_own_reward(answer, reward):
    from reward.envs import cli_agent

    played = play(cli_agent.run, ROW, [call_reply("calc", expression="6*7"), text_reply(answer)])
    assert [r["messages"][-1]["role"] for r in played.requests] == ["user", "tool"]
    assert played.requests[1]["messages"][-1]["content"] == "42"
    # the program's own close, not the runner's (whose reward would be None): a session takes one close
    assert played.end == {"kind": "end", "reward": reward, "status": "ok", "error": None}
    assert played.agent_done and played.exhausted == 0


def test_cli_agent_program_that_fails_ends_its_episode_as_an_error():
    from reward.envs import cli_agent

    played = play(cli_agent.run, ROW, [])  # its first request fails (503): the program exits with 1
    assert played.exhausted == 1
    assert played.end["status"] == "error" and "calc_cli exited with status 1" in played.end["error"]


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_openai_agents_sdk_agent_runs_its_tool_and_ends_on_its_answer(api):
    from reward.envs import sdk_agent

    fn = sdk_agent.run if api == "responses" else sdk_agent.run_chat
    played = play(fn, ROW, [call_reply("calc", expression="6*7"), text_reply("It is 42.")])
    first, second = played.requests
    assert [r["api"] for r in played.requests] == [api, api]
    assert first["messages"] == [{"role": "system", "content": sdk_agent.INSTRUCTIONS},
                                 {"role": "user", "content": ROW["prompt"]}]
    assert first["tools"][0]["function"]["name"] == "calc"
    assert second["messages"][:2] == first["messages"]
    assert second["messages"][2]["tool_calls"][0]["function"]["name"] == "calc"
    assert second["messages"][3] == {"role": "tool", "content": "42", "tool_call_id": "call_scripted-1_0"}
    # no request after the answer: the last sampled turn, which the verifier scores, is the final output
    assert played.end == {"kind": "end", "reward": None, "status": "ok", "error": None}
    assert played.agent_done and played.exhausted == 0


def test_openai_agents_sdk_final_output_is_the_last_reply():
    from reward.envs import sdk_agent

    outputs = []

    async def agent(row, client):
        outputs.append(await sdk_agent.answer(row["prompt"], client, "chat", max_turns=2))
        outputs.append(await sdk_agent.answer(row["prompt"], client, "chat", max_turns=1))

    played = play(agent, ROW, [call_reply("calc", expression="6*7"), text_reply("It is 42."),
                               call_reply("calc", expression="6*7")])
    assert outputs == ["It is 42.", None] and len(played.requests) == 3


def test_summarising_agent_forks_its_session_after_k_turns():
    from reward.envs import summary_agent
    from rollout.gateway_session import continuation
    from rollout.openai_protocol import assistant_message, tool_call_id

    script = [call_reply("calc", expression="6*7"), call_reply("calc", expression="42+8"),
              call_reply("calc", expression="50*2"), text_reply("It is 100.")]
    played = play(lambda row, client: summary_agent.run(row, client, k=2), {"prompt": "What is (6*7+8)*2?"}, script)
    requests = [r["messages"] for r in played.requests]
    assert len(requests) == 4 and played.end["status"] == "ok"
    # what the gateway's branch stands for after each request: its messages and the assistant turn returned
    known = [m + [assistant_message(reply, [tool_call_id(f"scripted-{i + 1}", 0)])]
             for i, (m, reply) in enumerate(zip(requests, script))]
    assert continuation(known[0], requests[1]) == [requests[1][-1]]
    assert continuation(known[1], requests[2]) is None, "the summary should fork the session"
    assert continuation(known[2], requests[3]) == [requests[3][-1]]
    assert requests[2] == [summary_agent.summary("What is (6*7+8)*2?", [
        'calc({"expression": "6*7"}) returned 42', 'calc({"expression": "42+8"}) returned 50'])]
