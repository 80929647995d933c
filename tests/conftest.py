"""Shared fixtures: fresh SQLite and PostgreSQL databases for store tests.

Hypothesis runs without its per-example deadline (200 ms by default) or its too-slow health
check: both are wall-clock bounds that a loaded machine breaks.
"""

from __future__ import annotations

import os
import uuid
from typing import Iterator

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("stalewise", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("stalewise")

PG_ADMIN_URL = os.environ.get(
    "STALEWISE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:54329/stalewise_test")


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'store.db'}"


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A new, empty PostgreSQL database (dropped afterwards) on the test server."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import OperationalError

    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"t_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as c:
            c.execute(text(f"CREATE DATABASE {name}"))
    except OperationalError as exc:
        admin.dispose()
        pytest.fail(f"PostgreSQL test server not reachable at {PG_ADMIN_URL} ({exc.orig}); "
                    f"start it with: bash scripts/ensure_postgres.sh")
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    try:
        yield url
    finally:
        with admin.connect() as c:
            c.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()
