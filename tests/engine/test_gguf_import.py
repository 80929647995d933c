"""`stalewise model import`: bad input is one line saying what to do; nothing half-written.

The full import of a real GGUF file runs in the test set-up (scripts/fetch_models.sh builds
var/models/smollm2-135m with it); tests/engine/test_real_checkpoint.py checks its result.
"""

from __future__ import annotations

from typer.testing import CliRunner

from stalewise.cli import app


def _import(*args: str):
    return CliRunner().invoke(app, ["model", "import", *args])


def test_missing_file_is_one_line(tmp_path):
    result = _import(str(tmp_path / "nope.gguf"), str(tmp_path / "out"))
    assert result.exit_code == 2
    assert "nope.gguf does not exist; pass the path of a .gguf file" in result.output
    assert not (tmp_path / "out").exists()


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"\0" * 16)
    result = _import(str(tmp_path / "model.bin"), str(tmp_path / "out"))
    assert result.exit_code == 2 and "is not a .gguf file" in result.output


def test_existing_output_directory_is_refused(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "out").mkdir()
    result = _import(str(tmp_path / "m.gguf"), str(tmp_path / "out"))
    assert result.exit_code == 2 and "already exists; remove it" in result.output


def test_unreadable_gguf_leaves_nothing(tmp_path):
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    result = _import(str(tmp_path / "broken.gguf"), str(tmp_path / "out"))
    assert result.exit_code == 2 and "cannot read" in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.gguf"]
