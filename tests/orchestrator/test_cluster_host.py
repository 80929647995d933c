"""The Ray actor's body, driven directly (no Ray): it starts, watches and restarts its child.

Contract: a child that dies is restarted up to `max_restarts` times, each exit kept with its
log tail, then the host is `failed`; a child whose launch allows it may finish with code 0
(`exited`) and is started again only when the driver asks; `stop` reaps the child; a launch
that cannot start is reported, not raised into the driver.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from config.cluster import ClusterConfig, RoleResources
from orchestrator.cluster.host import ChildHost
from orchestrator.cluster.launch import CommandLaunch
from orchestrator.cluster.placement import PlacementError, bundle, connect

HANG_GUARD_S = 120.0


def wait_state(host: ChildHost, predicate) -> dict:
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        status = host.status()
        if predicate(status):
            return status
        time.sleep(0.05)
    raise AssertionError(f"hang guard: the host never reached the state; last: {host.status()}")


def test_killed_child_is_restarted_then_reported_failed(tmp_path):
    launch = CommandLaunch(name="sleeper", argv=["-c", "import time; print('up', flush=True);"
                                                       " time.sleep(600)"],
                           log_path=str(tmp_path / "sleeper.log"), exit_ok=True)
    host = ChildHost(launch, max_restarts=1, poll_s=0.05)
    try:
        first = host.start()
        assert first["state"] == "running" and first["node_ip"] == "127.0.0.1"
        wait_state(host, lambda s: "up" in host.log_tail())
        os.kill(first["pid"], signal.SIGKILL)
        second = wait_state(host, lambda s: s["restarts"] == 1 and s["state"] == "running")
        assert second["pid"] != first["pid"]
        assert "exited with code -9" in second["failures"][0]
        assert "up" in second["failures"][0]  # the log tail of the dead child
        os.kill(second["pid"], signal.SIGKILL)
        failed = wait_state(host, lambda s: s["state"] == "failed")
        assert failed["restarts"] == 1 and len(failed["failures"]) == 2
    finally:
        host.stop(timeout=5.0)


def test_finished_child_waits_for_the_driver_to_restart_it(tmp_path):
    launch = CommandLaunch(name="oneshot", argv=["-c", "print('done')"],
                           log_path=str(tmp_path / "oneshot.log"), exit_ok=True)
    host = ChildHost(launch, max_restarts=2, poll_s=0.05)
    try:
        host.start()
        exited = wait_state(host, lambda s: s["state"] == "exited")
        assert exited["exit_code"] == 0 and exited["restarts"] == 0
        host.restart()
        again = wait_state(host, lambda s: s["restarts"] == 1 and s["state"] == "exited")
        assert "restart requested by the driver" in again["failures"][0]
    finally:
        assert host.stop(timeout=5.0) == 0
    assert host.status()["state"] == "stopped"


def test_stop_reaps_a_running_child(tmp_path):
    launch = CommandLaunch(name="sleeper", argv=["-c", "import time; time.sleep(600)"],
                           log_path=str(tmp_path / "s.log"))
    host = ChildHost(launch, poll_s=0.05)
    pid = host.start()["pid"]
    assert host.stop(timeout=5.0) == -signal.SIGTERM
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_launch_that_cannot_start_is_reported(tmp_path):
    launch = CommandLaunch(name="nowhere", argv=["-c", "pass"],
                           log_path=str(tmp_path / "file-not-dir" / "x.log"))
    (tmp_path / "file-not-dir").write_text("a file where a directory is needed")
    host = ChildHost(launch)
    status = host.start()
    assert status["state"] == "failed" and "could not start" in status["failures"][0]
    host.stop()


def test_bundles_drop_zero_amounts_and_refuse_empty_requests():
    assert bundle(RoleResources(cpus=2, gpus=0, resources={"a": 1})) == {"CPU": 2.0, "a": 1.0}
    with pytest.raises(PlacementError, match="no resources at all"):
        bundle(RoleResources(cpus=0))


def test_replace_stops_the_child_and_starts_a_new_one(tmp_path):
    launch = CommandLaunch(name="sleeper", argv=["-c", "import time; time.sleep(600)"],
                           log_path=str(tmp_path / "s.log"))
    host = ChildHost(launch, max_restarts=1, poll_s=0.05)
    try:
        first = host.start()
        replaced = host.replace("/unused/by/commands", 4, timeout=5.0)
        assert replaced["state"] == "running" and replaced["pid"] != first["pid"]
        assert replaced["restarts"] == 1
        assert "replaced by the driver with version 4" in replaced["failures"][0]
        with pytest.raises(ProcessLookupError):
            os.kill(first["pid"], 0)
    finally:
        host.stop(timeout=5.0)


def test_an_address_nothing_listens_on_fails_fast_with_the_fix():
    import socket

    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(PlacementError, match="ray start --head"):
        connect(ClusterConfig(backend="ray", address=f"127.0.0.1:{port}"))
