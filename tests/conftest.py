"""Shared fixtures: fresh SQLite and PostgreSQL databases for store tests; the real checkpoint."""

from __future__ import annotations

import os
from pathlib import Path
import uuid
from typing import Iterator

import pytest

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


SMOLLM2_DIR = Path(__file__).resolve().parents[1] / "var" / "models" / "smollm2-135m"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a float32 checkpoint, built by the test set-up (never committed)."""
    if not (SMOLLM2_DIR / "model.safetensors").is_file():
        pytest.fail(f"{SMOLLM2_DIR} is missing; build it with: bash scripts/fetch_models.sh")
    return SMOLLM2_DIR
