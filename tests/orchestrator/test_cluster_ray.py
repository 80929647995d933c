"""Placement on a real two-node Ray cluster (`ray.cluster_utils.Cluster`), in a network
namespace of its own (tests/orchestrator/ray_scenarios.py says why), with a PostgreSQL store.

Contract:
- two engine replicas asking for one `engine_slot` each under STRICT_SPREAD land on the two
  nodes, report their URLs, answer /health and generate;
- a replica whose child is SIGKILLed is restarted by its actor on its node, at the same URL,
  serving the newest version the store lists as published; the other replica is untouched;
- `replace` (a replica router's restart) serves the weights and version the driver names;
- a child that keeps dying is reported `failed` with each exit and its log tail;
- a request the cluster has no room for is refused with what was asked and what is free;
- `stalewise run` with `[cluster] backend = "ray"` finishes a short job with two engine
  replicas (one per node, behind the replica router), two data-parallel learner workers
  (gloo, ranks handed out by the placement) and sandboxes on two Docker engines (the second a
  separate dockerd standing in for a remote host), although one engine child is SIGKILLed
  after the first model call (its actor restarts it): every model call and admission recorded
  in PostgreSQL, nothing admitted twice, both replicas served calls, per-token versions as
  locally, one log per placed child in the run directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

pytestmark = [pytest.mark.ray, pytest.mark.postgres, pytest.mark.docker, pytest.mark.slow]

SCENARIOS = Path(__file__).with_name("ray_scenarios.py")
PG_SOCKET_DIR = os.environ.get("STALEWISE_TEST_PG_SOCKET_DIR", "/tmp")


def socket_url(tcp_url: str) -> str:
    """The same database through the server's unix socket (reachable in the namespace)."""
    url = make_url(tcp_url)
    return (f"postgresql+psycopg://{url.username}@/{url.database}"
            f"?host={PG_SOCKET_DIR}&port={url.port or 5432}")


@pytest.fixture(scope="module")
def ray_report(tmp_path_factory, _second_dockerd) -> dict:
    import ray  # noqa: F401  (a test dependency: scripts/setup.sh installs it)

    from tests.conftest import PG_ADMIN_URL

    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.fail("the Ray tests need `unshare` (util-linux) and `ip` (iproute2)")
    from sqlalchemy import create_engine, text

    name = f"t_ray_{os.getpid()}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        c.execute(text(f"CREATE DATABASE {name}"))
    workdir = tmp_path_factory.mktemp("ray")
    report = workdir / "report.json"
    db = socket_url(PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name)
    inner = f"{sys.executable} {SCENARIOS} {report} {workdir} '{db}' placement job"
    second_docker = _second_dockerd.start()  # its unix socket is reachable in the namespace
    try:
        done = subprocess.run(["unshare", "-n", "sh", "-c",
                               f"ip link set lo up && exec {inner}"],
                              capture_output=True, text=True, timeout=1800,
                              cwd=Path(__file__).resolve().parents[2],
                              env={**os.environ, "STALEWISE_TEST_SECOND_DOCKER": second_docker})
        assert report.is_file(), (f"the scenario wrote no report (code {done.returncode}):\n"
                                  f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
        data = json.loads(report.read_text())
        print(json.dumps({k: v for k, v in data.items() if k not in ("placement", "job")}),
              json.dumps({part: data.get(part, {}).get("wall_s") for part in ("placement",
                                                                               "job")}))
        return data
    finally:
        with admin.connect() as c:
            c.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()


def _section(report: dict, name: str) -> dict:
    section = report.get(name)
    assert section is not None, f"the {name} scenario did not run: {report}"
    assert "error" not in section, section["error"]
    return section


def test_replicas_land_on_different_nodes_and_generate(ray_report):
    placed = _section(ray_report, "placement")
    first = placed["first"]
    assert [s["state"] for s in first] == ["running", "running"]
    assert len(set(placed["node_ids_by_actor"])) == 2
    assert set(placed["node_ids_by_actor"]) <= set(ray_report["node_ids"])
    assert all(s["url"].startswith("http://127.0.0.1:") for s in first)
    assert len({s["url"] for s in first}) == 2
    assert placed["health"] == [True, True]
    assert [g["tokens"] for g in placed["generated"]] == [4, 4]
    assert [g["versions"] for g in placed["generated"]] == [[0], [0]]


def test_killed_replica_restarts_on_its_node_with_newest_weights(ray_report):
    placed = _section(ray_report, "placement")
    first, after = placed["first"], placed["after_kill"]
    assert after[1]["restarts"] == 1 and after[1]["state"] == "running"
    assert after[1]["pid"] != first[1]["pid"]
    assert after[1]["url"] == first[1]["url"]
    assert after[1]["node_id"] == first[1]["node_id"]
    assert "exited with code -9" in after[1]["failures"][0]
    assert placed["health_after_kill"] is True
    assert after[0]["restarts"] == 0 and after[0]["pid"] == first[0]["pid"]
    # the restarted replica serves version 7 (published meanwhile); the other still 0
    assert [g["versions"] for g in placed["generated_after_kill"]] == [[0], [7]]


def test_replica_replaced_with_the_weights_the_driver_names(ray_report):
    placed = _section(ray_report, "placement")
    replaced, first = placed["replaced"], placed["first"][0]
    assert placed["status_during_replace"]["state"] == "starting"  # status still answers
    assert replaced["state"] == "running" and replaced["restarts"] == 1
    assert replaced["url"] == first["url"] and replaced["pid"] != first["pid"]
    assert "replaced by the driver with version 5" in replaced["failures"][0]
    assert placed["generated_after_replace"]["versions"] == [5]


def test_child_that_keeps_dying_is_reported_failed(ray_report):
    crasher = _section(ray_report, "placement")["crasher"]
    assert crasher["state"] == "failed"
    assert crasher["restarts"] == 1
    assert len(crasher["failures"]) == 2
    assert all("exited with code 3" in f for f in crasher["failures"])


def test_no_room_is_refused_with_the_reason(ray_report):
    message = _section(ray_report, "placement")["no_room"]
    assert "found no room for 4 x" in message and "engine_slot" in message
    assert "free now" in message


def test_job_runs_end_to_end_on_ray_through_an_engine_restart(ray_report):
    job = _section(ray_report, "job")
    assert job["returncode"] == 0, job["output_tail"]
    # one engine child was killed after its first call and its actor restarted it
    assert job["engine_killed_pid"] is not None
    assert job["engine_restarted_pid"] not in (None, -1, job["engine_killed_pid"])
    assert job["run_status"] == "finished"
    assert job["learner_steps"] == 2
    assert job["model_calls"] > 0
    assert job["admitted"] >= 8  # two steps of batch_size 4
    assert job["admitted"] == job["admitted_distinct"]
    # both replicas served model calls before the kill (the router spreads new sessions)
    assert job["engines_before_kill"] == 2
    # sandboxes were placed on both Docker engines
    hosts = job["sandbox_hosts"]
    assert hosts is not None and len(hosts) == 2
    assert all(h["placed"] > 0 for h in hosts.values()), hosts
    # per-token versions recorded as locally: the evaluation after training ran on the
    # Ray-placed engines with the learner's last published version (rank 0 publishes)
    assert job["tokens_recorded"] > 0 and job["published_versions"] == 2
    assert job["token_versions"][0] == 0 and job["token_versions"][-1] == 2
    assert {"engine-0.log", "engine-1.log", "learner-0.log", "learner-1.log"} <= set(job["logs"])
