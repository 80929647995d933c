"""`stalewise tasks tools --format openai|mcp`: OpenAI strict mode exactly when the schema
qualifies, checked against `openai.pydantic_function_tool` for equivalent pydantic models."""

from __future__ import annotations

import json
from typing import Any, Literal

import openai
from pydantic import BaseModel, Field
from typer.testing import CliRunner

from tasks.cli import app
from tasks.tool_export import mcp_tool_descriptor, openai_function_tool
from tasks.tools import ToolContext, tool


@tool
def search(ctx: ToolContext, query: str, mode: Literal["exact", "fuzzy"],
           limit: int | None = None, tags: list[str] | None = None) -> str:
    """Search the repository.

    Args:
        query: what to look for.
        mode: exact substring or fuzzy match.
        limit: at most this many hits.
        tags: only files with these tags.
    """
    return ""


class SearchArgs(BaseModel):
    """Search the repository."""

    query: str = Field(description="what to look for.")
    mode: Literal["exact", "fuzzy"] = Field(description="exact substring or fuzzy match.")
    limit: int | None = Field(None, description="at most this many hits.")
    tags: list[str] | None = Field(None, description="only files with these tags.")


@tool
def page(count: int = 5) -> str:
    """Show a page.

    Args:
        count: lines.
    """
    return ""


@tool
def label(names: dict[str, str]) -> str:
    """Label things.

    Args:
        names: thing -> label.
    """
    return ""


def _without_titles(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_titles(v) for k, v in value.items() if k != "title"}
    if isinstance(value, list):
        return [_without_titles(v) for v in value]
    return value


def test_strict_tools_match_the_openai_package_for_an_equivalent_model():
    ours = openai_function_tool(search)
    theirs = openai.pydantic_function_tool(SearchArgs, name="search")
    theirs_parameters = _without_titles(theirs["function"]["parameters"])
    theirs_parameters.pop("description")  # the model docstring; ours is the function's
    assert ours["function"]["strict"] is theirs["function"]["strict"] is True
    assert ours["function"]["parameters"] == theirs_parameters
    assert ours["function"]["description"] == theirs["function"]["description"]
    assert search.parameters["required"] == ["query", "mode"]  # the tool itself is unchanged


def test_schemas_that_do_not_qualify_are_exported_without_strict():
    for unqualified in (page, label):  # a non-None default; an open object
        exported = openai_function_tool(unqualified)["function"]
        assert "strict" not in exported and exported["parameters"] == unqualified.parameters


def test_mcp_descriptors_and_the_cli():
    descriptor = mcp_tool_descriptor(search)
    assert descriptor["inputSchema"] == search.parameters
    assert descriptor["annotations"] == {"readOnlyHint": False, "idempotentHint": False}
    runner = CliRunner()
    shown = runner.invoke(app, ["tools", "arith", "--format", "openai"])
    assert shown.exit_code == 0, shown.output
    [python] = json.loads(shown.output)
    assert python["function"]["name"] == "python" and python["function"]["strict"] is True
    shown = runner.invoke(app, ["tools", "codefix", "--format", "mcp"])
    assert {t["name"] for t in json.loads(shown.output)} == {"bash", "write_file"}
    assert runner.invoke(app, ["tools", "arith", "--format", "xml"]).exit_code != 0
