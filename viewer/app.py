"""The Starlette app: four pages over one read-only store, static files from the package.

Guarantees: the store is opened read-only (`Store.open_readonly`), so no request can change the
database; every page sends a Content-Security-Policy that allows only this server's own script,
a second line of defence behind escaping; a bad query parameter is a 400 with a one-line
message, an unknown id a 404.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from core.store import audit
from core.store.store import Store
from viewer.html import esc, page
from viewer.runs import dashboard_page, runs_page
from viewer.table import INT64_END, BadQuery, trajectories_page
from viewer.trajectory import Decoders, trajectory_page

STATIC = Path(__file__).parent / "static"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
       "img-src 'self' data:; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")


def _html(body: str | None, what: str) -> Response:
    if body is None:
        return _error(404, f"no {what} in this database")
    return HTMLResponse(body, headers={"Content-Security-Policy": CSP})


def _error(status: int, message: str) -> Response:
    return HTMLResponse(page("error", f'<p class="err">{esc(message)}</p>'), status_code=status,
                        headers={"Content-Security-Policy": CSP})


def create_app(store: Store) -> Starlette:
    """The viewer over `store` (which the caller opened read-only and closes)."""

    @lru_cache(maxsize=16)
    def decoders_for(run_id: str) -> Decoders:
        return Decoders(audit.token_decoder(store, run_id, None),
                        audit.text_decoder(store, run_id, None))

    def runs(request: Request) -> Response:
        return _html(runs_page(store), "runs")

    def dashboard(request: Request) -> Response:
        run_id = request.path_params["run_id"]
        return _html(dashboard_page(store, run_id), f"run {run_id}")

    def trajectories(request: Request) -> Response:
        run_id = request.path_params["run_id"]
        try:
            return _html(trajectories_page(store, run_id, request.query_params), f"run {run_id}")
        except BadQuery as exc:
            return _error(400, str(exc))

    def trajectory(request: Request) -> Response:
        trajectory_id = request.path_params["trajectory_id"]
        if trajectory_id >= INT64_END:  # no such row can exist (was a 500)
            return _html(None, f"trajectory {trajectory_id}")
        return _html(trajectory_page(store, trajectory_id, request.query_params, decoders_for),
                     f"trajectory {trajectory_id}")

    return Starlette(routes=[
        Route("/", runs),
        Route("/runs/{run_id}", dashboard),
        Route("/runs/{run_id}/trajectories", trajectories),
        Route("/trajectories/{trajectory_id:int}", trajectory),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ])
