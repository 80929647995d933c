"""The committed schema snapshot: the DDL SQLite holds after `upgrade head`, one statement each.

A test diffs it against `core/store/migrations/schema_snapshot.sql`, so any schema change shows up in
review as a readable diff. Regenerate after adding a migration:

    .venv/bin/python -m core.store.snapshot > core/store/migrations/schema_snapshot.sql
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from sqlalchemy import text

from core.store.db import MIGRATIONS_DIR, make_engine, upgrade

SNAPSHOT_PATH = MIGRATIONS_DIR / "schema_snapshot.sql"


def schema_ddl() -> str:
    with tempfile.TemporaryDirectory() as directory:
        url = f"sqlite:///{Path(directory) / 'snapshot.db'}"
        upgrade(url)
        engine = make_engine(url)
        with engine.connect() as c:
            rows = c.execute(text("SELECT name, sql FROM sqlite_master WHERE sql IS NOT NULL "
                                  "AND name NOT LIKE 'sqlite_%' ORDER BY type DESC, name"))
            statements = [re.sub(r"\s+\n", "\n", sql.strip()) + ";" for _, sql in rows]
        engine.dispose()
    return "\n\n".join(statements) + "\n"


if __name__ == "__main__":
    print(schema_ddl(), end="")
