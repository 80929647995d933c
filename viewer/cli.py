"""`stalewise view --url DB`: serve the viewer on 127.0.0.1 (heavy imports inside)."""

from __future__ import annotations

import typer

from core.store.db import DEFAULT_URL


def view_command(url: str = typer.Option(DEFAULT_URL, "--url",
                                         help="SQLite path/URL or PostgreSQL URL"),
                 host: str = typer.Option("127.0.0.1", help="address to bind (local only by "
                                          "default; the viewer has no authentication)"),
                 port: int = typer.Option(8321, help="port to listen on; 0 picks a free one")
                 ) -> None:
    """Browse runs, dashboards, trajectories and tokens in a web browser (read-only)."""
    import uvicorn

    from core.listen import ListenError, listen
    from core.store.db import StoreOpenError
    from core.store.store import Store
    from viewer.app import create_app

    try:
        store = Store.open_readonly(url)
    except StoreOpenError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    try:
        try:
            sock = listen(host, port)
        except ListenError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        bound = sock.getsockname()[1]  # the port itself: --port 0 picks one
        typer.echo(f"stalewise view: http://{host}:{bound}/ (read-only, {store.url}); "
                   "Ctrl-C stops")
        server = uvicorn.Server(uvicorn.Config(create_app(store), log_level="warning"))
        server.run(sockets=[sock])
    finally:
        store.close()
