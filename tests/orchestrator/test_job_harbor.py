"""`stalewise run configs/harbor-smoke.toml`: the tiny model trains on examples/harbor/ through
real Docker, every trajectory scored by its task's own tests/test.sh, with the tools of an MCP
stdio server (trusted, on the host) added to every task; the run leaves no containers behind."""

from __future__ import annotations

import sys

import anyio
import pytest
from sqlalchemy import select

from config.job import load_config
from core.store import schema as s
from tasks import load_family
from tasks.mcp import McpServerConfig, discover_tools, with_tools
from tests.orchestrator.test_job_faults import (
    ROOT,
    check_exactly_once,
    containers_of,
    model_dir,  # noqa: F401 (a fixture)
    open_store,
    start,
    wait_for,
)

pytestmark = [pytest.mark.docker, pytest.mark.slow]
MCP_SERVER = ROOT / "tests" / "tasks" / "mcp_servers" / "notes_server.py"


def expected_hashes() -> dict[str, str]:
    """The content hashes of the example tasks with the MCP server's tools added."""
    job = load_config(ROOT / "configs" / "harbor-smoke.toml")
    family = load_family(f"harbor:{ROOT / 'examples' / 'harbor'}", job.tasks.family_options())
    server = McpServerConfig(command=[sys.executable, str(MCP_SERVER)], name="notes",
                             trusted=True)
    tools = anyio.run(discover_tools, [server], None, None)
    assert "add_note" in [t.name for t in tools]
    return {t.key: t.content_hash for t in with_tools(family, tools).instances("train")}


def test_harbor_smoke_config_trains_on_harbor_tasks(tmp_path, model_dir):  # noqa: F811
    text = (ROOT / "configs" / "harbor-smoke.toml").read_text()
    text = (text.replace('"sqlite:///var/harbor-smoke/stalewise.db"',
                         f'"sqlite:///{tmp_path}/store.db"')
            .replace('"var/harbor-smoke/runs"', f'"{tmp_path}/runs"')
            .replace('"var/models/tiny"', f'"{model_dir}"')
            .replace('"harbor:examples/harbor"', f'"harbor:{ROOT / "examples" / "harbor"}"'))
    text += (f'\n[[tools.mcp]]\ncommand = ["{sys.executable}", "{MCP_SERVER}"]\n'
             f'name = "notes"\ntrusted = true\n')
    config = tmp_path / "job.toml"
    config.write_text(text)
    proc = start(config)
    output, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, output
    store = open_store(tmp_path)
    run = store.runs()[0]
    assert run.status == "finished" and run.summary["learner_steps"] == 2
    check_exactly_once(store, run.id, steps=2)
    with store.engine.connect() as c:
        rows = list(c.execute(select(s.Trajectory.status, s.Trajectory.reward,
                                     s.Trajectory.error, s.TaskInstance.family)
                              .join(s.TaskInstance,
                                    s.TaskInstance.id == s.Trajectory.task_instance_id)
                              .where(s.Trajectory.run_id == run.id)))
    assert {r.family for r in rows} == {"harbor-harbor"}
    with store.engine.connect() as c:
        stored = dict(c.execute(select(s.TaskInstance.key, s.TaskInstance.content_hash)
                                .where(s.TaskInstance.run_id == run.id)).all())
    assert stored == expected_hashes(), "the tasks ran without the MCP server's tools"
    scored = [r for r in rows if r.status == "completed"]
    assert scored and all(r.reward in (0.0, 1.0) for r in scored)  # the tests' own rewards
    assert not [r for r in rows if (r.error or "").startswith("verifier_error")], rows
    wait_for(lambda: not containers_of(run.id), 15, "the run's containers to be removed")
    store.close()
