"""The one child type (`core.children.Child`) and the one restart policy, with real processes.

Contracts: a Python child runs in the caller's working directory with our packages first;
without a log file its output is the parent's; `ready` returns the probe's answer (a port
file, a health check) and fails at once with the log's tail when the child exits first, or
once its timeout has passed, stopping the child; `stop` reaps the child and, when it leads its
own process group, ends every helper it left; a log in the scratch directory stays readable
after `stop` removed the directory; the restart budget counts restarts within its window only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from core.children import (
    Child,
    LaunchError,
    RestartBudget,
    cpu_seconds,
    free_port,
    group_members,
    port_file,
    python_command,
)

HANG_GUARD_S = 120.0


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
    child = Child.start("probe", python_command("-c", code), tmp_path / "probe.log")
    assert child.process.wait(timeout=60) == 0, child.log_tail()
    out = (tmp_path / "probe.log").read_text().splitlines()
    assert out[0] == "relative to the caller"
    assert not out[1].startswith(str(tmp_path)), out[1]


def test_the_engine_serves_a_model_given_by_a_relative_path(tmp_path, monkeypatch):
    from engine.tiny import init_tiny
    from orchestrator.engines.launch import start_engine

    init_tiny(tmp_path / "models" / "mine", hidden=32, layers=1, heads=2, kv_heads=1,
              intermediate=64)
    monkeypatch.chdir(tmp_path)
    with start_engine("models/mine", startup_timeout=90) as engine:
        info = httpx.get(f"{engine.url}/v1/models", timeout=30).text
    assert "models/mine" in info, info


def test_without_a_log_file_the_child_writes_to_the_parents_output(capfd):
    child = Child.start("peer", python_command("-c", "print('rank 1 here')"), None)
    assert child.wait(timeout=60) == 0
    assert "rank 1 here" in capfd.readouterr().out
    assert "no log" in child.log_tail()


def test_ready_returns_the_port_the_child_wrote(tmp_path):
    target = tmp_path / "port"
    code = ("import os, sys, time; open(sys.argv[1] + '.tmp', 'w').write('4711'); "
            "os.replace(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(600)")
    with Child.start("writer", python_command("-c", code, str(target)),
                     tmp_path / "writer.log") as child:
        assert child.ready(port_file(target), timeout=HANG_GUARD_S, before="listening",
                           within="bind a port") == 4711
        assert child.poll() is None
    assert child.poll() == -signal.SIGTERM


def test_ready_waits_for_a_health_check_to_pass(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "health").write_text("ok")
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=5.0).status_code == 200
        except httpx.TransportError:
            return False

    command = python_command("-m", "http.server", str(port), "--bind", "127.0.0.1",
                             "--directory", str(tmp_path / "site"))
    with Child.start("server", command, tmp_path / "server.log") as child:
        assert child.ready(healthy, timeout=HANG_GUARD_S, before="answering /health",
                           within=f"answer {url}/health") is True
        assert httpx.get(f"{url}/health", timeout=30).text == "ok"


def test_a_child_that_exits_before_it_is_ready_fails_at_once_with_its_log(tmp_path):
    code = "import sys; print('model not found'); sys.exit(3)"
    child = Child.start("engine", python_command("-c", code), tmp_path / "engine.log")
    started = time.monotonic()
    with pytest.raises(LaunchError, match=r"^engine exited with code 3 before listening; "
                                          r"log tail:\nmodel not found\n$"):
        child.ready(lambda: None, timeout=600, before="listening", within="bind a port")
    assert time.monotonic() - started < 300, "reported at once, not after the timeout"


def test_a_child_not_ready_in_time_is_stopped(tmp_path):
    code = "import time; print('loading', flush=True); time.sleep(600)"
    child = Child.start("engine", python_command("-c", code), tmp_path / "engine.log")
    with pytest.raises(LaunchError, match=r"engine did not bind a port within 1s; log tail:\n"):
        child.ready(lambda: None, timeout=1.0, before="listening", within="bind a port")
    assert child.poll() is not None  # stopped and reaped


def test_stopping_a_child_in_its_own_group_ends_the_helpers_it_left(tmp_path):
    """vLLM's server runs its engine core and workers as children; when the server itself is
    SIGKILLed they stay alive (gigabytes each). Stopping it ends every process of its group."""
    child = Child.start("server", ["sh", "-c", "sleep 600 & sleep 600 & wait"],
                        tmp_path / "log", own_group=True)
    deadline = time.monotonic() + 30
    while len(group_members(child.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(group_members(child.pid)) == 3  # the server and its two helpers
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=HANG_GUARD_S)
    assert len(group_members(child.pid)) == 2  # the helpers outlive it
    child.stop(5.0)
    assert group_members(child.pid) == []


def test_a_child_outside_its_own_group_leaves_the_parents_group_alone(tmp_path):
    child = Child.start("sleeper", python_command("-c", "import time; time.sleep(600)"),
                        tmp_path / "log")
    assert os.getpgid(child.pid) == os.getpgid(0)
    assert child.stop(5.0) == -signal.SIGTERM
    assert child.stop(5.0) == -signal.SIGTERM  # stopping again changes nothing


def test_a_log_in_the_scratch_directory_outlives_stop(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    child = Child.start("talker", python_command("-c", "print('last words')"),
                        scratch / "child.log", scratch=scratch)
    child.wait(timeout=60)
    assert child.stop() == 0
    assert not scratch.exists()
    assert child.log_tail() == "last words\n"


def test_a_child_ignoring_sigterm_is_killed_and_reaped(tmp_path):
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('up', flush=True); time.sleep(600)")
    child = Child.start("stubborn", [sys.executable, "-c", code], tmp_path / "log")
    deadline = time.monotonic() + HANG_GUARD_S
    while "up" not in child.log_tail() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert child.stop(timeout=0.5) == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(child.pid, 0)


def test_the_restart_budget_counts_restarts_within_its_window_only():
    now = [0.0]
    budget = RestartBudget(max_restarts=2, window_s=100.0, clock=lambda: now[0])
    assert budget.allow() and budget.allow() and not budget.allow()
    now[0] = 101.0  # both earlier restarts are out of the window
    assert budget.allow() and budget.allow() and not budget.allow()
    assert budget.restarts == 4


def test_a_restart_budget_without_a_window_is_a_number_in_all():
    now = [0.0]
    budget = RestartBudget(max_restarts=1, window_s=float("inf"), clock=lambda: now[0])
    assert budget.allow() and not budget.allow()
    now[0] = 1e9
    assert not budget.allow() and budget.restarts == 1


def test_a_child_that_cannot_be_started_leaves_no_scratch_directory(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with pytest.raises(OSError):
        Child.start("nowhere", [str(tmp_path / "no-such-program")], scratch / "log",
                    scratch=scratch)
    assert not scratch.exists()


def test_cpu_seconds_counts_a_child_process_s_work():
    """The figure the benches print for their server processes (/proc/PID/stat)."""
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys, time\n"
                              "end = time.process_time() + 0.5\n"
                              "while time.process_time() < end: pass\n"
                              "print('done', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "done\n"  # it has spun half a second of CPU
        assert cpu_seconds(child.pid) >= 0.5
    finally:
        child.kill()
        child.wait()
