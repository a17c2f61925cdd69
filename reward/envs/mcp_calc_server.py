"""The calculator as an MCP tool server over stdio (``python -m reward.envs.mcp_calc_server``).

Written with the ``mcp`` SDK's ``MCPServer`` (mcp 2; the ``FastMCP`` of mcp 1): the tool's JSON schema comes
from the function's signature. A bad expression is a ``ToolError``, which the SDK returns as a tool result with
``isError`` set and the calculator's message as its text (any other exception would reach the model as a bare
"Error executing tool calc"). ``reward/envs/mcp_agent.py`` starts this server and offers its tools to the model.
"""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from reward.envs import calculator

server = MCPServer("calculator", log_level="WARNING")


@server.tool(structured_output=False)
def calc(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with +, - and * and parentheses."""
    try:
        return calculator.calc(expression)
    except ValueError as err:
        raise ToolError(str(err)) from None


if __name__ == "__main__":
    server.run("stdio")
