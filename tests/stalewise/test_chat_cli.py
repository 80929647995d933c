"""`stalewise chat check` on real templates: exit 0 when the format conforms, 1 with the first
differing token when it does not, 2 with a one-line error for bad input."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from typer.testing import CliRunner

from stalewise.cli import app

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tasks"))
from chat_tokenizers import real_tokenizer_dir


def _invoke(*args: str):
    return CliRunner().invoke(app, ["chat", "check", *args])


def test_check_picks_the_family_from_the_template_and_passes():
    result = _invoke("--tokenizer", str(real_tokenizer_dir("llama3.1")))
    assert result.exit_code == 0, result.output
    assert "format llama3.1 (recognised from the template)" in result.output
    assert "unsupported parallel calls" in result.output
    assert "7 of 8 cases conform, 1 the template itself refuses, 0 fail" in result.output


def test_check_fails_a_wrong_format_with_the_first_differing_token():
    result = _invoke("--tokenizer", str(real_tokenizer_dir("qwen2.5")), "--format", "hermes",
                     "--json")
    assert result.exit_code == 1
    report = json.loads(result.output)
    assert report["format"] == "hermes"
    assert all(case["status"] == "fail" for case in report["cases"])
    assert report["cases"][0]["difference"].startswith("token 13: template 2 '#'")


def test_check_can_require_append_only():
    result = _invoke("--tokenizer", str(real_tokenizer_dir("qwen3")), "--require-append-only")
    assert result.exit_code == 1
    assert "failing" not in result.output and "1 fail: later user message" in result.output


def test_bad_input_is_one_line(tmp_path):
    result = _invoke("--tokenizer", str(tmp_path / "nope"))
    assert result.exit_code == 2 and "is not a directory" in result.output
    result = _invoke("--tokenizer", str(tmp_path))  # a folder with no tokenizer in it
    assert result.exit_code == 2 and result.output.strip() == (
        f"error: --tokenizer '{tmp_path}' holds no tokenizer (no tokenizer.json or "
        "tokenizer_config.json); pass a model folder that has one")
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "NoSuchTokenizer"}')
    result = _invoke("--tokenizer", str(tmp_path))  # transformers' message is several lines
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert result.output.startswith(f"error: cannot load a tokenizer from '{tmp_path}': ")
    result = _invoke("--tokenizer", str(real_tokenizer_dir("qwen3")), "--format", "chatml")
    assert result.exit_code == 2 and "is not one of auto, hermes, template" in result.output
    result = _invoke("--tokenizer", str(real_tokenizer_dir("llama3.1")), "--format", "qwen3")
    assert result.exit_code == 2 and "must each be a single token" in result.output
