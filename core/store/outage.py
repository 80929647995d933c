"""A store that cannot answer for a while, told apart from one that refuses the work.

`transient(exc)` is True for errors from outside the work itself, after which the same work may
succeed: the disk is full, a lock was held past the busy timeout, an I/O error, the PostgreSQL
server restarting or a lost connection. A constraint violation, a missing table or bad data are
not transient: retrying cannot help.

`StoreUnavailable` is how a write reports a transient error, with `retry_safe`: True when the
transaction is known not to have committed (it failed before its commit; or on SQLite, where a
commit that fails is rolled back), False when its fate is unknown (a PostgreSQL connection lost
during COMMIT), where a retry could write it twice.

`Outage` is the clock of callers that retry: the first failure starts it, `recovered()` stops
it, and a failure past `limit_s` is raised, not retried.
"""

from __future__ import annotations

import time
from typing import Callable

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

SQLITE_TRANSIENT = ("database or disk is full", "database is locked", "disk i/o error",
                    "unable to open database file")
FIRST_DELAY_S, MAX_DELAY_S = 0.5, 5.0


class StoreUnavailable(RuntimeError):
    """A write failed for a transient reason (module docstring)."""

    def __init__(self, error: BaseException, *, retry_safe: bool) -> None:
        super().__init__(f"the store cannot write now: {first_line(error)}")
        self.retry_safe = retry_safe


def first_line(error: BaseException) -> str:
    text = str(getattr(error, "orig", None) or error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def transient(error: BaseException) -> bool:
    if isinstance(error, StoreUnavailable):
        return True
    if not isinstance(error, DBAPIError):
        return False
    if error.connection_invalidated:
        return True
    module = type(error.orig).__module__ if error.orig is not None else ""
    if module.startswith("sqlite3"):
        return isinstance(error, OperationalError) and any(
            text in str(error.orig).lower() for text in SQLITE_TRANSIENT)
    return isinstance(error, (OperationalError, InterfaceError))  # PostgreSQL: connection, server


class Outage:
    """How long the store has been failing, for a caller that retries it."""

    def __init__(self, limit_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit_s, self.clock = limit_s, clock
        self.since: float | None = None
        self.delay_s = FIRST_DELAY_S

    def failed(self, error: BaseException) -> float:
        """Seconds to wait before the next try; raises `error` when it is not transient, not
        safe to retry, or the outage has lasted `limit_s`."""
        if not transient(error) or not getattr(error, "retry_safe", True):
            raise error
        now = self.clock()
        if self.since is None:
            self.since = now
        if now - self.since >= self.limit_s:
            raise error
        delay, self.delay_s = self.delay_s, min(self.delay_s * 2, MAX_DELAY_S)
        return delay

    @property
    def started(self) -> bool:
        return self.since is not None

    def recovered(self) -> float | None:
        """End the outage; how long it lasted (None if there was none)."""
        lasted = None if self.since is None else self.clock() - self.since
        self.since, self.delay_s = None, FIRST_DELAY_S
        return lasted
