"""`Store.open_readonly`: reads work, every write is refused by the database itself."""

from __future__ import annotations

import pytest
from sqlalchemy.exc import DBAPIError

from core.store.db import StaleSchemaError, StoreMissingError, upgrade
from core.store.store import Store


def _check_readonly(url: str) -> None:
    writer = Store.open(url, create=True)
    writer.create_run("r1", name="r", config={}, pipeline_mode="async")
    reader = Store.open_readonly(url)
    try:
        assert [r.id for r in reader.runs()] == ["r1"]
        with pytest.raises(DBAPIError, match="(?i)read.?only"):
            reader.create_run("r2", name="r", config={}, pipeline_mode="async")
        with pytest.raises(DBAPIError, match="(?i)read.?only"):
            reader.set_run_status("r1", "finished")
        # a reader never blocks the writer (SQLite: no write lock is taken)
        with reader.engine.connect() as c:
            c.exec_driver_sql("SELECT count(*) FROM runs").scalar()
            writer.set_run_status("r1", "finished")
        assert reader.run("r1").status == "finished"
    finally:
        reader.close()
        writer.close()


def test_sqlite_readonly_store_refuses_writes(sqlite_url):
    _check_readonly(sqlite_url)


@pytest.mark.postgres
def test_postgres_readonly_store_refuses_writes(pg_url):
    _check_readonly(pg_url)


def test_readonly_store_needs_an_existing_database_at_head(tmp_path):
    with pytest.raises(StoreMissingError, match=f"no store at {tmp_path / 'missing.db'}: "):
        Store.open_readonly(str(tmp_path / "missing.db"))
    assert not (tmp_path / "missing.db").exists()
    url = f"sqlite:///{tmp_path / 'old.db'}"
    upgrade(url, "0001")
    with pytest.raises(StaleSchemaError, match="stalewise db upgrade"):
        Store.open_readonly(url)
