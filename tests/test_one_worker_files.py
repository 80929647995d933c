"""The suite's one-worker groups (tests/conftest.py) name files that exist: an entry left behind
by a renamed or deleted test file groups nothing and hides which files still need a group."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import ONE_WORKER_FILES

ROOT = Path(__file__).resolve().parents[1]


def test_every_file_of_a_one_worker_group_exists():
    missing = [path for path in ONE_WORKER_FILES if not (ROOT / path).is_file()]
    assert not missing, f"ONE_WORKER_FILES in tests/conftest.py names missing files: {missing}"
