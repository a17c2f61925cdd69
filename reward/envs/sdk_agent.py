"""The calculator agent on the OpenAI Agents SDK (``openai-agents``), unmodified:
``env.agent: reward.envs.sdk_agent:run`` (the Responses API, the SDK's default) or ``...:run_chat`` (Chat
Completions).

An ``Agent`` with one function tool (``reward.envs.calculator.calc``; a bad expression reaches the model as the
SDK's tool-error text) on a model bound to the episode's ``AsyncOpenAI`` client, run by ``Runner.run``. Tracing
is off (it would post traces to OpenAI). ``run`` returns None: the row's verifier scores the last assistant
message, which is the SDK's ``final_output``, the first turn without tool calls. (With
``tool_use_behavior="stop_on_first_tool"`` the final output would be the tool's result and the last sampled
turn the call: return the reward from ``final_output`` yourself then.) A run out of turns is not an error here:
the verifier scores what the model said last, as for ``reward/envs/calc_agent.py``.

The SDK takes about 6 s to import, so it is imported in the function, on the env worker.
"""

from __future__ import annotations

from reward.envs.calculator import calc

INSTRUCTIONS = "Use the calc tool for arithmetic, then answer with the number."


async def answer(prompt: str, client, api: str = "responses", max_turns: int = 3) -> str | None:
    """The agent's final output on ``prompt`` (None when ``max_turns`` model calls ran out first).

    Args:
        prompt: the task.
        client: an ``openai.AsyncOpenAI`` client on the episode's session.
        api: ``"responses"`` (``OpenAIResponsesModel``) or ``"chat"`` (``OpenAIChatCompletionsModel``).
        max_turns: model calls at most.
    """
    import agents

    model_cls = {"responses": agents.OpenAIResponsesModel, "chat": agents.OpenAIChatCompletionsModel}[api]
    agent = agents.Agent(name="calculator", instructions=INSTRUCTIONS, tools=[agents.function_tool(calc)],
                         model=model_cls(model="policy", openai_client=client))
    try:
        result = await agents.Runner.run(agent, prompt, max_turns=max_turns,
                                         run_config=agents.RunConfig(tracing_disabled=True))
    except agents.MaxTurnsExceeded:
        return None
    return result.final_output


async def run(row: dict, client) -> None:
    """Answer ``row["prompt"]`` through the Responses API; None (the verifier scores the last message)."""
    await answer(row["prompt"], client, "responses")


async def run_chat(row: dict, client) -> None:
    """Answer ``row["prompt"]`` through Chat Completions; None (the verifier scores the last message)."""
    await answer(row["prompt"], client, "chat")
