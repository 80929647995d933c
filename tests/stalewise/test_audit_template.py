"""`stalewise audit template` on a real short run's database (real engine, SQLite):
every stored trajectory re-renders to exactly the tokens the loop sent, and a database whose
stored prompt tokens were tampered with is flagged, with the first differing token, exit 1."""

from __future__ import annotations

import json
import shutil
import sqlite3
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stalewise.cli import app

pytestmark = [pytest.mark.slow]


@pytest.fixture
def short_run(real_run) -> tuple[Path, str]:
    """The session's short real job (tests/conftest.py): its database file and run id."""
    url, run_id = real_run
    return Path(url.removeprefix("sqlite:///")), run_id


def _audit(db: Path, run_id: str, *extra: str):
    return CliRunner().invoke(app, ["audit", "template", "--run", run_id, "--url",
                                    f"sqlite:///{db}", *extra])


def test_a_real_run_renders_exactly_as_its_template(short_run):
    db, run_id = short_run
    result = _audit(db, run_id, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["format"] == "hermes" and report["trajectories"]
    assert report["counts"]["mismatch"] == 0
    assert sum(row["prompts"] for row in report["trajectories"]) >= len(report["trajectories"])


def test_tampered_prompt_tokens_are_flagged(short_run, tmp_path):
    db, run_id = short_run
    tampered = tmp_path / "tampered.db"
    shutil.copy(db, tampered)
    with sqlite3.connect(tampered) as c:
        call_id, trajectory, blob = c.execute(
            "SELECT id, trajectory_id, prompt_token_ids FROM model_calls ORDER BY id "
            "LIMIT 1").fetchone()
        ids = list(struct.unpack(f"<{len(blob) // 4}i", blob))
        ids[3] = ids[3] + 1 if ids[3] + 1 != ids[4] else ids[3] + 2  # one token changed
        c.execute("UPDATE model_calls SET prompt_token_ids = ? WHERE id = ?",
                  (struct.pack(f"<{len(ids)}i", *ids), call_id))
    result = _audit(tampered, run_id)
    assert result.exit_code == 1, result.output
    assert "1 differing from the template" in result.output
    assert str(trajectory) in result.output and "token 3: template" in result.output


def test_an_unknown_run_is_one_line(short_run):
    db, _ = short_run
    result = _audit(db, "no-such-run")
    assert result.exit_code == 1 and "no run 'no-such-run'" in result.output
