"""`stalewise engine ...` and `stalewise model ...` commands (torch is imported inside commands)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from config.engine import EngineServerConfig

# `python -m engine serve` runs as a job's child (see learner/cli.py): plain tracebacks
engine_app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False)
model_app = typer.Typer(no_args_is_help=True)


def _help(field: str) -> str:
    info = EngineServerConfig.model_fields[field]
    return f"{info.description} (default {info.default})"


def _server_config(path: Path | None, overrides: dict) -> EngineServerConfig:
    """The engine's config: the JSON file (or the defaults) with the given fields replaced."""
    from config.errors import read_json, validate

    data = read_json(path, "an engine config (the job's engine.json)") if path is not None else {}
    return validate(EngineServerConfig, {**data, **overrides}, str(path or "engine flags"))


@engine_app.callback()
def engine_group() -> None:
    """The embedded inference engine (a group even with one command, for `python -m engine`)."""


@model_app.command("init-tiny")
def init_tiny_command(directory: Path, seed: int = typer.Option(0, help="weight init seed")) -> None:
    """Create the tiny default model (about 1M parameters) and its tokenizer in DIRECTORY."""
    from engine.tiny import init_tiny

    try:
        init_tiny(directory, seed=seed)
    except OSError as exc:  # a folder that cannot be made or written
        typer.echo(f"error: cannot write the tiny model to {directory}: {exc.strerror or exc}; "
                   "pass a folder you can write to", err=True)
        raise typer.Exit(code=1) from None
    typer.echo(f"tiny model written to {directory}")


@engine_app.command("serve")
def serve_command(
    model: Path = typer.Option(..., "--model", help="Hugging Face checkpoint directory"),
    port: int = typer.Option(8000, help="TCP port; 0 picks a free one (see --port-file)"),
    host: str = typer.Option("127.0.0.1", help="interface to bind"),
    port_file: Path | None = typer.Option(None, help="write the bound port here once listening"),
    initial_version: int = typer.Option(0, help="policy version of the weights in --model"),
    seed: int = typer.Option(0, help="seed of the sampler for requests without their own seed"),
    config: Path | None = typer.Option(
        None, help="EngineServerConfig as JSON (the job writes engine.json); flags override it"),
    max_batch: int | None = typer.Option(None, min=1, help=_help("max_batch")),
    session_cache_mb: float | None = typer.Option(None, min=0.0, help=_help("session_cache_mb")),
    threads: int | None = typer.Option(None, min=1, help=_help("threads")),
    dtype: str | None = typer.Option(None, help=_help("dtype")),
    max_model_len: int | None = typer.Option(None, min=2, help=_help("max_model_len")),
    served_model_name: str | None = typer.Option(None, help=_help("served_model_name")),
    log_level: str | None = typer.Option(None, help=_help("log_level")),
    max_resident_versions: int | None = typer.Option(
        None, min=1, help=_help("max_resident_versions")),
) -> None:
    """Serve MODEL over HTTP: vLLM-compatible /v1/completions plus the stalewise routes."""
    from config.errors import ConfigError
    from core.listen import ListenError
    from engine.checkpoint import CheckpointError, read_config

    flags = dict(max_batch=max_batch, session_cache_mb=session_cache_mb, threads=threads,
                 dtype=dtype, max_model_len=max_model_len, served_model_name=served_model_name,
                 log_level=log_level, max_resident_versions=max_resident_versions)
    try:
        cfg = _server_config(config, {k: v for k, v in flags.items() if v is not None})
        read_config(model)  # fail fast, before importing torch
        from engine.server import serve

        serve(model, cfg, host=host, port=port, port_file=port_file, version=initial_version,
              seed=seed)
    except (CheckpointError, ConfigError, ListenError) as exc:
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
