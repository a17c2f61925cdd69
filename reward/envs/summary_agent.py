"""A calculator agent that compacts its history (``env.agent: reward.envs.summary_agent:run``).

Every ``k`` model turns it replaces the conversation with one user message: the task and a short summary of the
tool calls so far, and goes on from there, as agents with a bounded context do. Its next request no longer extends
the history the gateway returned, so the session forks (``rollout.gateway_session.continuation``): each stretch
between summaries is a trajectory of its own, trained on what was sampled in it (``agent/forks`` counts them).
"""

from __future__ import annotations

from reward.envs.calc_agent import TOOLS, call_tool


def summary(prompt: str, steps: list[str]) -> dict:
    """The user message that replaces the history: the task, then one line per tool call so far."""
    lines = "\n".join(f"- {step}" for step in steps)
    return {"role": "user", "content": f"{prompt}\n\nWhat you did so far:\n{lines}\nContinue."}


def run(row: dict, client, k: int = 2, max_turns: int = 6) -> None:
    """Answer ``row["prompt"]`` with the calculator, summarising the history after every ``k`` turns; returns
    None (the row's verifier scores the last assistant message).

    Args:
        row: the task row (``prompt``, ...).
        client: an ``openai.OpenAI`` client on the episode's session.
        k: model turns between summaries.
        max_turns: model calls at most.
    """
    messages, steps = [{"role": "user", "content": row["prompt"]}], []
    for turn in range(1, max_turns + 1):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return None
        for call in message.tool_calls:
            result = call_tool(call)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            steps.append(f"{call.function.name}({call.function.arguments}) returned {result}")
        if turn % k == 0:
            messages = [summary(row["prompt"], steps)]
    return None
