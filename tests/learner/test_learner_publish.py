"""Publish-then-mark: a marked version is always a complete, loadable checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from core.tokenizer import load_tokenizer
from engine.tiny import init_tiny
from learner.model import load_policy
from learner.publish import publish_version, tokenizer_files, version_dir, write_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("publish") / "tiny"
    init_tiny(directory, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    return directory


def test_mark_is_called_only_after_the_version_is_complete_and_loadable(tiny, tmp_path):
    model = load_policy(tiny)
    with torch.no_grad():
        next(model.parameters()).add_(0.5)  # published weights differ from the start
    seen = []

    def mark(version: int, path: Path) -> None:
        assert path == version_dir(tmp_path, version) and path.is_dir()
        assert not list(tmp_path.glob(".tmp-*")), "the temporary directory must be renamed away"
        reloaded = load_policy(path)
        for a, b in zip(model.parameters(), reloaded.parameters()):
            torch.testing.assert_close(a, b)
        ids = load_tokenizer(path).encode("a b\nc", add_special_tokens=False)
        assert len(ids) == 5, "tokenizer must be the starting checkpoint's, whitespace kept"
        seen.append(version)

    path = publish_version(model, tiny, tmp_path, 7, mark, {"learner_step": 3})
    assert seen == [7] and path.name == "v000007"
    assert json.loads((path / "stalewise.json").read_text())["learner_step"] == 3
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (path / name).read_bytes() == (tiny / name).read_bytes()


def test_a_published_version_is_never_overwritten(tiny, tmp_path):
    model = load_policy(tiny)
    publish_version(model, tiny, tmp_path, 1)
    marks = []
    with pytest.raises(FileExistsError, match="never overwritten"):
        publish_version(model, tiny, tmp_path, 1, lambda v, p: marks.append(v))
    assert marks == []


def test_a_failed_write_leaves_nothing_marked_and_no_version_dir(tiny, tmp_path):
    class Broken:
        def save_pretrained(self, path: str, safe_serialization: bool = True) -> None:
            Path(path).mkdir(parents=True)
            (Path(path) / "model.safetensors").write_bytes(b"partial")
            raise OSError("disk full")

    marks = []
    with pytest.raises(OSError, match="disk full"):
        publish_version(Broken(), tiny, tmp_path, 2, lambda v, p: marks.append(v))
    assert marks == [] and not version_dir(tmp_path, 2).exists()
    assert not list(tmp_path.glob(".tmp-*"))


def test_stale_temporary_directories_of_a_version_are_removed(tiny, tmp_path):
    stale = tmp_path / ".tmp-v000003-deadbeef"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"crashed mid-write")
    publish_version(load_policy(tiny), tiny, tmp_path, 3)
    assert not stale.exists() and version_dir(tmp_path, 3).exists()


def test_tokenizer_files_exclude_weights_and_model_config(tiny):
    names = {p.name for p in tokenizer_files(tiny)}
    assert "tokenizer.json" in names
    assert not names & {"model.safetensors", "config.json", "generation_config.json"}


def test_write_checkpoint_refuses_an_existing_directory(tiny, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError):
        write_checkpoint(load_policy(tiny), tiny, tmp_path / "out")
