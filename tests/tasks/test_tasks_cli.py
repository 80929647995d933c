"""`stalewise tasks list | show | check`, end to end through the typer apps (`check` is wired in
`stalewise.cli`, since Harbor folders need a sandbox)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from stalewise.cli import app as stalewise_app
from tasks.cli import app

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "my_task.py")
runner = CliRunner()


def test_list_and_show():
    listed = runner.invoke(app, ["list"])
    assert listed.exit_code == 0 and {"arith", "codefix", "longhaul"} <= set(listed.output.split())
    shown = runner.invoke(app, ["show", "longhaul", "--options", '{"max_k": 4}', "--count", "2"])
    assert shown.exit_code == 0, shown.output
    assert "longhaul/train/0" in shown.output and "tools: step" in shown.output


def test_check_passes_for_shipped_families_and_the_example():
    for ref in ("arith", "codefix", "longhaul", f"{EXAMPLE}:family"):
        result = runner.invoke(stalewise_app, ["tasks", "check", ref, "--count", "5"])
        assert result.exit_code == 0, (ref, result.output)
        assert result.output.startswith("ok: ")


def test_check_reports_broken_families(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text(
        "import itertools\n"
        "from tasks import TaskFamily, TaskInstance, Rubric, Component, Demonstration, DemoTurn\n"
        "from tasks.builtin_tools import python\n"
        "counter = itertools.count()\n"
        "def make(i, split):\n"
        "    return TaskInstance(prompt=f'p{next(counter)}', tools=(python,),\n"
        "                        verifier=Rubric(Component('c', lambda ctx: 1.0)))\n"
        "def demo(task, correct):\n"
        "    call = '<tool_call>{\"name\":\"python\",\"arguments\":{\"cod\":1}}</tool_call>'\n"
        "    return Demonstration(task, (DemoTurn(call),), correct=True)\n"
        "family = TaskFamily('broken', make, demonstrate=demo)\n")
    result = runner.invoke(stalewise_app, ["tasks", "check", str(broken), "--count", "1"])
    assert result.exit_code == 1
    assert "different content" in result.output
    assert "bad arguments for python" in result.output
    assert "1 calls, 0 observations" in result.output
    assert "asked for a wrong demonstration" in result.output


def test_bad_references_and_options_are_explained():
    result = runner.invoke(app, ["show", "arith", "--options", "{oops"])
    assert result.exit_code != 0 and "not JSON" in result.output
    result = runner.invoke(app, ["show", "no_such_family"])
    assert result.exit_code == 1 and "not an entry point" in result.output
