"""Shared fixtures: fresh SQLite and PostgreSQL databases for store tests; a real short run's
database; the real checkpoint.

Hypothesis runs without its per-example deadline (200 ms by default) or its too-slow health
check: both are wall-clock bounds that a loaded machine breaks.

The terminal summary names the least free disk space seen after a test (and which test): a
machine whose disk fills mid-suite fails tests in scattered ways, and this line says why.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("stalewise", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("stalewise")

# Under `pytest -n 2` (pytest-xdist; `make test`), the tests of each group of files below run on
# one worker, one after another: they share a session fixture made once (the real run; the
# second Docker engine, which the Ray job uses too) or a heavy server that two workers must not
# start at once (vLLM). xdist's own `--dist loadgroup` cannot do it under pytest 9 (it renames
# node ids through an attribute pytest no longer reads), so the scheduler below groups by file,
# and collection refuses a test that needs a group but sits in a file not listed here.
ONE_WORKER_FILES = {
    "tests/engine/test_vllm_backend.py": "vllm",
    "tests/orchestrator/test_vllm_job.py": "vllm",
    "tests/orchestrator/test_cluster_ray.py": "second-dockerd",
    "tests/orchestrator/test_job_hosts.py": "second-dockerd",
    "tests/sandboxes/test_sandbox_hosts.py": "second-dockerd",
    "tests/orchestrator/test_real_run_evaluations.py": "real-run",
    "tests/stalewise/test_audit_template.py": "real-run",
    "tests/stalewise/test_exports.py": "real-run",
    "tests/viewer/test_viewer_browser.py": "real-run",
    "tests/viewer/test_viewer_xss.py": "real-run",
}
_GROUP_OF_FIXTURE = {"real_run": "real-run", "_second_dockerd": "second-dockerd"}
_GROUP_OF_MARK = {"vllm": "vllm", "ray": "second-dockerd"}


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _needed_group(item: pytest.Item) -> str | None:
    for fixture, group in _GROUP_OF_FIXTURE.items():
        if fixture in item.fixturenames:
            return group
    return next((group for mark, group in _GROUP_OF_MARK.items()
                 if item.get_closest_marker(mark)), None)


def pytest_collection_modifyitems(items):
    for item in items:
        needed, path = _needed_group(item), _file_of(item.nodeid)
        if needed is not None and ONE_WORKER_FILES.get(path) != needed:
            raise pytest.UsageError(
                f"{item.nodeid} belongs to the one-worker group {needed!r}: add "
                f'"{path}": "{needed}" to ONE_WORKER_FILES in tests/conftest.py')


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Load scheduling in which a file of ONE_WORKER_FILES is part of its group's one unit of
    work (sent whole to one worker) and any other test is a unit of its own. It takes the place
    of `--dist load` (the default of `-n N`); other `--dist` modes are xdist's own."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneWorkerGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return ONE_WORKER_FILES.get(_file_of(nodeid), nodeid)

    return OneWorkerGroups(config, log)


_least_free = {"bytes": float("inf"), "test": ""}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """After each test body (its tmp_path still full): the free space where tmp_path lives, sent
    with the test's report (so it reaches the summary from an xdist worker too)."""
    try:
        return (yield)
    finally:
        item.user_properties.append(("disk_free", shutil.disk_usage(tempfile.gettempdir()).free))


def pytest_runtest_logreport(report):
    free = dict(report.user_properties).get("disk_free")
    if report.when == "call" and free is not None and free < _least_free["bytes"]:
        _least_free.update(bytes=free, test=report.nodeid)


@pytest.hookimpl(trylast=True)  # after the durations, next to the failures' summary
def pytest_terminal_summary(terminalreporter):
    if _least_free["test"]:
        free = _least_free["bytes"] / 1e9
        terminalreporter.write_line(
            f"disk: {free:.1f} GB free at the least, under {tempfile.gettempdir()}, after "
            f"{_least_free['test']}" + (" -- the disk was (nearly) full: tests that write "
                                        "checkpoints or images fail for that" if free < 1 else ""))


PG_ADMIN_URL = os.environ.get(
    "STALEWISE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:54329/stalewise_test")


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'store.db'}"


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A new, empty PostgreSQL database (dropped afterwards) on the test server."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import OperationalError

    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"t_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as c:
            c.execute(text(f"CREATE DATABASE {name}"))
    except OperationalError as exc:
        admin.dispose()
        pytest.fail(f"PostgreSQL test server not reachable at {PG_ADMIN_URL} ({exc.orig}); "
                    f"start it with: bash scripts/ensure_postgres.sh")
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    try:
        yield url
    finally:
        with admin.connect() as c:
            c.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()


REAL_RUN_CONFIG = """
[run]
name = "real-run"
db_url = "sqlite:///{dir}/store.db"
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
max_tokens_per_turn = 24
logprobs_topk = 3

[sandbox]
backend = "local"
pool_size = 2
max_live = 8

[learner]
batch_size = 4
micro_batch_size = 4

[pipeline]
mode = "async"
steps = 2
"""


@pytest.fixture(scope="session")
def real_run(tmp_path_factory) -> tuple[str, str]:
    """(database URL, run id) of a short real job: tiny model, local sandboxes, two async
    learner steps, an evaluation before and after. Made once per test session (about a minute
    and a half on two cores) for the readers of a run: the viewer and the exports."""
    import subprocess
    import sys
    from pathlib import Path

    from core.store.store import Store
    from engine.tiny import init_tiny

    directory = tmp_path_factory.mktemp("real-run")
    model = init_tiny(directory / "tiny")
    config = directory / "job.toml"
    config.write_text(REAL_RUN_CONFIG.format(dir=directory, model=model))
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "stalewise", "run", str(config)], cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    url = f"sqlite:///{directory / 'store.db'}"
    store = Store.open(url)
    try:
        run_id = store.runs()[0].id
    finally:
        store.close()
    return url, run_id


SMOLLM2_DIR = Path(__file__).resolve().parents[1] / "var" / "models" / "smollm2-135m"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a float32 checkpoint, built by the test set-up (never committed)."""
    if not (SMOLLM2_DIR / "model.safetensors").is_file():
        pytest.fail(f"{SMOLLM2_DIR} is missing; build it with: bash scripts/fetch_models.sh")
    return SMOLLM2_DIR


@pytest.fixture(scope="session")
def _second_dockerd():
    """One second Docker engine per test session (scripts/second_dockerd.sh), stopped at the
    end; it holds stalewise-base (copied from the first engine)."""
    from docker_hosts import SecondDockerd

    from sandboxes.image import build_base

    build_base(log=lambda line: None)
    engine = SecondDockerd()
    try:
        engine.start()
        engine.import_images("stalewise-base:latest")
        yield engine
    finally:
        engine.stop()


@pytest.fixture
def second_docker_host(_second_dockerd):
    """The session's second Docker engine, running (restarted if an earlier test killed it)."""
    _second_dockerd.start()
    return _second_dockerd
