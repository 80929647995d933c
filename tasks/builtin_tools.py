"""Built-in tools: run Python, run a shell command, write and read files, all in the sandbox.

Every tool works through `Sandbox.exec` only, so a mistake of the model (a bad path, a failing
command) comes back as an observation with the exit code, never as an infrastructure error; the
sandbox's own failures still raise `SandboxError`. Observations are compact (the output with the
trailing newline removed, prefixed by `[exit code N]` on failure) to keep prompts short.
"""

from __future__ import annotations

from tasks.tools import ToolContext, ToolError, ToolResult, exec_observation, tool

_WRITE = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'


def _path(path: str) -> str:
    """Relative paths stay relative: commands run in the work directory."""
    if not path or "\x00" in path:
        raise ToolError("path must be a non-empty file name")
    return path


@tool
async def python(ctx: ToolContext, code: str) -> ToolResult:
    """Run Python 3 code in the sandbox and return what it prints.

    Args:
        code: Python source run as a script; print the values you want to see.
    """
    result = await ctx.sandbox.exec(["python3", "-"], stdin=code.encode(), timeout=ctx.timeout_s)
    return exec_observation(result)


@tool
async def bash(ctx: ToolContext, command: str) -> ToolResult:
    """Run a bash command in the sandbox's work directory and return its output.

    Args:
        command: the command line, run with bash -c.
    """
    result = await ctx.sandbox.exec(["bash", "-c", command], timeout=ctx.timeout_s)
    return exec_observation(result)


@tool
async def write_file(ctx: ToolContext, path: str, content: str) -> str:
    """Write a text file in the sandbox, replacing it if it exists.

    Args:
        path: file path, relative to the work directory or absolute.
        content: the complete new text of the file.
    """
    target = _path(path)
    result = await ctx.sandbox.exec(["sh", "-c", _WRITE, "sh", target],
                                    stdin=content.encode(), timeout=ctx.timeout_s)
    if not result.ok:
        raise ToolError(exec_observation(result).text or f"cannot write {path}")
    return f"wrote {len(content.encode())} bytes to {path}"


@tool(idempotent=True, read_only=True)
async def read_file(ctx: ToolContext, path: str) -> ToolResult:
    """Read a text file from the sandbox.

    Args:
        path: file path, relative to the work directory or absolute.
    """
    result = await ctx.sandbox.exec(["cat", "--", _path(path)], timeout=ctx.timeout_s)
    return exec_observation(result)
