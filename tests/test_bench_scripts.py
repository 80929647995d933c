"""Every benchmark script under bench/ runs, on a small workload, and prints its figure.

README's speed figures come from these scripts, and nothing else imports them: a rename in the
packages they use (the engine client's `kind`, once `backend`) broke `bench/engine.py` without a
test noticing. Each case runs a script as a user would, in its own process, and holds it to
exiting 0 and printing the line its figure is read from. The figures themselves are not judged
here (speed is for the scripts to print, never for a test to bound).
"""

from __future__ import annotations

import importlib.util
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
    "engine_client": (["--in-flight", "20", "--connections", "8", "--seconds", "1",
                       "--warmup", "0.5", "--repeats", "1"],
                      ("engine client benchmark", "      http  ", "      vllm  ", "     vllm1  "),
                      ()),
    "agent_loop": (["--formats", "hermes", "--suites", "arith", "--concurrency", "10",
                    "--trajectories", "10"], "hermes    arith", ()),
    "mcp_calls": (["--calls", "3"], "then median", ()),
    "pipeline": (["--quick", "--sweep", "", "--reweight", "propensity", "--reserves", "0.9"],
                 ("staleness-feasible", "beyond weights", "the staleness bound's reservation"),
                 ()),
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
    args, figure_lines, _ = CASES[name]
    done = run_bench(name, args, cwd=BENCH.parent)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    for line in (figure_lines,) if isinstance(figure_lines, str) else figure_lines:
        assert line in done.stdout, output[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("engine, where", [("http", "in a child process over HTTP"),
                                           ("vllm", "behind vLLM's streamed route")])
def test_the_orchestrator_benchmark_reaches_a_served_engine_through_a_jobs_client(engine, where):
    """`--engine http|vllm`: the scripted engine in a child process, found by the job's engine
    client (the embedded one, or vLLM's); every call answered (the child finds each
    trajectory's task in the store: by the session the request names)."""
    done = run_bench("orchestrator", ["--engine", engine, "--concurrent", "20", "--seconds",
                                      "2", "--warmup", "1"], cwd=BENCH.parent)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert where in done.stdout and "engine CPU ms/turn" in done.stdout
    figures = {line[:23].strip(): line[23:].split()[0]  # "  name (padded)  value  (note)"
               for line in done.stdout.splitlines() if line.startswith("  ")}
    assert figures["engine errors"] == "0", output[-4000:]
    assert float(figures["agent turns/s"].replace(",", "")) > 0, output[-4000:]


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


def bench_module(name: str):
    """bench/NAME.py imported as a module (nothing in the packages imports the scripts)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_the_staleness_bound_is_the_ideal_when_every_trajectory_ends_within_the_lag():
    feasible = bench_module("pipeline").staleness_feasible
    # 10 slots of 1 s trajectories: the ideal is 10/s, one version bump every 0.5 s at it
    rate, stopped = feasible([(1.0, 1.0)], 10.0, slots=10, kept=1.0, batch=5, max_lag=8)
    assert rate == pytest.approx(10.0) and stopped == 0.0


def test_the_staleness_bound_caps_the_rate_where_a_trajectory_would_see_too_many_versions():
    feasible = bench_module("pipeline").staleness_feasible
    # max_lag 0: a 1 s trajectory must end before the first bump, batch / rate seconds away,
    # so the rate stays under 5/s although the slots allow 10/s
    rate, stopped = feasible([(1.0, 1.0)], 10.0, slots=10, kept=1.0, batch=5, max_lag=0)
    assert 4.9 < rate < 5.0 and stopped == 0.0


def test_the_staleness_bound_reports_what_a_rate_bought_by_stopping_the_long_ones_costs():
    feasible = bench_module("pipeline").staleness_feasible
    # half 0.1 s, half 1 s: the ideal is 10 / 0.55 = 18.2/s. Under 10/s a version lasts over
    # 0.1 s, so the short ones are admitted and the long ones stopped when the version moves:
    # the slots then turn over fast enough for 10/s, half the dispatched work thrown away.
    ideal = 10 / 0.55
    rate, stopped = feasible([(0.5, 0.1), (0.5, 1.0)], ideal, slots=10, kept=1.0, batch=1,
                             max_lag=0)
    assert 9.9 < rate < 10.0 and stopped == pytest.approx(0.5)
    assert feasible([(0.5, 0.1), (0.5, 1.0)], ideal, slots=10, kept=1.0, batch=1,
                    max_lag=100) == (pytest.approx(ideal), 0.0)


def test_the_run_ideal_is_the_slots_rate_where_nothing_ramps_and_the_learner_is_free():
    run_ideal = bench_module("pipeline").run_ideal
    # 2 slots, 1 s trajectories, groups of 1 all kept: 2 done each second, a batch of 2 a step
    assert run_ideal([([1.0], True)] * 10, slots=2, batch=2, steps=3,
                     learner_s=0.0) == pytest.approx(2.0)


def test_the_run_ideal_counts_a_groups_wait_for_its_last_member_and_the_learners_steps():
    run_ideal = bench_module("pipeline").run_ideal
    # 3 slots, groups of 2: the second group's second member starts when a slot frees at 1 s,
    # so that group is decided at 2 s; the learner steps 0.5 s after each batch of 2
    assert run_ideal([([1.0, 1.0], True)] * 4, slots=3, batch=2, steps=2,
                     learner_s=0.5) == pytest.approx(4 / 2.5)
    # a slow learner sets the pace: one batch of 2 trajectories, then 10 s steps
    assert run_ideal([([0.1, 0.1], True)] * 20, slots=4, batch=2, steps=3,
                     learner_s=10.0) == pytest.approx(6 / 30.1)


def test_the_run_ideal_admits_nothing_from_a_dropped_group_but_spends_its_slot_time():
    run_ideal = bench_module("pipeline").run_ideal
    # one slot: the dropped group runs 0-1 s, the kept one 1-2 s
    assert run_ideal([([1.0], False), ([1.0], True)], slots=1, batch=1, steps=1,
                     learner_s=0.0) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="cannot fill"):
        run_ideal([([1.0], False)] * 3, slots=1, batch=1, steps=1, learner_s=0.0)
