"""Structured logging: console rendering on a TTY, one JSON object per line otherwise.

Every line of a job carries `run_id` (bound once with `bind_run`) and, inside an agent loop,
`trajectory_id` (bound with `bind_trajectory`, which is task-local through contextvars).
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from typing import Iterator, Literal

import structlog

_configured = False


def _stderr_logger(*_args) -> structlog.PrintLogger:
    """A logger on the current `sys.stderr` (a test's capture, or a stream replaced since
    logging was configured), made for each line since loggers are not cached."""
    return structlog.PrintLogger(file=sys.stderr)


def configure_logging(fmt: Literal["auto", "console", "json"] = "auto",
                      level: int = logging.INFO) -> None:
    global _configured
    use_console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    renderer = (structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()) if use_console
                else structlog.processors.JSONRenderer())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=_stderr_logger,  # the stderr of each line's moment, not of this call
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str | None = None) -> structlog.typing.FilteringBoundLogger:
    if not _configured:
        configure_logging()
    return structlog.get_logger(name) if name else structlog.get_logger()


def bind_run(run_id: str) -> None:
    structlog.contextvars.bind_contextvars(run_id=run_id)


@contextmanager
def bind_trajectory(trajectory_id: int) -> Iterator[None]:
    with structlog.contextvars.bound_contextvars(trajectory_id=trajectory_id):
        yield
