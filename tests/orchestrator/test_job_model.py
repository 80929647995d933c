"""The checkpoint a job starts from (`orchestrator.job.ensure_model`), with the real
`stalewise model init-tiny` child.

- `--set run.seed=N` gives the tiny model of seed N whatever ran before in the checkout: a tiny
  model at `model.path` made with another seed stays as it is, and the run makes its own beside
  it (`PATH-seedN`), with the very weights a fresh clone would make;
- two jobs that start together on a missing `model.path` both get one whole model, and no
  scratch folder or log is left;
- a creation that fails keeps its own log (not one shared with a job beside it) and names it;
- a checkpoint that records no tiny seed (any other model) is used as it is, whatever the seed;
- a folder in the way (no checkpoint in it) is named, with what to do.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from config.job import parse_config
from core.tiny import tiny_seed
from engine.tiny import init_tiny
from orchestrator.job import ensure_model


def _job(path: Path, seed: int):
    return parse_config({"run": {"seed": seed}, "model": {"path": str(path)}})


def _weights(path: Path) -> bytes:
    return (path / "model.safetensors").read_bytes()


def test_each_seed_gets_its_own_tiny_model_whatever_ran_before(tmp_path):
    shared = tmp_path / "models" / "tiny"
    first = anyio.run(ensure_model, _job(shared, 0))
    assert first == shared and tiny_seed(shared) == 0
    before = _weights(shared)

    second = anyio.run(ensure_model, _job(shared, 1))
    assert second == tmp_path / "models" / "tiny-seed1" and tiny_seed(second) == 1
    assert _weights(second) == _weights(init_tiny(tmp_path / "fresh-clone", seed=1))
    assert _weights(shared) == before and _weights(second) != before

    assert anyio.run(ensure_model, _job(shared, 1)) == second  # made once
    assert anyio.run(ensure_model, _job(shared, 0)) == shared
    assert sorted(p.name for p in shared.parent.iterdir() if p.is_dir()) == ["tiny",
                                                                            "tiny-seed1"]


def test_two_jobs_starting_together_share_one_whole_model(tmp_path):
    path = tmp_path / "models" / "tiny"
    got = []

    async def both() -> None:
        async def one() -> None:
            got.append(await ensure_model(_job(path, 3)))

        async with anyio.create_task_group() as group:
            group.start_soon(one)
            group.start_soon(one)

    anyio.run(both)
    assert got == [path, path] and tiny_seed(path) == 3
    assert _weights(path) == _weights(init_tiny(tmp_path / "fresh-clone", seed=3))
    assert [p.name for p in path.parent.iterdir()] == ["tiny"]  # no scratch, no log left


def test_a_failed_creation_keeps_its_own_log_and_names_it(tmp_path, monkeypatch):
    import orchestrator.job as job_module

    monkeypatch.setattr(job_module, "python_command", lambda *args: [
        "python3", "-c", "import sys; print('no room for the weights'); sys.exit(3)"])
    path = tmp_path / "models" / "tiny"
    with pytest.raises(RuntimeError, match="could not create the tiny model") as failure:
        anyio.run(ensure_model, _job(path, 0))
    logs = list(path.parent.glob("init-tiny.*.log"))
    assert len(logs) == 1 and str(logs[0]) in str(failure.value)
    assert "no room for the weights" in logs[0].read_text()
    assert [p.name for p in path.parent.iterdir()] == [logs[0].name]  # no scratch left


def test_a_checkpoint_without_a_tiny_seed_is_used_as_it_is(tmp_path):
    model = init_tiny(tmp_path / "mine", seed=5)
    (model / "stalewise-tiny.json").unlink()  # as any other checkpoint, or an older tiny model
    assert anyio.run(ensure_model, _job(model, 0)) == model
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_a_folder_in_the_way_is_named_with_the_fix(tmp_path):
    path = tmp_path / "models" / "tiny"
    path.mkdir(parents=True)
    (path / "leftover.bin").write_text("x")  # a crashed copy, say: no config.json
    with pytest.raises(RuntimeError, match=r"tiny exists but holds no checkpoint \(config.json "
                                           r"missing\).*remove it, or point model.path"):
        anyio.run(ensure_model, _job(path, 0))
    assert [p.name for p in path.parent.iterdir() if p.is_dir()] == ["tiny"]  # no scratch left
