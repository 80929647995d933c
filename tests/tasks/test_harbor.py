"""Harbor task folders read offline: what each task.toml field becomes, and one-line errors for
bad folders (each naming the task and the fix). The Docker side is in test_harbor_docker.py."""

from __future__ import annotations

import pytest

from config.job import parse_config
from tasks import load_family
from tasks.harbor import REWARD_FILES, workdir_of
from tasks.loading import TaskLoadError
from tests.tasks.harbor_support import BASE_MAP, EXAMPLES, copy_task


def test_the_examples_load_with_both_task_toml_schemas():
    family = load_family(f"harbor:{EXAMPLES}", {"base_image_map": BASE_MAP})
    tasks = {t.data["harbor_task"]: t for t in family.instances("train")}
    assert family.name == "harbor-harbor" and family.size == 3
    assert set(tasks) == {"count-lines", "hello-file", "stalewise/sum-numbers"}
    hello, total, count = (tasks["hello-file"], tasks["stalewise/sum-numbers"],
                           tasks["count-lines"])
    assert hello.prompt[0].content == (EXAMPLES / "hello-file/instruction.md").read_text().strip()
    assert [t.name for t in hello.tools] == ["bash", "read_file", "write_file"]
    assert hello.limits.wall_time_s == 120.0 and hello.limits.verify_timeout_s == 90.0
    assert hello.sandbox.limits.memory_mb == 256 and total.sandbox.limits.memory_mb == 512
    assert not any(t.sandbox.limits.network for t in tasks.values())
    assert hello.difficulty == "easy" and total.difficulty == "medium"
    assert count.sandbox.workdir == "/app" and hello.sandbox.workdir == "/work"
    assert set(total.hidden_files) == {"/tests/test.sh", "/tests/check_total.py"}
    assert hello.sandbox.image.startswith("stalewise-harbor-hello-file:")
    assert total.sandbox.build.base_image_map == BASE_MAP
    # the oracle's solution is never part of what the agent's task carries
    assert "solve.sh" not in str(hello.canonical()) and "echo hello" not in str(hello.canonical())
    assert family.by_key(hello.key).content_hash == hello.content_hash


def test_limits_are_capped_by_the_job_and_network_needs_both_sides(tmp_path):
    task = copy_task(tmp_path)
    toml = task / "task.toml"
    toml.write_text(toml.read_text().replace("memory_mb = 256", "memory_mb = 8192")
                    .replace("allow_internet = false", "allow_internet = true")
                    .replace("cpus = 1", "cpus = 8"))
    capped = load_family(f"harbor:{task}", {"max_memory_mb": 700, "max_cpus": 0.5}).instance(0)
    assert capped.sandbox.limits.memory_mb == 700 and capped.sandbox.limits.cpus == 0.5
    assert capped.sandbox.limits.network is False
    allowed = load_family(f"harbor:{task}", {"allow_network": True}).instance(0)
    assert allowed.sandbox.limits.network is True
    turns = load_family(f"harbor:{task}", {"limits": {"max_turns": 3}}).instance(0)
    assert turns.limits.max_turns == 3


def test_the_image_tag_follows_the_environment_content(tmp_path):
    task = copy_task(tmp_path)
    before = load_family(f"harbor:{task}").instance(0).sandbox.image
    assert load_family(f"harbor:{task}").instance(0).sandbox.image == before
    (task / "environment" / "extra.txt").write_text("x")
    assert load_family(f"harbor:{task}").instance(0).sandbox.image != before
    mapped = load_family(f"harbor:{task}", {"base_image_map": BASE_MAP}).instance(0)
    assert mapped.sandbox.image != before


def test_workdir_is_the_last_absolute_workdir():
    assert workdir_of("FROM x\nWORKDIR /srv\nRUN true\nworkdir /app/\n") == "/app"
    assert workdir_of("FROM x\n") == "/work" and workdir_of(None) == "/work"


def _error(ref: str, options: dict | None = None) -> str:
    with pytest.raises(TaskLoadError) as caught:
        load_family(ref, options)
    message = str(caught.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("breakage, expected", [
    (lambda t: (t / "instruction.md").unlink(), "instruction.md is missing; add it"),
    (lambda t: (t / "task.toml").write_text("[verifier\ntimeout_sec = 3"),
     "task.toml is not valid TOML"),
    (lambda t: (t / "task.toml").write_text("[verifier]\ntimeout_sec = 'soon'\n"),
     "task.toml: verifier.timeout_sec: Input should be a valid number"),
    (lambda t: (t / "task.toml").unlink(), "task.toml is missing"),
    (lambda t: (t / "tests" / "test.sh").unlink(), "tests/test.sh is missing"),
    (lambda t: ((t / "environment" / "Dockerfile").unlink(),
                (t / "environment" / "docker-compose.yaml").write_text("services: {}\n")),
     "docker-compose.yaml environments are not supported yet"),
    (lambda t: (t / "task.toml").write_text("[[steps]]\nname = 'a'\n"),
     "multi-step tasks ([[steps]]) are not supported yet"),
    (lambda t: (t / "task.toml").write_text("[environment]\ngpus = 1\n"), "GPU sandboxes"),
    (lambda t: (t / "task.toml").write_text("[environment]\nmemory = 'lots'\n"),
     "use memory_mb"),
])
def test_bad_task_folders_give_one_line_naming_the_task_and_the_fix(tmp_path, breakage, expected):
    task = copy_task(tmp_path, to="broken-task")
    breakage(task)
    message = _error(f"harbor:{tmp_path / 'tasks'}")
    assert "harbor task broken-task" in message and expected in message, message


def test_bad_references_and_settings(tmp_path):
    assert "does not exist" in _error(f"harbor:{tmp_path / 'nowhere'}")
    (tmp_path / "empty").mkdir()
    assert "no Harbor task folders" in _error(f"harbor:{tmp_path / 'empty'}")
    assert "not ['max_memory']" in _error(f"harbor:{EXAMPLES}", {"max_memory": 3})
    assert "[tasks.harbor] max_cpus" in _error(f"harbor:{EXAMPLES}", {"max_cpus": -1})
    assert "[tasks.harbor] TaskLimits max_turnz: Extra inputs" in _error(
        f"harbor:{EXAMPLES}", {"limits": {"max_turnz": 3}})
    for folder in ("a", "b"):
        toml = copy_task(tmp_path, to=folder) / "task.toml"
        toml.write_text('[task]\nname = "same"\n' + toml.read_text().replace('version = "1.0"', ""))
    assert "are named 'same'" in _error(f"harbor:{tmp_path / 'tasks'}")


def test_job_config_reads_tasks_harbor_and_passes_it_only_to_harbor_families():
    job = parse_config({"tasks": {"family": f"harbor:{EXAMPLES}",
                                  "harbor": {"base_image_map": BASE_MAP, "max_cpus": 0.5}}})
    options = job.tasks.family_options()
    assert options["base_image_map"] == BASE_MAP and options["max_cpus"] == 0.5
    assert parse_config({"tasks": {"family": "arith"}}).tasks.family_options() == {}
    with pytest.raises(ValueError, match="tasks.harbor.max_cpu"):
        parse_config({"tasks": {"harbor": {"max_cpu": 1}}})


def test_reward_files_are_harbors():
    assert REWARD_FILES[0] == "/logs/verifier/reward.txt"
