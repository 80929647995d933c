"""Every benchmark script under bench/ runs, on a small workload, and prints its figure.

README's speed figures come from these scripts, and nothing else imports them: a rename in the
packages they use (the engine client's `kind`, once `backend`) broke `bench/engine.py` without a
test noticing. Each case runs a script as a user would, in its own process, and holds it to
exiting 0 and printing the line its figure is read from. The figures themselves are not judged
here (speed is for the scripts to print, never for a test to bound).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"

CASES = {
    "engine": (["--sessions", "1,2", "--tokens", "4", "--repeats", "1", "--turns", "2"],
               "engine HTTP vs HF generate at equal batch", ()),
    "learner": (["--batch", "4", "--length", "32", "--prompt", "8", "--micro", "2",
                 "--repeats", "1", "--threads", "1"], "score-centering overhead at k=32", ()),
    "viewer": (["--tokens", "2000", "--turns", "2"], "target < 2 s for the trajectory page", ()),
    "orchestrator": (["--concurrent", "20", "--seconds", "1", "--warmup", "0.5"],
                     "CPU ms per turn", ()),
    "agent_loop": (["--formats", "hermes", "--suites", "arith", "--concurrency", "10",
                    "--trajectories", "10"], "hermes    arith", ()),
    "mcp_calls": (["--calls", "3"], "then median", ()),
    "sandbox": (["--sandboxes", "2", "--execs", "2", "--samples", "5"], "errors: 0",
                (pytest.mark.docker,)),
}


def run_bench(name: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH / f"{name}.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(name, marks=marks)
                                  for name, (_, _, marks) in CASES.items()])
def test_a_benchmark_script_runs_and_prints_its_figure(name):
    args, figure_line, _ = CASES[name]
    done = run_bench(name, args, cwd=BENCH.parent)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert figure_line in done.stdout, output[-4000:]


def test_the_store_benchmark_removes_its_database_and_nothing_beside_it(tmp_path):
    neighbour = tmp_path / "results.db"
    neighbour.write_text("a user's file")
    done = run_bench("store", ["--trajectories", "20", "--turns", "2", "--tokens", "10",
                               "--url", f"sqlite:///{tmp_path / 'bench.db'}"], cwd=BENCH.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tokens/s" in done.stdout
    assert neighbour.read_text() == "a user's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.db"]


def test_the_store_benchmark_refuses_a_database_that_exists(tmp_path):
    existing = tmp_path / "stalewise.db"
    existing.write_bytes(b"recorded runs")
    done = run_bench("store", ["--url", f"sqlite:///{existing}"], cwd=BENCH.parent)
    assert done.returncode != 0
    assert f"{existing} exists" in done.stderr and "another --url" in done.stderr
    assert existing.read_bytes() == b"recorded runs"
