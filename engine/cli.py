"""`stalewise engine ...` and `stalewise model ...` commands (torch is imported inside commands)."""

from __future__ import annotations

from pathlib import Path

import typer

engine_app = typer.Typer(no_args_is_help=True)
model_app = typer.Typer(no_args_is_help=True)


@model_app.command("init-tiny")
def init_tiny_command(directory: Path, seed: int = typer.Option(0, help="weight init seed")) -> None:
    """Create the tiny default model (about 1M parameters) and its tokenizer in DIRECTORY."""
    from engine.tiny import init_tiny

    init_tiny(directory, seed=seed)
    typer.echo(f"tiny model written to {directory}")
