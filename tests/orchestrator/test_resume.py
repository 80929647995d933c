"""`--resume` refuses runs it must not touch, with a message that says what to do instead."""

from __future__ import annotations

import subprocess

import pytest

from core.store.store import Store
from orchestrator.resume import ResumeError, check_resumable, recover_run


def test_resume_refuses_a_missing_a_finished_and_a_live_run(sqlite_url):
    store = Store.open(sqlite_url, create=True)
    with pytest.raises(ResumeError, match="no run 'nope'.*stalewise audit runs"):
        check_resumable(store, "nope")

    store.create_run("done", name="t", config={}, pipeline_mode="async")
    store.set_run_status("done", "finished")
    with pytest.raises(ResumeError, match="already finished"):
        check_resumable(store, "done")

    owner = subprocess.Popen(["sleep", "60"])  # another orchestrator still working on the run
    try:
        store.create_run("live", name="t", config={}, pipeline_mode="async")
        store.set_run_status("live", "running", pid=owner.pid)
        with pytest.raises(ResumeError, match=f"still running \\(pid {owner.pid}"):
            recover_run(store, "live")
    finally:
        owner.kill()
        owner.wait()
    assert recover_run(store, "live") == {"aborted_trajectories": 0, "aborted_groups": 0}
    store.close()
