"""Task families load from a file path, an entry point, or a module, with clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks import TaskFamily, TaskLoadError, load_family
from tasks.loading import available_entry_points

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "my_task.py"


def test_builtin_suites_are_entry_points():
    assert {"arith", "codefix", "longhaul"} <= set(available_entry_points())
    for name in ("arith", "codefix", "longhaul"):
        family = load_family(name)
        assert family.name == name and family.instance(0).key == f"{name}/train/0"


def test_entry_point_options_reach_the_factory():
    family = load_family("arith", {"max_ops": 1})
    assert {t.difficulty for t in family.instances(count=20)} == {"ops=1"}
    with pytest.raises(TaskLoadError, match="max_opz"):
        load_family("arith", {"max_opz": 1})
    with pytest.raises(TaskLoadError, match="rejected its options"):
        load_family("arith", {"max_ops": 0})


def test_user_file_with_factory_and_options(monkeypatch):
    family = load_family(f"{EXAMPLE}:family", {"max_lines": 20})
    assert family.name == "logcount" and family.options["max_lines"] == 20
    assert load_family(str(EXAMPLE)).name == "logcount"  # attribute `family` by default
    monkeypatch.chdir(ROOT)
    assert load_family("examples/my_task.py:family").name == "logcount"


def test_module_reference_and_family_objects(tmp_path):
    file = tmp_path / "fixed.py"
    file.write_text(
        "from tasks import TaskFamily, TaskInstance, Rubric, Component\n"
        "def make(i, split):\n"
        "    return TaskInstance(prompt='p', tools=(), verifier=Rubric(Component('c', "
        "lambda ctx: 1.0)))\n"
        "family = TaskFamily('fixed', make)\n"
        "other = 3\n")
    assert isinstance(load_family(f"{file}:family"), TaskFamily)
    with pytest.raises(TaskLoadError, match="takes no options"):
        load_family(f"{file}:family", {"x": 1})
    with pytest.raises(TaskLoadError, match="not a TaskFamily"):
        load_family(f"{file}:other")
    with pytest.raises(TaskLoadError, match="no attribute 'missing'"):
        load_family(f"{file}:missing")
    assert load_family("tasks.suites.longhaul:family", {"max_k": 3}).name == "longhaul"


def test_errors_name_what_was_looked_for(tmp_path):
    with pytest.raises(TaskLoadError, match="does not exist"):
        load_family(str(tmp_path / "nope.py"))
    with pytest.raises(TaskLoadError, match="not an entry point.*installed: .*arith"):
        load_family("no_such_family_anywhere")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('bad import')\n")
    with pytest.raises(TaskLoadError, match="RuntimeError: bad import"):
        load_family(str(broken))
    with pytest.raises(TaskLoadError, match="empty"):
        load_family("  ")
