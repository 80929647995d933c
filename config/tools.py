"""The job's `[tools]` section: tools every task gets on top of its own; `[[tools.mcp]]` names
MCP stdio servers (tasks.mcp runs them)."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from config.base import ConfigSection

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class McpServerConfig(ConfigSection):
    """One `[[tools.mcp]]` entry."""


    command: list[str] = Field(min_length=1, description="argv of the stdio server")
    name: str = Field("", description="label in errors and state (default: the command's name)")
    trusted: bool = Field(False, description="run on the host instead of inside the sandbox")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables")
    prefix: str = Field("", description="prepended to every tool name (to avoid clashes)")
    timeout_s: float = Field(60.0, gt=0, description="time limit of one tools/call")
    startup_timeout_s: float = Field(30.0, gt=0, description="time limit of start + initialize")
    max_reply_mb: float = Field(16.0, gt=0, le=64, description="largest answer accepted (MiB, "
                                "at most what one sandbox read hands over); a larger one is an "
                                "error observation and the server is restarted")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if value and not _NAME.match(value):
            raise ValueError(f"name {value!r} must match {_NAME.pattern}")
        return value

    @property
    def label(self) -> str:
        return self.name or re.sub(r"[^A-Za-z0-9_-]", "_", self.command[0].rsplit("/", 1)[-1])

    @property
    def max_reply_bytes(self) -> int:
        return int(self.max_reply_mb * 2**20)


class ToolsConfig(ConfigSection):
    """The job's `[tools]` section: tools every task gets on top of its own."""

    mcp: list[McpServerConfig] = Field(default_factory=list, description="MCP stdio servers")
