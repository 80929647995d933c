"""`stalewise db upgrade|downgrade|check`."""

from __future__ import annotations

import typer

from core.store.db import DEFAULT_URL, StoreOpenError, normalize_url

app = typer.Typer(no_args_is_help=True)
URL = typer.Option(DEFAULT_URL, "--url", help="SQLite path/URL or PostgreSQL URL")


def _exit(exc: StoreOpenError) -> None:
    typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(1) from None


@app.command()
def upgrade(url: str = URL, revision: str = typer.Argument("head")) -> None:
    """Migrate the database to REVISION (default: head), creating it if needed."""
    from core.store.db import upgrade as run_upgrade

    try:
        reached = run_upgrade(url, revision)
    except StoreOpenError as exc:
        _exit(exc)
    typer.echo(f"{normalize_url(url)}: at revision {reached or 'base'}")


@app.command()
def downgrade(url: str = URL, revision: str = typer.Argument(...)) -> None:
    """Migrate the database down to REVISION ('base' removes every table)."""
    from core.store.db import downgrade as run_downgrade

    try:
        reached = run_downgrade(url, revision)
    except StoreOpenError as exc:
        _exit(exc)
    typer.echo(f"{normalize_url(url)}: at revision {reached or 'base'}")


@app.command()
def check(url: str = URL) -> None:
    """Exit non-zero unless the schema is at head; says which command fixes it."""
    from core.store.db import check_schema, reached_engine

    try:
        engine = reached_engine(url)
    except StoreOpenError as exc:
        _exit(exc)
    try:
        check_schema(engine, normalize_url(url))
    except StoreOpenError as exc:
        _exit(exc)
    finally:
        engine.dispose()
    typer.echo(f"{normalize_url(url)}: schema at head")
