"""Ray scenarios for tests/orchestrator/test_cluster_ray.py, run in a network namespace.

Ray advertises the machine's own address, which other processes of the test machine may not
reach the same way; inside `unshare -n` the only interface is loopback, so every Ray node,
actor and engine uses 127.0.0.1. PostgreSQL is reached through its unix socket (the root
namespace's TCP ports are not visible here). The script observes and writes a JSON report;
the test asserts on it.

    python ray_scenarios.py REPORT.json WORKDIR PG_SOCKET_URL [placement] [job]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

HANG_GUARD_S = 300.0


def wait_for(predicate, what: str):
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise TimeoutError(f"hang guard: {what} did not happen within {HANG_GUARD_S:.0f}s")


def generate(url: str, seed: int) -> dict:
    import anyio

    from core.engine_api import GenerateRequest, SamplingParams
    from orchestrator.engines.embedded import engine_client

    async def once() -> dict:
        async with engine_client(url) as client:
            result = await client.generate(GenerateRequest(
                prompt_token_ids=[1, 2, 3, 4], params=SamplingParams(max_tokens=4, seed=seed)))
        return {"tokens": len(result.tokens.token_ids),
                "versions": sorted(set(int(v) for v in result.tokens.weights_versions))}

    return anyio.run(once)


def placement(report: dict, workdir: Path, pg_url: str, model: Path, address: str) -> None:
    """Two engine replicas on two nodes: URLs, health, generation, a killed child restarted
    on the same URL with the newest published weights, a replica replaced with named weights,
    a child that keeps dying reported as failed, and a request the cluster has no room for
    refused with the reason."""
    import ray

    from config.cluster import RoleResources
    from config.engine import EngineServerConfig
    from core.store.store import Store
    from orchestrator.cluster.launch import CommandLaunch, EngineLaunch
    from orchestrator.cluster.placement import PlacementError, RoleGroup

    ray.init(address=address, namespace="stalewise-test", log_to_driver=False)
    run_id = "ray-placement"
    store = Store.open(pg_url, create=True)
    store.create_run(run_id, name="ray-placement", config={}, pipeline_mode="async")
    launches = [EngineLaunch(
        name=f"engine-{i}", model_dir=str(model), server=EngineServerConfig(max_batch=4),
        initial_version=0, seed=i, config_path=str(workdir / f"engine-{i}.json"),
        log_path=str(workdir / f"engine-{i}.log"), startup_timeout_s=240.0,
        db_url=pg_url, run_id=run_id) for i in range(2)]
    res = RoleResources(cpus=0.5, resources={"engine_slot": 1}, strategy="STRICT_SPREAD",
                        max_restarts=2)
    engines = RoleGroup.place("engine", res, launches, timeout_s=HANG_GUARD_S)
    try:
        first = engines.statuses()
        report["first"] = first
        report["node_ids_by_actor"] = [s["node_id"] for s in first]
        report["health"] = [engines.call(i, "health") for i in range(2)]
        report["generated"] = [generate(s["url"], seed=i) for i, s in enumerate(first)]

        store.publish_version(run_id, 7, str(model))  # what a restart must pick up
        os.kill(first[1]["pid"], signal.SIGKILL)
        after = wait_for(lambda: (lambda s: s if s[1]["restarts"] == 1
                                  and s[1]["state"] == "running" else None)(engines.statuses()),
                         "the killed engine's restart")
        report["after_kill"] = after
        report["health_after_kill"] = engines.call(1, "health")
        report["generated_after_kill"] = [generate(s["url"], seed=9) for s in after]
        # a router's restart: replica 0 replaced with the weights the driver names
        pending = engines.actors[0].replace.remote(str(model), 5)
        report["status_during_replace"] = wait_for(
            lambda: (lambda s: s if s["state"] == "starting" else None)(engines.statuses()[0]),
            "the replaced replica to report `starting` while its replace call runs")
        report["replaced"] = ray.get(pending, timeout=HANG_GUARD_S)
        report["generated_after_replace"] = generate(report["replaced"]["url"], seed=3)
    finally:
        engines.stop()

    crashing = [CommandLaunch(name="crasher", argv=["-c", "import sys; sys.exit(3)"],
                              log_path=str(workdir / "crasher.log"), exit_ok=False)]
    crash_group = RoleGroup.place("crasher", RoleResources(cpus=0.1, max_restarts=1), crashing,
                                  timeout_s=HANG_GUARD_S)
    try:
        report["crasher"] = wait_for(
            lambda: (lambda s: s if s["state"] == "failed" else None)(crash_group.statuses()[0]),
            "the crashing child to be reported failed")
    finally:
        crash_group.stop()

    try:
        RoleGroup.place("engine", res, launches * 2, timeout_s=5.0)
        report["no_room"] = "placed (unexpected)"
    except PlacementError as exc:
        report["no_room"] = str(exc)
    store.close()
    ray.shutdown()


JOB_CONFIG = """
[run]
name = "ray-job"
db_url = "{db}"
output_dir = "{dir}/runs"
progress_every_s = 5.0

[model]
path = "{model}"
create_tiny = false
chat_format = "hermes"
tool_listing = "none"

[tasks]
family = "arith"
options = {{ max_ops = 1 }}
eval_instances = 2

[rollout]
group_size = 2
max_concurrent = 4
max_tokens_per_turn = 16

[engine]
replicas = 2

[sandbox]
backend = "docker"
pool_size = 2
max_live = 8
hosts = [ {{ url = "unix:///var/run/docker.sock", capacity = 8 }},
          {{ url = "{second_docker}", capacity = 8 }} ]

[learner]
batch_size = 4
micro_batch_size = 2
workers = 2

[learner.sft]
enabled = false

[pipeline]
mode = "async"
steps = 2

[cluster]
backend = "ray"
address = "{address}"

[cluster.engine]
cpus = 0.5
resources = {{ engine_slot = 1 }}

[cluster.learner]
cpus = 0.25
resources = {{ learner_slot = 1 }}
"""


def job(report: dict, workdir: Path, pg_url: str, model: Path, address: str) -> None:
    """`stalewise run` with cluster.backend = "ray": this process only starts the cluster; the
    job's own process is the driver, as a user would run it."""
    from sqlalchemy import text

    from core.store.store import Store

    config = workdir / "job.toml"
    second_docker = os.environ["STALEWISE_TEST_SECOND_DOCKER"]
    config.write_text(JOB_CONFIG.format(db=pg_url, dir=workdir, model=model, address=address,
                                        second_docker=second_docker))
    output = workdir / "job-output.log"
    with open(output, "wb") as sink:
        process = subprocess.Popen([sys.executable, "-m", "stalewise", "run", str(config)],
                                   cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
    store = Store.open(pg_url)
    try:
        # once the engine has served a call, SIGKILL its child: its actor restarts it on its
        # node at the same URL, and the job must carry on
        # both replicas have served calls (each engine process has its own engine_id) before
        # one is killed: the router spread the job's concurrent sessions over them
        wait_for(lambda: process.poll() is not None or _engine_ids(store) >= 2,
                 "model calls served by both replicas")
        report["engines_before_kill"] = _engine_ids(store)
        killed = _engine_children(workdir)
        report["engine_killed_pid"] = killed[0] if killed else None
        if killed:
            os.kill(killed[0], signal.SIGKILL)
            report["engine_restarted_pid"] = wait_for(
                lambda: process.poll() is not None and -1 or next(
                    (p for p in _engine_children(workdir) if p != killed[0]), None),
                "the engine child's restart")
        report["returncode"] = process.wait(timeout=900)
        text_out = output.read_text(errors="replace")
        report["output_tail"] = text_out[-5000:]
        report["dispatch_paused_and_resumed"] = [
            "engine not answering; dispatch paused" in text_out,
            "engine answering again; dispatch resumed" in text_out]
        run = store.runs()[0]
        report["run_status"] = run.status
        report["learner_steps"] = len(store.learner_steps(run.id))
        with store.engine.connect() as c:
            report["model_calls"] = c.execute(text(
                "SELECT count(*) FROM model_calls m JOIN trajectories t "
                "ON m.trajectory_id = t.id WHERE t.run_id = :r"), {"r": run.id}).scalar()
            report["admitted"] = c.execute(text(
                "SELECT count(*) FROM admission_decisions WHERE run_id = :r AND "
                "decision = 'admit'"), {"r": run.id}).scalar()
            report["admitted_distinct"] = c.execute(text(
                "SELECT count(DISTINCT trajectory_id) FROM admission_decisions WHERE "
                "run_id = :r AND decision = 'admit'"), {"r": run.id}).scalar()
            trajectory_ids = [row[0] for row in c.execute(text(
                "SELECT id FROM trajectories WHERE run_id = :r"), {"r": run.id})]
            report["trajectory_statuses"] = dict(c.execute(text(
                "SELECT status, count(*) FROM trajectories WHERE run_id = :r GROUP BY status"),
                {"r": run.id}).all())
        calls = [call for calls in store.model_calls_for(trajectory_ids).values()
                 for call in calls]
        report["token_versions"] = sorted({int(v) for call in calls
                                           for v in call.tokens.weights_versions})
        report["tokens_recorded"] = sum(len(call.tokens.token_ids) for call in calls)
        report["published_versions"] = store.learner_progress(run.id)[0]
        report["recomputed_calls"] = sum(1 for call in calls
                                         if (call.sampling or {}).get("kv_recompute"))
        report["sandbox_hosts"] = (run.summary or {}).get("sandbox_hosts")
        run_dir = workdir / "runs" / run.id
        report["logs"] = sorted(p.name for p in run_dir.glob("*.log"))
    finally:
        store.close()


def _engine_ids(store) -> int:
    from sqlalchemy import text

    with store.engine.connect() as c:
        return c.execute(text("SELECT count(DISTINCT engine_id) FROM model_calls")).scalar()


def _engine_children(workdir: Path) -> list[int]:
    """Pids of `engine serve` processes whose config lies in this scenario's run directory."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"engine" in argv and b"serve" in argv and any(
                a.startswith(str(workdir / "runs").encode()) for a in argv):
            found.append(int(proc.name))
    return found


def main() -> None:
    report_path, workdir, pg_url, *parts = sys.argv[1:]
    workdir = Path(workdir)
    from ray.cluster_utils import Cluster

    from engine.tiny import init_tiny

    report: dict = {}
    model = init_tiny(workdir / "tiny")
    started = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"engine_slot": 1, "learner_slot": 1, "node_a": 1}})
    cluster.add_node(num_cpus=2, resources={"engine_slot": 1, "learner_slot": 1, "node_b": 1})
    cluster.wait_for_nodes()
    report["cluster_start_s"] = round(time.monotonic() - started, 1)
    report["node_ids"] = [n.node_id for n in cluster.list_all_nodes()]
    try:
        for part, run in (("placement", placement), ("job", job)):
            if part not in parts:
                continue
            section: dict = {}
            report[part] = section
            started = time.monotonic()
            try:
                run(section, workdir, pg_url, model, cluster.address)
            except Exception:
                section["error"] = traceback.format_exc()
            section["wall_s"] = round(time.monotonic() - started, 1)
    finally:
        cluster.shutdown()
        Path(report_path).write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
