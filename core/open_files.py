"""How many files (sockets included) a process may hold open, and raising that for a job.

A job with a thousand trajectories in flight holds a thousand engine connections, on top of
its store, logs, sandboxes and children's pipes; many systems start processes with a soft
limit of 1,024 open files, while the hard limit (which an unprivileged process may raise its
soft limit to) is far higher. `raise_open_files` raises the soft limit as far as the job needs
and the hard limit allows, so the job fails neither at its thousandth connection nor with an
error that names no setting.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass


@dataclass(frozen=True)
class OpenFiles:
    """A job's need of open files against this process's limits (None: unlimited)."""

    needed: int
    soft: int | None  # after raising
    hard: int | None

    @property
    def enough(self) -> bool:
        return self.soft is None or self.soft >= self.needed

    def advice(self) -> str:
        hard = "unlimited" if self.hard is None else f"{self.hard:,}"
        return (f"the job may hold {self.needed:,} files open (engine connections, sandboxes, "
                f"store) but this process may open {self.soft:,} (hard limit {hard}): raise "
                f"the limit before starting it (`ulimit -n {self.needed}`, or LimitNOFILE= in a "
                f"systemd unit), or lower engine.max_connections")


def raise_open_files(needed: int) -> OpenFiles:
    """Raise this process's soft limit on open files to `needed` where it is lower, as far as
    the hard limit allows (children inherit it). Never lowers it."""
    infinity = resource.RLIM_INFINITY
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != infinity and soft < needed:
        target = needed if hard == infinity else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # a sandbox that forbids it: the soft limit stays, and `enough` says so
    return OpenFiles(needed=needed, soft=None if soft == infinity else soft,
                     hard=None if hard == infinity else hard)
