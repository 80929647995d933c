"""`stalewise view --url DB`: serve the viewer on 127.0.0.1 (heavy imports inside)."""

from __future__ import annotations

import typer

from core.store.db import DEFAULT_URL


def view_command(url: str = typer.Option(DEFAULT_URL, "--url",
                                         help="SQLite path/URL or PostgreSQL URL"),
                 host: str = typer.Option("127.0.0.1", help="address to bind (local only by "
                                          "default; the viewer has no authentication)"),
                 port: int = typer.Option(8321, help="port to listen on")) -> None:
    """Browse runs, dashboards, trajectories and tokens in a web browser (read-only)."""
    import uvicorn

    from core.store.db import StoreOpenError
    from core.store.store import Store
    from viewer.app import create_app

    try:
        store = Store.open_readonly(url)
    except StoreOpenError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"stalewise view: http://{host}:{port}/ (read-only, {store.url}); Ctrl-C stops")
    try:
        uvicorn.run(create_app(store), host=host, port=port, log_level="warning")
    finally:
        store.close()
