"""Our tools in the shapes other stacks read: OpenAI function tools and MCP tool descriptors.

Guarantees:
- `openai_function_tool` is `{"type": "function", "function": {name, description, parameters}}`
  and adds `"strict": true` exactly when strict mode can express the schema without changing
  what the tool accepts: every object closed (`additionalProperties: false`), and every
  property either required or optional with a `None` default and a type that admits null (that
  default is dropped and the property listed as required, as the `openai` package does: the
  model then sends null). A non-None default, an open object (`dict[str, T]`) or a
  fixed-length tuple keeps the schema as it is, without `strict`;
- `mcp_tool_descriptor` is an MCP `Tool` (`name`, `description`, `inputSchema`, `annotations`
  with `readOnlyHint` and `idempotentHint`); `readOnlyHint` is what the tool declares
  (`Tool.read_only_hint`, an MCP server's own hint), else `read_only`;
- neither changes `Tool.openai_schema()`, which is part of every task's content hash.
"""

from __future__ import annotations

import copy
from typing import Any

from tasks.schema import JsonSchema
from tasks.tools import Tool


def strict_schema(schema: JsonSchema) -> JsonSchema | None:
    """`schema` in OpenAI strict form, or None when strict mode cannot express it."""
    schema = copy.deepcopy(schema)
    return schema if _make_strict(schema) else None


def _make_strict(schema: JsonSchema) -> bool:
    if "prefixItems" in schema:
        return False
    if schema.get("type") == "object":
        if schema.get("additionalProperties", True) is not False:
            return False
        properties: dict[str, JsonSchema] = schema.get("properties", {})
        required = set(schema.get("required", []))
        for name, sub in properties.items():
            if name not in required:
                if "default" not in sub or sub["default"] is not None or not _admits_null(sub):
                    return False
                del sub["default"]
            elif "default" in sub:
                return False
            if not _make_strict(sub):
                return False
        schema["required"] = list(properties)
        return True
    if "default" in schema:
        return False
    subs = [schema["items"]] if isinstance(schema.get("items"), dict) else []
    subs += schema.get("anyOf", [])
    return all(_make_strict(sub) for sub in subs)


def _admits_null(schema: JsonSchema) -> bool:
    kind = schema.get("type")
    if kind == "null" or (isinstance(kind, list) and "null" in kind):
        return True
    return any(_admits_null(sub) for sub in schema.get("anyOf", []))


def openai_function_tool(tool: Tool) -> dict[str, Any]:
    strict = strict_schema(tool.parameters)
    function: dict[str, Any] = {"name": tool.name, "description": tool.description,
                                "parameters": strict if strict is not None
                                else copy.deepcopy(tool.parameters)}
    if strict is not None:
        function["strict"] = True
    return {"type": "function", "function": function}


def mcp_tool_descriptor(tool: Tool) -> dict[str, Any]:
    return {"name": tool.name, "description": tool.description,
            "inputSchema": copy.deepcopy(tool.parameters),
            "annotations": {"readOnlyHint": tool.read_only if tool.read_only_hint is None
                            else tool.read_only_hint, "idempotentHint": tool.idempotent}}


def export_tools(tools: list[Tool], fmt: str) -> list[dict[str, Any]]:
    if fmt == "openai":
        return [openai_function_tool(t) for t in tools]
    if fmt == "mcp":
        return [mcp_tool_descriptor(t) for t in tools]
    raise ValueError(f"unknown tool format {fmt!r}; use openai or mcp")
