"""The `vault` suite without Docker: instances, splits, demonstrations, delays and the `go`
state machine run by a real `sh` in a temporary directory (the same script the sandbox runs)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tasks.suites import vault


def test_levels_depths_and_files():
    family = vault.family(depths=(6, 10, 16))
    tasks = list(family.instances(count=120))
    assert {t.difficulty for t in tasks} == {"depth=6", "depth=10", "depth=16"}
    for task in tasks:
        doors = task.data["doors"]
        assert len(doors) == task.data["depth"] == len(set(doors)) >= 6
        files = task.sandbox.files
        assert files["maze/start"] == f"door {doors[0]}"
        assert files[f"maze/{doors[-1]}"] == f"gold {task.data['gold']}"
        assert task.data["gold"] not in task.prompt[0].content
        assert task.limits.max_turns >= task.data["depth"] + 1


def test_train_and_test_are_disjoint_by_construction():
    family = vault.family()
    train = [family.split_key(t) for t in family.instances("train", count=2000)]
    evals = [family.split_key(t) for t in family.instances("test", count=300)]
    assert all(family.shares.of("vault", k) == "train" for k in train)
    assert all(family.shares.of("vault", k) == "test" for k in evals)
    assert set(train).isdisjoint(evals)
    assert len(set(evals)) > 250, "the test set must not be a handful of repeated instances"
    demos = family.demonstrations(500, wrong_fraction=0.3)
    assert {family.split_key(d.task) for d in demos}.isdisjoint(evals)


def test_demonstrations_walk_every_door_and_wrong_ones_stop_early():
    family = vault.family(depths=(6, 8))
    for demo in family.demonstrations(40, wrong_fraction=0.5):
        doors = demo.task.data["doors"]
        calls = [t for t in demo.turns if t.observations]
        answer = demo.turns[-1].assistant
        if demo.correct:
            assert len(calls) == len(doors) and answer == f"<answer>{demo.task.data['gold']}</answer>"
        else:
            assert 2 <= len(calls) < len(doors) and demo.task.data["gold"] not in answer


def test_delays_are_heavy_tailed_and_stable():
    delays = [vault.door_delay(f"t{i}", j, 0.2, 1.0, 10.0) for i in range(300) for j in range(6)]
    assert delays == [vault.door_delay(f"t{i}", j, 0.2, 1.0, 10.0)
                      for i in range(300) for j in range(6)]
    assert max(delays) / min(delays) > 50 and max(delays) <= 10.0
    assert vault.door_delay("t", 0, 0.0, 1.0, 10.0) == 0.0


def test_bad_options_say_what_is_wrong():
    with pytest.raises(ValueError, match="at least 6"):
        vault.family(depths=(3, 8))
    with pytest.raises(ValueError, match="delays"):
        vault.family(delay_median_s=-1)
    with pytest.raises(ValueError, match="progress_reward .* in \\[0, 1\\)"):
        vault.family(progress_reward=1.0)


def go(workdir: Path, door: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", vault.GO_SCRIPT, "go", door, "0"], cwd=workdir,
                          capture_output=True, text=True, check=False)


def test_go_script_keeps_position_and_moves_in_the_directory(tmp_path):
    task = vault.family(depths=(6,)).instance(3)
    for name, text in task.sandbox.files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    doors = task.data["doors"]
    assert go(tmp_path, doors[1]).returncode == 3, "a door of a later room is not here yet"
    for i, door in enumerate(doors):
        done = go(tmp_path, door)
        assert done.returncode == 0, done.stderr
        expected = f"door {doors[i + 1]}" if i + 1 < len(doors) else f"gold {task.data['gold']}"
        assert done.stdout.strip() == expected
    assert (tmp_path / ".vault/here").read_text() == doors[-1]
    assert (tmp_path / ".vault/moves").read_text().strip() == str(len(doors))
    again = go(tmp_path, doors[0])
    assert again.returncode == 3 and "no door" in again.stderr
