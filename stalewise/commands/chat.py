"""`stalewise chat check`: does a chat format give exactly the tokens of a model's own template?

Runs the conformance battery (`tasks.chat.conformance.BATTERY`) with the tokenizer's chat
template and prints, per case, whether every prompt equals the template's tokens (else the first
differing token with context), whether the conversation stayed append-only (else why a new
training segment started), and whether the format parsed the calls back. Exit status 1 when any
case does not conform.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True)


@app.command("check")
def check_command(
        tokenizer: Path = typer.Option(..., "--tokenizer", help="a Hugging Face tokenizer or "
                                       "checkpoint directory with a chat template"),
        format_name: str | None = typer.Option(
            None, "--format", help="hermes | template | qwen2.5 | qwen3 | llama3.1 | "
                                   "mistral-v0.3 (default: recognised from the template)"),
        require_append_only: bool = typer.Option(
            False, help="also fail a case that needs a new training segment"),
        as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """Check a chat format against the tokenizer's own chat template, case by case."""
    from tasks.chat import FORMAT_KINDS, make_chat_format
    from tasks.chat.conformance import check_format

    if format_name is not None and format_name not in FORMAT_KINDS:
        typer.echo(f"error: --format {format_name!r} is not one of {', '.join(FORMAT_KINDS)}",
                   err=True)
        raise typer.Exit(2)
    loaded = _load(tokenizer)
    try:
        fmt = make_chat_format(loaded, format_name or "auto")
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    name = getattr(fmt, "name", "hermes")
    results = check_format(fmt, loaded, require_append_only=require_append_only)
    failed = [r for r in results if r.status == "fail"]
    if as_json:
        typer.echo(json.dumps(dict(format=name, tokenizer=str(tokenizer),
                                   cases=[r.as_dict() for r in results]), indent=2))
    else:
        picked = "given" if format_name else "recognised from the template"
        typer.echo(f"format {name} ({picked}), tokenizer {tokenizer}")
        for r in results:
            line = (f"{r.status:11s} {r.name}: {r.prompts_checked} prompts, "
                    f"{'equal' if r.equal else 'DIFFERENT'}, "
                    f"{'append-only' if r.append_only else 'new segment'}"
                    f"{'' if r.parsed else ', calls NOT parsed back'}")
            typer.echo(line)
            for detail in ([r.difference] if r.difference else []) + r.breaks + (
                    [r.note] if r.note else []):
                typer.echo(f"            {detail}")
        unsupported = sum(r.status == "unsupported" for r in results)
        typer.echo(f"{sum(r.status == 'ok' for r in results)} of {len(results)} cases conform, "
                   f"{unsupported} the template itself refuses, {len(failed)} fail"
                   + (f": {', '.join(r.name for r in failed)}" if failed else ""))
    if failed:
        raise typer.Exit(1)


def _load(directory: Path):
    if not directory.is_dir():
        typer.echo(f"error: --tokenizer {str(directory)!r} is not a directory", err=True)
        raise typer.Exit(2)
    from core.tokenizer import has_tokenizer

    if not has_tokenizer(directory):
        typer.echo(f"error: --tokenizer {str(directory)!r} holds no tokenizer (no "
                   "tokenizer.json or tokenizer_config.json); pass a model folder that has one",
                   err=True)
        raise typer.Exit(2)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as exc:
        reason = " ".join(str(exc).split())  # transformers' messages run over several lines
        typer.echo(f"error: cannot load a tokenizer from {str(directory)!r}: {reason}", err=True)
        raise typer.Exit(2) from None
    if not getattr(tokenizer, "chat_template", None):
        typer.echo(f"error: the tokenizer in {str(directory)!r} has no chat template; "
                   "nothing to check against", err=True)
        raise typer.Exit(2)
    return tokenizer
