"""The job's `[tasks.harbor]` section: how Harbor task folders are run here (tasks.harbor)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from config.base import ConfigSection


class HarborSettings(ConfigSection):
    """The job's `[tasks.harbor]` section: how Harbor tasks are run here."""

    base_image_map: dict[str, str] = Field(
        default_factory=dict, description='FROM image -> local image, e.g. '
        '{ "python:3.12-slim" = "stalewise-base" } (no registry is assumed)')
    allow_network: bool = Field(False, description="let tasks with allow_internet have network")
    max_memory_mb: int = Field(1024, ge=16, description="caps the tasks' memory_mb")
    max_cpus: float = Field(1.0, gt=0, description="caps the tasks' cpus")
    tool_timeout_s: float = Field(60.0, gt=0, description="time limit of one bash call")
    output_bytes: int = Field(16384, ge=1024, description="tool output kept per call")
    limits: dict[str, Any] = Field(default_factory=dict, description="TaskLimits overrides "
                                   "(max_turns, max_generated_tokens, context_length, ...)")
