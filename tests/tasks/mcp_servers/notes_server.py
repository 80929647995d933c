"""A small MCP stdio server for the tests, written with the official `mcp` SDK (2.x).

Tools: `add_note(text)` keeps a note in memory (state lives as long as the server), `notes()`
lists them, `divide(a, b)` fails with an MCP tool error on b = 0, `slow(seconds)` answers
late, and `crash()` kills the server process mid-call.
"""

import os
import time

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("notes")
NOTES: list[str] = []


@server.tool()
def add_note(text: str) -> str:
    """Remember a note."""
    NOTES.append(text)
    return f"{len(NOTES)} notes"


@server.tool()
def notes() -> str:
    """List the notes, one a line."""
    return "\n".join(NOTES) or "(none)"


@server.tool()
def divide(a: float, b: float) -> float:
    """Divide a by b."""
    if b == 0:
        raise ToolError("cannot divide by zero")
    return a / b


@server.tool()
def slow(seconds: float) -> str:
    """Wait, then answer."""
    time.sleep(seconds)
    return "awake"


@server.tool()
def crash() -> str:
    """Stop the server at once (a crash)."""
    os._exit(3)


if __name__ == "__main__":
    server.run("stdio")
