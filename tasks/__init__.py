"""Tasks and tools: what agents are asked to do, what they may call, and how they are scored.

Public API (import from here):
- `TaskInstance`, `TaskLimits`, `TaskFamily`: a task and where tasks come from;
- `tool`, `Tool`, `ToolContext`, `ToolError`, `ToolResult`: tools from typed functions;
- `Rubric`, `Component`, `Reward`, `VerifyContext`: verifiers;
- `Demonstration`, `DemoTurn`: scripted correct (or deliberately wrong) trajectories;
- `ChatMessage`, `load_family`.

Depends on nothing of ours but the shared sandbox types; never imports torch.
"""

from tasks.api import TaskFamily, TaskInstance, TaskLimits
from tasks.demos import Demonstration, DemoTurn, demonstration_samples
from tasks.loading import TaskLoadError, load_family
from tasks.messages import ChatMessage
from tasks.schema import ToolDefinitionError
from tasks.tools import Tool, ToolContext, ToolError, ToolResult, tool
from tasks.verify import Component, Reward, Rubric, VerifyContext

__all__ = ["ChatMessage", "Component", "DemoTurn", "Demonstration", "Reward", "Rubric",
           "TaskFamily", "TaskInstance", "TaskLimits", "TaskLoadError", "Tool", "ToolContext",
           "ToolDefinitionError", "ToolError", "ToolResult", "VerifyContext",
           "demonstration_samples", "load_family", "tool"]
