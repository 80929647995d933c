"""`stalewise tasks ...`: list, show and export the tools of task families (no torch, no sandbox).

`check` needs a sandbox for Harbor folders, so it lives in `stalewise/commands/tasks.py`.
"""

from __future__ import annotations

import json
from typing import Any

import typer

app = typer.Typer(no_args_is_help=True)

OPTIONS_HELP = 'factory options as JSON, e.g. \'{"max_k": 5}\''


def parse_options(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError as err:
        raise typer.BadParameter(f"--options is not JSON ({err.msg}); e.g. '{{\"seed\": 1}}'")
    if not isinstance(value, dict):
        raise typer.BadParameter("--options must be a JSON object")
    return value


def load_or_exit(ref: str, options: str) -> Any:
    from tasks.loading import TaskLoadError, load_family

    try:
        return load_family(ref, parse_options(options))
    except TaskLoadError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(code=1) from None


@app.command("list")
def list_command() -> None:
    """List the task families installed as entry points (group stalewise.tasks)."""
    from tasks.loading import available_entry_points

    for name in available_entry_points():
        typer.echo(name)


@app.command("show")
def show_command(ref: str = typer.Argument(..., help="family reference (file.py:attr, name)"),
                 options: str = typer.Option("", help=OPTIONS_HELP),
                 count: int = typer.Option(3, min=1, help="instances to show"),
                 split: str = typer.Option("train", help="split to draw from")) -> None:
    """Print the first instances of a family: key, difficulty, hash, prompt, tools."""
    family = load_or_exit(ref, options)
    if split not in family.splits:
        raise typer.BadParameter(f"{family.name} has the splits {', '.join(family.splits)}, "
                                 f"not {split!r}", param_hint="--split")
    for task in family.instances(split, count=count):
        prompt = " | ".join(f"{m.role}: {m.content}" for m in task.prompt)
        typer.echo(f"{task.key}  [{task.difficulty}]  {task.content_hash[:12]}")
        typer.echo(f"  tools: {', '.join(t.name for t in task.tools) or '-'}")
        typer.echo(f"  prompt: {prompt}")


@app.command("tools")
def tools_command(ref: str = typer.Argument(..., help="family reference (file.py:attr, name, "
                                                      "harbor:PATH)"),
                  fmt: str = typer.Option("openai", "--format",
                                          help="openai (function tools) or mcp (tool descriptors)"),
                  options: str = typer.Option("", help=OPTIONS_HELP),
                  count: int = typer.Option(20, min=1, help="instances whose tools to collect")
                  ) -> None:
    """Print the family's tools (union over its first instances) as JSON."""
    from tasks.tool_export import export_tools

    if fmt not in ("openai", "mcp"):
        raise typer.BadParameter(f"--format must be openai or mcp, not {fmt!r}")
    family = load_or_exit(ref, options)
    tools: dict[str, Any] = {}
    for task in family.instances("train", count=count):
        for tool in task.tools:
            tools.setdefault(tool.name, tool)
    typer.echo(json.dumps(export_tools(list(tools.values()), fmt), indent=2))
