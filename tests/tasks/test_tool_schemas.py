"""Tools from typed functions: schemas, docstrings, OpenAI export, argument checks, results."""

from __future__ import annotations

import enum
from typing import Literal

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.sandbox import ExecResult
from tasks.builtin_tools import bash, python, read_file, write_file
from tasks.schema import ToolDefinitionError, parse_docstring
from tasks.suites import arith, codefix, longhaul
from tasks.testing import FakeSandbox
from tasks.tools import (
    ToolArgumentError,
    ToolContext,
    ToolResult,
    as_tool_result,
    exec_observation,
    quick_check,
    strict_compatible,
    tool,
)

OPENAI_FUNCTION_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "additionalProperties": False,
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "description", "parameters"],
            "additionalProperties": False,
            "properties": {
                "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                "description": {"type": "string", "minLength": 1},
                "parameters": {
                    "type": "object",
                    "required": ["type", "properties"],
                    "properties": {"type": {"const": "object"},
                                   "properties": {"type": "object"},
                                   "required": {"type": "array", "items": {"type": "string"}}},
                },
                "strict": {"const": True},
            },
        },
    },
}


def builtin_tools():
    step = longhaul.family().instance(0).tools[0]
    return [python, bash, write_file, read_file, step]


@pytest.mark.parametrize("t", builtin_tools(), ids=lambda t: t.name)
def test_builtin_tool_schemas_are_valid_json_schema_in_openai_shape(t):
    exported = t.openai_schema()
    jsonschema.validate(exported, OPENAI_FUNCTION_TOOL)
    jsonschema.Draft202012Validator.check_schema(exported["function"]["parameters"])
    params = exported["function"]["parameters"]
    assert "ctx" not in params["properties"], "the context parameter leaked into the schema"
    assert all(p.get("description") for p in params["properties"].values())
    assert exported["function"].get("strict") is True  # all built-ins qualify


def test_suite_tasks_expose_only_their_tools():
    assert [t.name for t in arith.family().instance(0).tools] == ["python"]
    assert [t.name for t in codefix.family().instance(0).tools] == ["bash", "write_file"]
    assert [t.name for t in longhaul.family().instance(0).tools] == ["step"]


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@tool(read_only=True, idempotent=True)
async def everything(ctx: ToolContext, text: str, count: int, ratio: float, flag: bool,
                     mode: Literal["fast", "slow"], color: Color, tags: list[str],
                     weights: dict[str, float], maybe: int | None = None,
                     pair: tuple[int, str] = (1, "a")) -> str:
    """Exercise every supported type.

    Longer explanation that stays in the description.

    Args:
        text: some text.
        count: how many
            (continued on a second line).
        ratio: a number.
        flag: a switch.
        mode: speed.
        color: a colour.
        tags: labels.
        weights: per-name weights.
        maybe: optional number.
        pair: a fixed pair.

    Returns:
        Ignored section.
    """
    return f"{text}:{count}:{color.value}:{maybe}"


def test_schema_from_type_hints_and_docstring():
    params = everything.parameters
    props = params["properties"]
    assert props["text"] == {"type": "string", "description": "some text."}
    assert props["count"]["type"] == "integer"
    assert props["count"]["description"] == "how many (continued on a second line)."
    assert props["ratio"]["type"] == "number" and props["flag"]["type"] == "boolean"
    assert props["mode"] == {"type": "string", "enum": ["fast", "slow"], "description": "speed."}
    assert props["color"]["enum"] == ["red", "blue"]
    assert props["tags"]["items"] == {"type": "string"}
    assert props["weights"]["additionalProperties"] == {"type": "number"}
    assert props["maybe"]["anyOf"] == [{"type": "integer"}, {"type": "null"}]
    assert props["maybe"]["default"] is None
    assert props["pair"]["prefixItems"] == [{"type": "integer"}, {"type": "string"}]
    assert params["required"] == ["text", "count", "ratio", "flag", "mode", "color", "tags",
                                  "weights"]
    assert params["additionalProperties"] is False
    assert everything.description == ("Exercise every supported type.\n\n"
                                      "Longer explanation that stays in the description.")
    assert everything.context_param == "ctx"
    jsonschema.Draft202012Validator.check_schema(params)
    assert "strict" not in everything.openai_schema()["function"]  # defaults: not strict


def test_sphinx_docstrings_are_understood():
    summary, params = parse_docstring("""Do it.

    :param str a: first thing
        more about a
    :param b: second thing
    """)
    assert summary == "Do it."
    assert params == {"a": "first thing more about a", "b": "second thing"}


def test_missing_parameter_description_fails_at_definition():
    with pytest.raises(ToolDefinitionError, match="parameter 'b'.*describe it"):
        @tool
        def f(a: int, b: int) -> int:
            """Add.

            Args:
                a: first.
            """
            return a + b


def test_other_definition_errors_are_explicit():
    with pytest.raises(ToolDefinitionError, match="add a docstring"):
        @tool
        def no_doc(a: int) -> int:
            return a
    with pytest.raises(ToolDefinitionError, match="add a type hint"):
        @tool
        def no_hint(a) -> int:  # type: ignore[no-untyped-def]
            """Thing.

            Args:
                a: x.
            """
            return a
    with pytest.raises(ToolDefinitionError, match="no JSON Schema"):
        @tool
        def bad_type(a: bytes) -> int:
            """Thing.

            Args:
                a: x.
            """
            return 0
    with pytest.raises(ToolDefinitionError, match="not in the signature"):
        @tool
        def extra_doc(a: int) -> int:
            """Thing.

            Args:
                a: x.
                b: y.
            """
            return a
    with pytest.raises(ToolDefinitionError, match="needs idempotent=True"):
        @tool(retries=2)
        def retried(a: int) -> int:
            """Thing.

            Args:
                a: x.
            """
            return a
    with pytest.raises(ToolDefinitionError, match="must match"):
        @tool(name="has space")
        def named(a: int) -> int:
            """Thing.

            Args:
                a: x.
            """
            return a


def test_strict_only_when_the_schema_qualifies():
    assert strict_compatible(python.parameters)
    assert not strict_compatible({"type": "object", "properties": {"a": {"type": "string"}},
                                  "required": [], "additionalProperties": False})
    assert not strict_compatible({"type": "object", "properties": {}, "required": []})
    nested_open = {"type": "object", "properties": {"d": {"type": "object",
                                                          "additionalProperties": {}}},
                   "required": ["d"], "additionalProperties": False}
    assert not strict_compatible(nested_open)


def test_metadata_governs_retries():
    assert everything.idempotent and everything.read_only and everything.retries == 2
    assert python.retries == 0 and not python.idempotent and not write_file.read_only


def test_arguments_are_validated_against_the_schema():
    good = {"text": "x", "count": 2, "ratio": 0.5, "flag": True, "mode": "fast",
            "color": "blue", "tags": ["a"], "weights": {"w": 1.0}}
    kwargs = everything.validate(good)
    assert kwargs["color"] is Color.BLUE
    with pytest.raises(ToolArgumentError, match="count"):
        everything.validate({**good, "count": "two"})
    with pytest.raises(ToolArgumentError, match="'text' is a required property"):
        everything.validate({k: v for k, v in good.items() if k != "text"})
    with pytest.raises(ToolArgumentError, match="Additional properties"):
        everything.validate({**good, "surprise": 1})
    with pytest.raises(ToolArgumentError, match="must be a JSON object"):
        everything.validate(["x"])


@pytest.mark.anyio
async def test_invoke_passes_context_and_normalises_results():
    sandbox = FakeSandbox(handler=lambda argv, stdin: (stdin or b"").decode().upper())
    ctx = ToolContext(sandbox=sandbox, task=arith.family().instance(0), timeout_s=30.0)
    result = await python.invoke(ctx, {"code": "print(1)"})
    assert result.text == "PRINT(1)"
    assert sandbox.execs == [["python3", "-"]]
    out = await everything.invoke(ctx, {"text": "t", "count": 1, "ratio": 1, "flag": False,
                                        "mode": "slow", "color": "red", "tags": [],
                                        "weights": {}})
    assert out.text == "t:1:red:None"

    @tool
    def sync_tool(n: int) -> dict:
        """Sync tools run in a worker thread.

        Args:
            n: a number.
        """
        return {"n": n}

    assert (await sync_tool.invoke(ctx, {"n": 3})).text == '{"n":3}'


def test_exec_results_become_compact_observations():
    ok = ExecResult(exit_code=0, stdout="27\n", stderr="", duration_s=0.1)
    assert exec_observation(ok) == ToolResult(text="27", exit_code=0)
    failed = ExecResult(exit_code=1, stdout="", stderr="NameError: x\n", duration_s=0.1)
    assert exec_observation(failed).text == "[exit code 1]\nNameError: x"
    slow = ExecResult(exit_code=None, stdout="partial", stderr="", duration_s=3.0,
                      timed_out=True, error_type="timeout")
    observed = exec_observation(slow)
    assert observed.timed_out and observed.text.startswith("[timed out after 3.0s]")
    big = ExecResult(exit_code=0, stdout="x" * 10, stderr="", duration_s=0.1, truncated=True,
                     stdout_bytes=5000, stderr_bytes=7)
    assert exec_observation(big).original_bytes == 5007
    assert as_tool_result(None).text == "(no output)"
    with pytest.raises(TypeError, match="not JSON"):
        as_tool_result(object())



@tool
def flat(text: str, count: int, ratio: float, flag: bool, mode: Literal["a", "b"],
         level: Color, note: str | None = None) -> str:
    """A flat schema of scalars, enums and an optional string.

    Args:
        text: some text.
        count: an integer.
        ratio: a number.
        flag: a switch.
        mode: a choice.
        level: a colour.
        note: optional.
    """
    return text


JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(-2, 2),
                        st.just(1.0), st.sampled_from(["a", "b", "red", "blue", "x"]),
                        st.lists(st.integers(), max_size=2))


@settings(max_examples=300, deadline=None)
@given(arguments=st.dictionaries(
    st.sampled_from(["text", "count", "ratio", "flag", "mode", "level", "note", "extra"]),
    JSON_VALUES))
def test_validate_accepts_exactly_what_the_json_schema_validator_accepts(arguments):
    """The precompiled check never accepts what the validator rejects, and validate's verdict
    and messages are the validator's."""
    errors = list(jsonschema.Draft202012Validator(flat.parameters).iter_errors(arguments))
    quick = quick_check(flat.parameters)
    assert quick is not None, "a flat schema of scalars gets the precompiled check"
    if quick(dict(arguments)):
        assert not errors
    if errors:
        with pytest.raises(ToolArgumentError, match="bad arguments for flat"):
            flat.validate(arguments)
    else:
        kwargs = flat.validate(arguments)
        assert kwargs.get("level", Color.RED) in (Color.RED, Color.BLUE)


def test_only_flat_closed_schemas_get_the_precompiled_check():
    assert quick_check(flat.parameters) is not None and quick_check(python.parameters)
    assert quick_check(everything.parameters) is None  # lists, dicts, unions, tuples
    assert quick_check({"type": "object", "properties": {"a": {"type": "string"}}}) is None


@pytest.mark.anyio
async def test_call_runs_validated_arguments_once_enums_included():
    ctx = ToolContext(sandbox=FakeSandbox(), task=arith.family().instance(0))
    kwargs = everything.validate({"text": "t", "count": 1, "ratio": 1, "flag": False,
                                  "mode": "slow", "color": "red", "tags": [], "weights": {}})
    assert (await everything.call(ctx, kwargs)).text == "t:1:red:None"
    assert kwargs["color"] is Color.RED and "ctx" not in kwargs, "call leaves kwargs alone"
