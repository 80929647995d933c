"""JSON Schema from Python type hints, and parameter descriptions from docstrings.

Guarantees: `schema_for_type` maps a supported annotation to a JSON Schema (draft 2020-12)
fragment and raises `ToolDefinitionError` naming the parameter and the unsupported type for
anything else; `parse_docstring` returns the summary and a description for every parameter
documented in a Google-style `Args:` section or Sphinx-style `:param name:` lines. Both run when a
tool is defined (at import), so a badly declared tool fails before any agent runs.
"""

from __future__ import annotations

import enum
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union

JsonSchema = dict[str, Any]

_PRIMITIVES: dict[Any, JsonSchema] = {
    str: {"type": "string"},
    int: {"type": "integer"},
    float: {"type": "number"},
    bool: {"type": "boolean"},
    type(None): {"type": "null"},
}
_SEQUENCES = (list, tuple, Sequence, set, frozenset, list, tuple)
_MAPPINGS = (dict, Mapping, dict)


class ToolDefinitionError(TypeError):
    """A tool's signature or docstring cannot be turned into a schema (raised at definition)."""


def schema_for_type(annotation: Any, where: str) -> JsonSchema:
    """The JSON Schema of `annotation`; `where` names the parameter for error messages."""
    if annotation in _PRIMITIVES:
        return dict(_PRIMITIVES[annotation])
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return _enum_schema([member.value for member in annotation], where)
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return schema_for_type(args[0], where)
    if origin is Literal:
        return _enum_schema(list(args), where)
    if origin in (Union, types.UnionType):
        options = [schema_for_type(arg, where) for arg in args]
        return {"anyOf": options}
    if origin in _SEQUENCES or annotation in (list, tuple):
        return _array_schema(origin or annotation, args, where)
    if origin in _MAPPINGS or annotation is dict:
        if args and args[0] is not str:
            raise ToolDefinitionError(f"{where}: mapping keys must be str for JSON, got {args[0]!r}")
        value = schema_for_type(args[1], where) if args else {}
        return {"type": "object", "additionalProperties": value}
    raise ToolDefinitionError(
        f"{where}: type {annotation!r} has no JSON Schema; use str, int, float, bool, None, "
        "Literal[...], an Enum, list[...], tuple[..., ...], dict[str, ...] or a union of these"
    )


def _enum_schema(values: list[Any], where: str) -> JsonSchema:
    kinds = {type(value) for value in values}
    if len(kinds) != 1 or next(iter(kinds)) not in _PRIMITIVES:
        raise ToolDefinitionError(f"{where}: enum values must share one JSON type, got {values!r}")
    schema = dict(_PRIMITIVES[next(iter(kinds))])
    schema["enum"] = values
    return schema


def _array_schema(origin: Any, args: tuple[Any, ...], where: str) -> JsonSchema:
    if origin in (tuple, tuple) and args and not (len(args) == 2 and args[1] is Ellipsis):
        items = [schema_for_type(arg, where) for arg in args]
        return {"type": "array", "prefixItems": items, "minItems": len(items),
                "maxItems": len(items)}
    if not args:
        return {"type": "array"}
    return {"type": "array", "items": schema_for_type(args[0], where)}


_GOOGLE_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Params)\s*:\s*$")
_OTHER_SECTION = re.compile(r"^\s*(Returns?|Raises|Yields|Examples?|Notes?|See Also)\s*:\s*$")
_GOOGLE_ARG = re.compile(r"^(\s*)\*{0,2}([A-Za-z_][A-Za-z0-9_]*)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_SPHINX_ARG = re.compile(r"^\s*:param\s+(?:[^:]*\s)?([A-Za-z_][A-Za-z0-9_]*)\s*:\s*(.*)$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(summary, {parameter: description}) of a Google- or Sphinx-style docstring."""
    if not doc:
        return "", {}
    lines = _dedent(doc).splitlines()
    summary: list[str] = []
    params: dict[str, str] = {}
    section = "summary"
    current: str | None = None
    arg_indent = -1
    for line in lines:
        if _GOOGLE_SECTION.match(line):
            section, current, arg_indent = "args", None, -1
            continue
        if _OTHER_SECTION.match(line):
            section, current = "other", None
            continue
        sphinx = _SPHINX_ARG.match(line)
        if sphinx:
            section, current = "sphinx", sphinx.group(1)
            params[current] = sphinx.group(2).strip()
            continue
        if section == "summary":
            summary.append(line)
        elif section == "args":
            current, arg_indent = _google_line(line, params, current, arg_indent)
        elif section == "sphinx" and current and line.strip() and not line.lstrip().startswith(":"):
            params[current] = f"{params[current]} {line.strip()}".strip()
    return _paragraphs(summary), params


def _google_line(line: str, params: dict[str, str], current: str | None,
                 arg_indent: int) -> tuple[str | None, int]:
    match = _GOOGLE_ARG.match(line)
    indent = len(line) - len(line.lstrip())
    if match and (arg_indent < 0 or indent <= arg_indent):
        name = match.group(2)
        params[name] = match.group(3).strip()
        return name, indent
    if current and line.strip():
        params[current] = f"{params[current]} {line.strip()}".strip()
    return current, arg_indent


def _dedent(doc: str) -> str:
    lines = doc.expandtabs().splitlines()
    if not lines:
        return ""
    rest = [line for line in lines[1:] if line.strip()]
    margin = min((len(line) - len(line.lstrip()) for line in rest), default=0)
    return "\n".join([lines[0].strip()] + [line[margin:] for line in lines[1:]])


def _paragraphs(lines: list[str]) -> str:
    text = "\n".join(lines).strip()
    blocks = [" ".join(part.split()) for part in re.split(r"\n\s*\n", text) if part.strip()]
    return "\n\n".join(blocks)
