"""Tools: typed Python functions the agent may call, with schemas derived from their signatures.

`@tool` turns an async (or sync) function into a `Tool`. Guarantees, all checked when the
decorator runs (at import), never at call time:

- the JSON Schema of the arguments comes from the type hints; every parameter needs a hint and a
  description in the docstring (`Args:` section), else `ToolDefinitionError`;
- a parameter annotated `ToolContext` receives the sandbox and the task; it is never in the schema;
- `openai_schema()` has the OpenAI function-calling shape, with `strict: true` only when the
  schema qualifies (every parameter required, no defaults, closed objects);
- metadata: `idempotent` tools are retried on sandbox errors (`retries` times), `read_only` tools
  may run concurrently with other read-only calls of the same turn.

At call time, arguments are validated against the schema (`ToolArgumentError`, a malformed call
the model is told about); `validate` accepts exactly what the JSON Schema validator accepts (a
precompiled check answers the common flat schemas, the validator itself everything else and
every error message). `call` runs a tool on arguments `validate` returned, without checking them
twice. A tool reports problems the model should see by raising `ToolError`;
`SandboxError` means infrastructure failed; any other exception is a bug in the tool.
"""

from __future__ import annotations

import enum
import functools
import inspect
import json
import math
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import jsonschema

from core.sandbox import ExecResult, Sandbox
from tasks.schema import JsonSchema, ToolDefinitionError, parse_docstring, schema_for_type

if TYPE_CHECKING:
    from tasks.api import TaskInstance

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolError(Exception):
    """Raised by a tool to tell the model what went wrong; becomes the observation text."""


class ToolArgumentError(ValueError):
    """The model's arguments do not match the tool's schema (a malformed tool call)."""


@dataclass
class ToolContext:
    """What a tool may touch: the trajectory's sandbox, its task, and per-trajectory state."""

    sandbox: Sandbox
    task: TaskInstance
    trajectory_id: int | None = None  # the store's id, when the trajectory has one
    turn: int = 0
    timeout_s: float | None = None  # this call's time budget; pass it to `sandbox.exec`
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolResult:
    """A tool's observation plus the facts about how it was produced (for the tool-call record)."""

    text: str
    exit_code: int | None = None
    error_type: str | None = None
    timed_out: bool = False
    truncated: bool = False
    original_bytes: int | None = None
    # A per-turn reward the task grants for this call (a step or process reward), recorded on
    # the tool call. The learner trains on it with a per-turn estimator
    # (`[learner.advantage] estimator = "turn_leave_one_out"`); others use the outcome only.
    reward: float | None = None

    def __post_init__(self) -> None:
        if self.reward is not None:
            if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)) \
                    or not math.isfinite(self.reward):
                raise ValueError(f"ToolResult.reward must be a finite number or None, got "
                                 f"{self.reward!r}")
            object.__setattr__(self, "reward", float(self.reward))


def exec_observation(result: ExecResult) -> ToolResult:
    """The observation of a sandbox command: its output, prefixed by the failure if it failed."""
    output = result.stdout + (result.stderr if result.stderr else "")
    output = output.rstrip("\n")
    if result.timed_out:
        head = f"[timed out after {result.duration_s:.1f}s]"
    elif result.oom_killed:
        head = "[killed: out of memory]"
    elif result.error_type is not None:
        head = f"[{result.error_type}]"
    elif result.exit_code != 0:
        head = f"[exit code {result.exit_code}]"
    else:
        head = ""
    text = f"{head}\n{output}".strip("\n") if head else output
    return ToolResult(
        text=text,
        exit_code=result.exit_code,
        error_type=result.error_type,
        timed_out=result.timed_out,
        truncated=result.truncated,
        original_bytes=(result.stdout_bytes + result.stderr_bytes) if result.truncated else None,
    )


@dataclass(frozen=True, eq=False)
class Tool:
    """A callable tool with its schema. Build it with `@tool`, not directly."""

    name: str
    description: str
    parameters: JsonSchema
    fn: Callable[..., Any]
    context_param: str | None
    idempotent: bool = False
    read_only: bool = False
    retries: int = 0
    # What the tool's author declares, exported as MCP's `readOnlyHint` (tasks.tool_export);
    # None: `read_only`. Only `read_only` changes how the agent loop runs the tool.
    read_only_hint: bool | None = None
    timeout_s: float | None = None
    enum_params: Mapping[str, type] = field(default_factory=dict)

    def openai_schema(self) -> dict[str, Any]:
        """`{"type": "function", "function": {...}}`, the OpenAI function-calling shape."""
        function: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
        }
        if strict_compatible(self.parameters):
            function["strict"] = True
        return {"type": "function", "function": function}

    def validate(self, arguments: Any) -> dict[str, Any]:
        """Checked keyword arguments for `fn`, or `ToolArgumentError` saying what is wrong."""
        if not isinstance(arguments, Mapping):
            raise ToolArgumentError(
                f"arguments of {self.name} must be a JSON object, got {type(arguments).__name__}")
        kwargs = dict(arguments)
        quick = self._quick_check
        if quick is None or not quick(kwargs):
            errors = sorted(self._validator.iter_errors(kwargs), key=lambda e: list(e.path))
            if errors:
                problems = "; ".join(_describe(error) for error in errors[:3])
                raise ToolArgumentError(f"bad arguments for {self.name}: {problems}")
        for name, enum_type in self.enum_params.items():
            if name in kwargs:
                kwargs[name] = enum_type(kwargs[name])
        return kwargs

    @functools.cached_property
    def _validator(self) -> jsonschema.Draft202012Validator:
        return jsonschema.Draft202012Validator(self.parameters)

    @functools.cached_property
    def _quick_check(self) -> Callable[[dict[str, Any]], bool] | None:
        return quick_check(self.parameters)

    @functools.cached_property
    def _is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    async def invoke(self, ctx: ToolContext, arguments: Any) -> ToolResult:
        """Validate, call and normalise the result. Exceptions from the tool propagate."""
        return await self.call(ctx, self.validate(arguments))

    async def call(self, ctx: ToolContext, kwargs: dict[str, Any]) -> ToolResult:
        """Call with keyword arguments returned by `validate` and normalise the result."""
        kwargs = dict(kwargs)
        if self.context_param is not None:
            kwargs[self.context_param] = ctx
        if self._is_async:
            value = await self.fn(**kwargs)
        else:
            value = await anyio.to_thread.run_sync(functools.partial(self.fn, **kwargs))
        return as_tool_result(value)


def as_tool_result(value: Any) -> ToolResult:
    """Normalise what a tool returned: str, bytes (read as UTF-8, undecodable bytes shown as
    U+FFFD, as a sandbox command's output is), `ToolResult`, `ExecResult`, None or JSON data."""
    if isinstance(value, ToolResult):
        return value
    if isinstance(value, ExecResult):
        return exec_observation(value)
    if isinstance(value, str):
        return ToolResult(text=value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return ToolResult(text=bytes(value).decode("utf-8", errors="replace"))
    if value is None:
        return ToolResult(text="(no output)")
    try:
        return ToolResult(text=json.dumps(value, separators=(",", ":")))
    except TypeError as err:
        raise TypeError(f"tool returned {type(value).__name__}, which is not JSON: {err}") from err


_QUICK_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "null": (type(None),)}


def quick_check(schema: JsonSchema) -> Callable[[dict[str, Any]], bool] | None:
    """A fast acceptance test for a closed object of scalar (or enum) properties, else None.

    It only ever accepts what the JSON Schema validator accepts (exact Python types as
    `json.loads` makes them; no bools for numbers); a False means "ask the validator", which
    may still accept (1.0 for an integer) and otherwise says what is wrong."""
    if (schema.get("type") != "object" or schema.get("additionalProperties", True) is not False
            or set(schema) - {"type", "properties", "required", "additionalProperties"}):
        return None
    properties: dict[str, tuple[tuple[type, ...], tuple[Any, ...] | None]] = {}
    for name, sub in schema.get("properties", {}).items():
        kinds = _quick_kinds(sub)
        if kinds is None:
            return None
        choices = sub.get("enum")
        properties[name] = (kinds, None if choices is None else tuple(choices))
    required = tuple(schema.get("required", ()))
    if set(required) - set(properties):
        return None

    def check(arguments: dict[str, Any]) -> bool:
        for name in required:
            if name not in arguments:
                return False
        for name, value in arguments.items():
            spec = properties.get(name)
            if spec is None or type(value) not in spec[0]:
                return False
            if spec[1] is not None and value not in spec[1]:
                return False
        return True
    return check


def _quick_kinds(schema: Any) -> tuple[type, ...] | None:
    """The Python types a scalar property schema (or an anyOf of bare scalar types, as for
    `int | None`) accepts, or None when the quick check does not handle it."""
    if not isinstance(schema, dict) or set(schema) - {"type", "enum", "anyOf", "description",
                                                      "default"}:
        return None
    if "anyOf" in schema:
        branches = schema["anyOf"]
        if "type" in schema or "enum" in schema or not all(
                isinstance(b, dict) and set(b) == {"type"} and isinstance(b["type"], str)
                and b["type"] in _QUICK_TYPES for b in branches):
            return None
        return tuple(kind for b in branches for kind in _QUICK_TYPES[b["type"]])
    kind = schema.get("type")
    return _QUICK_TYPES.get(kind) if isinstance(kind, str) else None


def _describe(error: jsonschema.ValidationError) -> str:
    where = "/".join(str(part) for part in error.path)
    return f"{where}: {error.message}" if where else error.message


def strict_compatible(schema: JsonSchema) -> bool:
    """True when OpenAI strict mode accepts `schema`: closed objects, all keys required."""
    if "default" in schema:
        return False
    if schema.get("type") == "object":
        props = schema.get("properties", {})
        if schema.get("additionalProperties", True) is not False:
            return False
        if set(schema.get("required", [])) != set(props):
            return False
        return all(strict_compatible(sub) for sub in props.values())
    if "prefixItems" in schema:
        return False
    subs = [schema["items"]] if isinstance(schema.get("items"), dict) else []
    subs += schema.get("anyOf", [])
    return all(strict_compatible(sub) for sub in subs)


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None,
         idempotent: bool = False, read_only: bool = False, retries: int | None = None,
         timeout_s: float | None = None) -> Any:
    """Decorator: `@tool` or `@tool(idempotent=True, read_only=True, timeout_s=10)`.

    `retries` (default 2 for idempotent tools, else 0) is how often a call that hit a
    `SandboxError` is repeated; non-idempotent tools are never retried.
    """
    def wrap(func: Callable[..., Any]) -> Tool:
        return build_tool(func, name=name, idempotent=idempotent, read_only=read_only,
                          retries=retries, timeout_s=timeout_s)
    return wrap(fn) if fn is not None else wrap


def build_tool(func: Callable[..., Any], *, name: str | None = None, idempotent: bool = False,
               read_only: bool = False, retries: int | None = None,
               timeout_s: float | None = None) -> Tool:
    tool_name = name or func.__name__
    if not _NAME.match(tool_name):
        raise ToolDefinitionError(f"tool name {tool_name!r} must match {_NAME.pattern}")
    if retries is not None and retries > 0 and not idempotent:
        raise ToolDefinitionError(
            f"tool {tool_name}: retries={retries} needs idempotent=True (a retried call that is "
            "not idempotent could apply its side effect twice)")
    summary, described = parse_docstring(inspect.getdoc(func))
    if not summary:
        raise ToolDefinitionError(f"tool {tool_name}: add a docstring saying what the tool does")
    parameters, context_param, enums = _parameters(func, tool_name, described)
    return Tool(
        name=tool_name,
        description=summary,
        parameters=parameters,
        fn=func,
        context_param=context_param,
        idempotent=idempotent,
        read_only=read_only,
        retries=(2 if idempotent else 0) if retries is None else retries,
        timeout_s=timeout_s,
        enum_params=enums,
    )


def _parameters(func: Callable[..., Any], tool_name: str,
                described: dict[str, str]) -> tuple[JsonSchema, str | None, dict[str, type]]:
    try:
        hints = typing.get_type_hints(func, include_extras=True)
    except NameError as err:
        raise ToolDefinitionError(f"tool {tool_name}: cannot resolve a type hint: {err}") from err
    properties: dict[str, JsonSchema] = {}
    required: list[str] = []
    context_param: str | None = None
    enums: dict[str, type] = {}
    for param in inspect.signature(func).parameters.values():
        where = f"tool {tool_name}, parameter {param.name!r}"
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolDefinitionError(f"{where}: *args/**kwargs cannot be described by a schema")
        if param.name not in hints:
            raise ToolDefinitionError(f"{where}: add a type hint")
        hint = hints[param.name]
        if hint is ToolContext:
            context_param = param.name
            continue
        if not described.get(param.name):
            raise ToolDefinitionError(
                f"{where}: describe it in the docstring, e.g. 'Args:\\n    {param.name}: ...'")
        schema = schema_for_type(hint, where)
        schema["description"] = described[param.name]
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            enums[param.name] = hint
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
        else:
            schema["default"] = _json_default(param.default, where)
        properties[param.name] = schema
    unknown = set(described) - set(properties) - {context_param}
    if unknown:
        raise ToolDefinitionError(
            f"tool {tool_name}: docstring describes {sorted(unknown)}, not in the signature")
    schema = {"type": "object", "properties": properties, "required": required,
              "additionalProperties": False}
    return schema, context_param, enums


def _json_default(value: Any, where: str) -> Any:
    if isinstance(value, enum.Enum):
        value = value.value
    try:
        json.dumps(value)
    except TypeError as err:
        raise ToolDefinitionError(f"{where}: default {value!r} is not JSON") from err
    return value

