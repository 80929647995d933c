"""`stalewise audit export --run RUN --format inspect|parquet|jsonl OUT`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from core.store.db import DEFAULT_URL

if TYPE_CHECKING:
    from core.store.store import Store

FORMATS = ("inspect", "parquet", "jsonl")


def export_command(out: Path = typer.Argument(..., help="output file (parquet, jsonl) or "
                                              "directory (inspect)"),
                   run: str = typer.Option(..., "--run", help="run id"),
                   format: str = typer.Option(..., "--format", help="inspect | parquet | jsonl"),
                   url: str = typer.Option(DEFAULT_URL, "--url",
                                           help="SQLite path/URL or PostgreSQL URL"),
                   tokenizer: str | None = typer.Option(None, help="model dir for token text "
                                                        "(default: the run's model)")) -> None:
    """Export a run: Inspect AI eval log (one sample per trajectory) or one row per token."""
    from core.store.db import StoreOpenError
    from core.store.store import Store

    if format not in FORMATS:
        typer.echo(f"error: --format {format!r} is not one of {', '.join(FORMATS)}", err=True)
        raise typer.Exit(2)
    try:
        store = Store.open_readonly(url)
    except StoreOpenError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    try:
        require_run(store, run, url)
        written = _write(store, run, out, format, tokenizer)
    except typer.Exit:
        raise  # click's Exit is a RuntimeError too: not an export failure to print
    except RuntimeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        store.close()
    typer.echo(written)


def require_run(store: Store, run: str, url: str) -> None:
    """Exit 1 with a line naming the store and the command that lists its runs when `run` is
    not one of them (a mistyped id would otherwise read as a run with nothing in it)."""
    if store.run(run) is None:
        typer.echo(f"error: no run {run!r} in {store.url}; list runs with: "
                   f"stalewise audit runs --url {url}", err=True)
        raise typer.Exit(1)


def _write(store: Store, run: str, out: Path, format: str, tokenizer: str | None) -> str:
    from stalewise import exports

    if format == "inspect":
        return f"wrote {exports.write_inspect(store, run, out, tokenizer)}"
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = exports.write_parquet if format == "parquet" else exports.write_jsonl
    rows = writer(store, run, out, tokenizer_dir=tokenizer)
    return f"wrote {rows} token rows to {out}"
