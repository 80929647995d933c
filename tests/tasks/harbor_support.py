"""Helpers for the Harbor tests: copies of the shipped example tasks, and task folders to break."""

from __future__ import annotations

import shutil
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "harbor"
BASE_MAP = {"python:3.12-slim": "stalewise-base"}


def copy_task(tmp_path: Path, name: str = "hello-file", to: str | None = None) -> Path:
    """A private copy of one example task (to break in a test), inside tmp_path/tasks/."""
    target = tmp_path / "tasks" / (to or name)
    shutil.copytree(EXAMPLES / name, target)
    return target
