"""`stalewise engine ...` and `stalewise model ...` commands (torch is imported inside commands)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

engine_app = typer.Typer(no_args_is_help=True)
model_app = typer.Typer(no_args_is_help=True)


@engine_app.callback()
def engine_group() -> None:
    """The embedded inference engine (a group even with one command, for `python -m engine`)."""


@model_app.command("init-tiny")
def init_tiny_command(directory: Path, seed: int = typer.Option(0, help="weight init seed")) -> None:
    """Create the tiny default model (about 1M parameters) and its tokenizer in DIRECTORY."""
    from engine.tiny import init_tiny

    init_tiny(directory, seed=seed)
    typer.echo(f"tiny model written to {directory}")


@engine_app.command("serve")
def serve_command(
    model: Path = typer.Option(..., "--model", help="Hugging Face checkpoint directory"),
    port: int = typer.Option(8000, help="TCP port; 0 picks a free one (see --port-file)"),
    host: str = typer.Option("127.0.0.1", help="interface to bind"),
    port_file: Path | None = typer.Option(None, help="write the bound port here once listening"),
    initial_version: int = typer.Option(0, help="policy version of the weights in --model"),
    max_batch: int = typer.Option(64, min=1, help="sequences decoded together at most"),
    session_cache_mb: float = typer.Option(256.0, min=0.0, help="KV kept for sessions between turns"),
    seed: int = typer.Option(0, help="seed of the sampler for requests without their own seed"),
    threads: int = typer.Option(1, min=1, help="torch CPU threads (1 is fastest for tiny models)"),
    max_model_len: int | None = typer.Option(
        None, min=2, help="context length cap (default: the model's); bounds KV memory"),
    served_model_name: str | None = typer.Option(None, help="name in /v1/models (default: --model)"),
    log_level: str = typer.Option("warning", help="uvicorn log level"),
    max_resident_versions: int = typer.Option(
        4, min=1, help="weights versions held at once for pinned requests (mode=pin)"),
) -> None:
    """Serve MODEL over HTTP: vLLM-compatible /v1/completions plus the stalewise routes."""
    from engine.checkpoint import CheckpointError, read_config

    try:
        read_config(model)  # fail fast, before importing torch
        from engine.server import serve

        serve(model, host=host, port=port, port_file=port_file, version=initial_version,
              max_batch=max_batch, session_cache_mb=session_cache_mb, seed=seed, threads=threads,
              max_model_len=max_model_len, served_model_name=served_model_name,
              log_level=log_level, max_resident_versions=max_resident_versions)
    except CheckpointError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    except OSError as exc:  # port in use, unreadable files
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc


@model_app.command("import")
def import_command(
    gguf_file: Path = typer.Argument(..., help="a .gguf model file transformers can read"),
    out_dir: Path = typer.Argument(..., help="checkpoint directory to create (must not exist)"),
) -> None:
    """Convert a GGUF file (dequantized to float32) into a Hugging Face checkpoint directory."""
    from engine.checkpoint import SUPPORTED_MODEL_TYPES
    from engine.gguf_import import GgufImportError, import_gguf

    if not sys.stderr.isatty():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        imported = import_gguf(gguf_file, out_dir)
    except GgufImportError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    typer.echo(f"{imported.model_type} model, {imported.parameters / 1e6:.1f}M parameters, "
               f"vocabulary {imported.vocab_size}, written to {imported.directory}")
    if not imported.has_chat_template:
        typer.echo("note: the GGUF file carries no chat template, so chat_format = \"template\" "
                   "cannot be used with this checkpoint")
    if imported.model_type not in SUPPORTED_MODEL_TYPES:
        typer.echo(f"note: the embedded engine does not serve {imported.model_type}; "
                   f"serve this checkpoint with vLLM")
