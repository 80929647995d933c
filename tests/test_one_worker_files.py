"""The suite's one-worker groups (tests/conftest.py) name files that exist: a renamed test file
left in ONE_WORKER_FILES would leave its tests free to run on two workers at once (collection
then refuses them, but only when the old name is gone from the table too)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import ONE_WORKER_FILES

ROOT = Path(__file__).resolve().parents[1]


def test_every_file_of_a_one_worker_group_exists():
    missing = [path for path in ONE_WORKER_FILES if not (ROOT / path).is_file()]
    assert not missing, f"ONE_WORKER_FILES in tests/conftest.py names missing files: {missing}"
