"""Connecting to the store, migrating it, and refusing a schema that is not at head.

SQLite (the default) runs in WAL mode with a busy timeout, and every transaction starts with
`BEGIN IMMEDIATE`: a writer takes the write lock before it reads, so read-then-write logic
(sequence numbers, get-or-create) cannot interleave with another writer's and produce duplicates.
PostgreSQL is selected by URL (`postgresql+psycopg://...`); there, sequence numbers come from
an atomic `UPDATE ... RETURNING` on the run row.

Migrations of one database take turns, so that several jobs can start on one new store at once:
on SQLite the migration's `BEGIN IMMEDIATE` holds the write lock, on PostgreSQL the migration's
transaction first takes an advisory lock (`MIGRATION_LOCK`). The job that waited then finds the
schema at head and migrates nothing. (Without the lock, both would create the tables, and
PostgreSQL would refuse the second's with a duplicate key in its catalog.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic import util as alembic_util
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event, inspect
from sqlalchemy.engine import make_url
from sqlalchemy.exc import InterfaceError, OperationalError

from core.store import migrations

MIGRATIONS_DIR = Path(migrations.__file__).parent
DEFAULT_URL = "sqlite:///var/stalewise.db"
SQLITE_BUSY_TIMEOUT_MS = 30_000
MIGRATION_LOCK = 0x73746C77  # a PostgreSQL advisory lock's key ("stlw"), held while migrating


class StoreOpenError(RuntimeError):
    """The store cannot be opened; the message says what is wrong and what fixes it."""


class StaleSchemaError(StoreOpenError):
    """The database schema is not at the migrations' head."""


class StoreUnreachableError(StoreOpenError):
    """The database cannot be connected to: a server that is down or elsewhere, wrong
    credentials or database name, a SQLite file that cannot be created or opened."""


class MigrationTargetError(StoreOpenError):
    """`db upgrade` / `db downgrade` was given a revision the migrations cannot go to."""


class StoreMissingError(StoreOpenError):
    """A command that reads a store was given a SQLite path where no file is: it names the
    path it looked at (`path`, absolute) and never creates one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        super().__init__(f"no store at {path}: no such file; pass --url with the store a job "
                         "wrote (its config's run.db_url; a relative path counts from the "
                         "current folder)")


def _require_existing(url: str) -> None:
    """Raise StoreMissingError when `url` is a SQLite file that does not exist (a typo, a
    relative path from another folder, a job that has not run yet), so that opening a store
    without `create` leaves no empty database behind."""
    parsed = make_url(normalize_url(url))
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return
    path = Path(parsed.database)
    if not path.is_file():
        raise StoreMissingError(path.resolve())


def _shown_url(url: str) -> str:
    """`url` as messages show it: normalized, any password as ***."""
    return make_url(normalize_url(url)).render_as_string(hide_password=True)


def reached_engine(url: str, *, create: bool = False) -> Engine:
    """`make_engine(url)` once a connection to it has opened (see `reach`). Only with `create`
    may a SQLite file (and its folder) be made: without, a missing one is StoreMissingError."""
    if not create:
        _require_existing(url)
    with _reaching(url):  # a SQLite file's folder is made here
        engine = make_engine(url)
    reach(engine, url)
    return engine


def reach(engine: Engine, url: str) -> None:
    """Connect to the store once, before any work that would fail on it with a traceback: a
    failure disposes of `engine` and is `StoreUnreachableError` (see `_reaching`)."""
    try:
        with _reaching(url):
            engine.connect().close()
    except StoreUnreachableError:
        engine.dispose()
        raise


@contextmanager
def _reaching(url: str) -> Iterator[None]:
    """A failure to connect inside (or to make a SQLite file's folder) becomes
    `StoreUnreachableError`: one line that names the store and what to check, with the driver's
    own words in the middle. Wrap connecting only: a failing statement is not unreachability."""
    try:
        yield
    except (OperationalError, InterfaceError, OSError) as exc:
        orig = getattr(exc, "orig", None) or exc
        reason = " ".join(str(orig).split())
        if make_url(normalize_url(url)).get_backend_name() == "sqlite":
            fix = "check that its folder exists and is writable, or pass another path"
        else:
            fix = ("check that the PostgreSQL server is running there and that the host, port, "
                   "user, password and database name are right")
        raise StoreUnreachableError(
            f"cannot open the store at {_shown_url(url)}: {reason}; {fix}") from None


def normalize_url(url: str) -> str:
    """Accept a plain file path for SQLite and the driverless `postgresql://` form."""
    if "://" not in url:
        return f"sqlite:///{url}"
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def make_engine(url: str = DEFAULT_URL) -> Engine:
    url = normalize_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True, pool_size=8, max_overflow=8)
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000,
                                              "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _configure(dbapi_connection, _record) -> None:
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves, below
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin_immediate(connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def make_readonly_engine(url: str = DEFAULT_URL) -> Engine:
    """An engine that cannot write: SQLite opened with `mode=ro` (plain deferred transactions,
    no write lock taken), PostgreSQL sessions with `default_transaction_read_only` on. For
    readers such as `stalewise view`; a missing SQLite file is an error, never created."""
    url = normalize_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True, pool_size=4, max_overflow=4,
                             connect_args={"options": "-c default_transaction_read_only=on"})
    _require_existing(url)
    path = Path(parsed.database or "")
    ro_url = f"sqlite:///file:{path.resolve()}?mode=ro&uri=true"
    engine = create_engine(ro_url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000,
                                                 "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _configure(dbapi_connection, _record) -> None:
        dbapi_connection.isolation_level = None
        dbapi_connection.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")

    @event.listens_for(engine, "begin")
    def _begin_deferred(connection) -> None:
        connection.exec_driver_sql("BEGIN")

    return engine


def open_readonly_engine(url: str = DEFAULT_URL) -> Engine:
    """A read-only engine on a store at head (StaleSchemaError says how to migrate)."""
    engine = make_readonly_engine(url)
    reach(engine, url)
    try:
        check_schema(engine, normalize_url(url))
    except BaseException:
        engine.dispose()
        raise
    return engine


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return config


def head_revision() -> str:
    return ScriptDirectory.from_config(alembic_config(DEFAULT_URL)).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def _migrate(url: str, name: str, revision: str, *, create: bool) -> str | None:
    """Run Alembic's `name` command (upgrade, downgrade) on our own connection (so SQLite gets
    its pragmas and locking); only with `create` may a SQLite file be made. Returns the
    revision the store is at after (None: base). A target the store cannot go to, or did not
    reach (`upgrade` to a revision below the store's, which Alembic passes over), is
    MigrationTargetError."""
    engine = reached_engine(url, create=create)
    try:
        with engine.begin() as connection:
            if connection.dialect.name == "postgresql":  # released when the transaction ends
                connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")
            config = alembic_config(url)
            config.attributes["connection"] = connection
            known = [s.revision for s in ScriptDirectory.from_config(config).walk_revisions()]
            try:
                getattr(command, name)(config, revision)
            except alembic_util.CommandError as exc:  # an unknown id, or the wrong direction
                raise MigrationTargetError(
                    f"cannot migrate {_shown_url(url)} to {revision!r}: {exc}; the revisions "
                    f"are base, {', '.join(reversed(known))} (head); `stalewise db check` says "
                    "where the store is") from None
            reached = MigrationContext.configure(connection).get_current_revision()
            wanted = {"head": known[0], "base": None}.get(revision, revision)
            if wanted != reached and (wanted is None or wanted in known):
                other = {"upgrade": "downgrade", "downgrade": "upgrade"}[name]
                raise MigrationTargetError(
                    f"{_shown_url(url)} is at revision {reached or 'base'}, not {revision}: "
                    f"`db {name}` only moves {name[:-len('grade')]}; run: stalewise db {other} "
                    f"{revision} --url {_shown_url(url)}")
            return reached
    finally:
        engine.dispose()


def upgrade(url: str, revision: str = "head") -> str | None:
    """Migrate the store at `url` up to `revision`, making it if need be; returns where it is."""
    return _migrate(url, "upgrade", revision, create=True)


def downgrade(url: str, revision: str = "base") -> str | None:
    """Migrate the store at `url` down to `revision`; returns where it is (None: base)."""
    return _migrate(url, "downgrade", revision, create=False)


def check_schema(engine: Engine, url: str) -> None:
    """Raise StaleSchemaError, naming the command that fixes it, unless the schema is at head
    (`reach` the engine first for a one-line error when the database cannot be reached)."""
    current, head = current_revision(engine), head_revision()
    if current != head:
        state = "has no stalewise schema" if current is None else f"is at revision {current}"
        raise StaleSchemaError(
            f"database {url} {state}, but this stalewise needs revision {head}; "
            f"run: stalewise db upgrade --url {url}"
        )


def open_store_engine(url: str = DEFAULT_URL, *, create: bool = False) -> Engine:
    """An engine on a store at head. With `create`, a new (empty) database gets the schema;
    a database at an older revision is never migrated implicitly: StaleSchemaError says how.
    Without `create`, a SQLite file that does not exist is StoreMissingError, not made."""
    engine = reached_engine(url, create=create)
    tables = set(inspect(engine).get_table_names()) - {"alembic_version"}
    if create and current_revision(engine) is None and not tables:
        engine.dispose()
        upgrade(url)
        engine = make_engine(url)
    try:
        check_schema(engine, url)
    except StaleSchemaError:
        engine.dispose()
        raise
    return engine
