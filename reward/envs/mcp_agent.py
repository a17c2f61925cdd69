"""An agent whose tools come from an MCP server (``env.agent: reward.envs.mcp_agent:run``).

It starts ``reward/envs/mcp_calc_server.py`` as a subprocess over stdio with the ``mcp`` client, lists the
server's tools, offers them to the model as OpenAI function tools, and runs the usual Chat Completions loop,
calling the server's ``call_tool`` for each tool call. Any stdio MCP server works the same way: change
``SERVER``. The server process ends with the ``async with`` block, however the episode ends.
"""

from __future__ import annotations

import sys
from pathlib import Path

from reward.environment import call_arguments, tool_error_text

# The server, started by the agent; run from the checkout's root so that ``-m reward.envs...`` imports.
SERVER = {"command": sys.executable, "args": ["-m", "reward.envs.mcp_calc_server"],
          "cwd": str(Path(__file__).resolve().parents[2])}


def openai_tool(tool) -> dict:
    """An MCP ``Tool`` (name, description, JSON-schema input) as an OpenAI function tool."""
    return {"type": "function", "function": {"name": tool.name, "description": tool.description or "",
                                             "parameters": tool.input_schema}}


async def call(mcp, name: str, arguments: str) -> str:
    """The text of an MCP tool call's result (a tool error's message included, as the model should see it)."""
    try:
        args = call_arguments(name, arguments)
    except ValueError as err:
        return tool_error_text(str(err))
    result = await mcp.call_tool(name, args)
    return "\n".join(part.text for part in result.content if part.type == "text")


async def run(row: dict, client, max_turns: int = 3) -> None:
    """Answer ``row["prompt"]`` with the MCP server's tools; returns None (the row's verifier scores the last
    assistant message).

    Args:
        row: the task row (``prompt``, ...).
        client: an ``openai.AsyncOpenAI`` client on the episode's session.
        max_turns: model calls at most.
    """
    from mcp import Client, StdioServerParameters  # the mcp client takes about 2 s to import

    async with Client(StdioServerParameters(**SERVER)) as mcp:
        tools = [openai_tool(t) for t in (await mcp.list_tools()).tools]
        messages = [{"role": "user", "content": row["prompt"]}]
        for _ in range(max_turns):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=tools)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return None
            for tool_call in message.tool_calls:
                result = await call(mcp, tool_call.function.name, tool_call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": result})
    return None
