"""Python children of a job run in the caller's working directory, with our packages first."""

from __future__ import annotations

import httpx

from orchestrator.processes import ChildProcess


def test_a_child_sees_relative_paths_like_its_parent_and_imports_our_packages(
        tmp_path, monkeypatch):
    # a user's project folder with its own `config/`, `learner/` and `tasks/` packages, and a
    # relative path
    for name in ("config", "core", "learner", "tasks"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise ImportError('the user folder')\n")
    (tmp_path / "var").mkdir()
    (tmp_path / "var" / "note.txt").write_text("relative to the caller")
    monkeypatch.chdir(tmp_path)
    code = ("import config.learner, core.records, learner.trainer, tasks.api; "
            "print(open('var/note.txt').read()); print(config.learner.__file__)")
    child = ChildProcess.start("probe", ["-c", code], tmp_path / "probe.log")
    assert child.process.wait(timeout=60) == 0, child.log_tail()
    out = (tmp_path / "probe.log").read_text().splitlines()
    assert out[0] == "relative to the caller"
    assert not out[1].startswith(str(tmp_path)), out[1]


def test_the_engine_serves_a_model_given_by_a_relative_path(tmp_path, monkeypatch):
    from engine.tiny import init_tiny
    from orchestrator.engines.launch import EngineProcess

    init_tiny(tmp_path / "models" / "mine", hidden=32, layers=1, heads=2, kv_heads=1,
              intermediate=64)
    monkeypatch.chdir(tmp_path)
    with EngineProcess.start("models/mine", startup_timeout=90) as engine:
        info = httpx.get(f"{engine.url}/v1/models", timeout=30).text
    assert "models/mine" in info, info
