"""The calculator agent written as a plain OpenAI program (``env.agent: reward.envs.calc_agent:run``).

Nothing in it knows about training: it is the loop anyone writes against the Chat Completions API, with one
function tool. ``configs/tiny_agent_openai.yaml`` trains the embedded tiny model with it through the session
gateway, the task of ``configs/tiny_agent_calc.yaml`` (whose episodes run as ``env.tools``); a failed call's
text is the env workers' (``reward.environment.tool_error_text``), so the two read alike to the model.
"""

from __future__ import annotations

from reward.environment import call_arguments, tool_error_text
from reward.envs.calculator import calc

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression of integers with +, - and * and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}]


def run(row: dict, client, max_turns: int = 3) -> None:
    """Answer ``row["prompt"]`` with the calculator's help; returns None, so the row's verifier scores the last
    assistant message.

    Args:
        row: the task row (``prompt``, ``answer``, ...).
        client: an ``openai.OpenAI`` client (the gateway gives each episode its own base URL and key).
        max_turns: model calls at most.
    """
    chat(row["prompt"], client, max_turns)
    return None


def chat(prompt: str, client, max_turns: int = 3) -> list[dict]:
    """The calculator loop on ``prompt``: the conversation's messages, ending with the model's answer unless
    ``max_turns`` ran out during tool calls (``reward/envs/calc_cli.py`` scores the answer itself)."""
    messages = [{"role": "user", "content": prompt}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        messages += [{"role": "tool", "tool_call_id": call.id, "content": call_tool(call)}
                     for call in message.tool_calls]
    return messages


def call_tool(call) -> str:
    """The calculator's answer to one tool call of a reply (its text, or ``"Error: ..."`` for bad arguments)."""
    try:
        return calc(**call_arguments(call.function.name, call.function.arguments))
    except (TypeError, ValueError) as err:
        return tool_error_text(str(err))
