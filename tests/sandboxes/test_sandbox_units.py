"""Pure parts of the sandbox layer: output capture, orphan rules, hardened config, validation."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from core.sandbox import SandboxLimits, SandboxSpec
from sandboxes import labels as lab
from sandboxes.agent import CUT_MARKER, Capture


def _capture(chunks: list[bytes], cap: int) -> dict:
    capture = Capture(cap)
    for chunk in chunks:
        capture.feed(chunk)
    return capture.result()


def test_capture_keeps_everything_under_the_cap() -> None:
    out = _capture([b"hello ", b"world"], cap=64)
    assert base64.b64decode(out["data"]) == b"hello world"
    assert out["bytes"] == 11 and not out["truncated"]
    assert out["sha256"] == hashlib.sha256(b"hello world").hexdigest()


def test_capture_keeps_head_and_tail_with_a_cut_marker() -> None:
    data = bytes(range(256)) * 40  # 10240 bytes fed in odd-sized chunks
    chunks = [data[i:i + 777] for i in range(0, len(data), 777)]
    out = _capture(chunks, cap=1000)
    body = base64.b64decode(out["data"])
    cut = len(data) - 1000
    assert body == data[:500] + CUT_MARKER % cut + data[-500:]
    assert out["bytes"] == len(data) and out["truncated"]
    assert out["sha256"] == hashlib.sha256(data).hexdigest()


def test_capture_exactly_at_the_cap_is_not_truncated() -> None:
    data = b"x" * 1000
    out = _capture([data[:10], data[10:]], cap=1000)
    assert base64.b64decode(out["data"]) == data and not out["truncated"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_orphan_rules() -> None:
    me = lab.Owner.current()
    now = 1_000_000.0
    alive = lab.container_labels(run_id="r1", trajectory_id="t1", ttl_s=100, installation="i",
                                 owner=me, now=now)
    assert lab.orphan_reason(alive, me=me, now=now + 10) is None
    assert "time to live" in (lab.orphan_reason(alive, me=me, now=now + 1000) or "")
    dead = dict(alive, **{lab.OWNER_PID: str(_dead_pid())})
    assert "gone" in (lab.orphan_reason(dead, me=me, now=now + 10) or "")
    reused = dict(alive, **{lab.OWNER_START: "1"})  # our pid, but a different process start
    assert "gone" in (lab.orphan_reason(reused, me=me, now=now + 10) or "")
    elsewhere = dict(dead, **{lab.OWNER_HOST: me.host + "-other"})
    assert lab.orphan_reason(elsewhere, me=me, now=now + 10) is None


def test_installation_id_is_stable(tmp_path: pytest.TempPathFactory,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STALEWISE_INSTALLATION_ID", raising=False)
    monkeypatch.setenv("STALEWISE_HOME", str(tmp_path))
    first = lab.installation_id()
    assert first and lab.installation_id() == first
    assert (tmp_path / "installation_id").read_text().strip() == first


def test_hardened_config_has_every_default() -> None:
    from docker.api import APIClient

    from sandboxes.hardening import container_config

    api = APIClient(base_url="unix:///nonexistent.sock", version="1.41")
    spec = SandboxSpec(limits=SandboxLimits(memory_mb=300, pids=77, cpus=0.5, nofile=99,
                                            fsize_mb=3, workdir_mb=5, tmp_mb=6, ttl_s=42))
    cfg = container_config(api, spec, labels={"a": "b"}, name="n")
    host = cfg["host_config"]
    assert host["NetworkMode"] == "none" and cfg["network_disabled"]
    assert host["CapDrop"] == ["ALL"] and not host.get("CapAdd")
    assert host["SecurityOpt"] == ["no-new-privileges:true"]
    assert host["ReadonlyRootfs"] is True and host["Init"] is True
    assert cfg["user"] == "1000:1000"
    assert host["PidsLimit"] == 77
    assert host["Memory"] == host["MemorySwap"] == 300 * 1024 * 1024
    assert host["NanoCpus"] == 500_000_000
    ulimits = {u["Name"]: u["Hard"] for u in host["Ulimits"]}
    assert ulimits == {"nofile": 99, "fsize": 3 * 1024 * 1024, "core": 0}
    assert "size=5m" in host["Tmpfs"]["/work"] and "nosuid" in host["Tmpfs"]["/work"]
    assert "size=6m" in host["Tmpfs"]["/tmp"]
    assert cfg["command"][:4] == ["timeout", "-s", "KILL", "42"]
    assert cfg["labels"] == {"a": "b"}
    engine_config = api.create_container_config(**{k: v for k, v in cfg.items() if k != "name"})
    assert engine_config["OpenStdin"] and engine_config["StdinOnce"]  # dies with its owner
    assert "PATH" in cfg["environment"] and not set(cfg["environment"]) & {
        k for k in os.environ if k not in ("PATH", "HOME", "LANG")}
    networked = container_config(api, SandboxSpec(limits=SandboxLimits(network=True)),
                                 labels={}, name=None)
    assert networked["host_config"]["NetworkMode"] == "bridge"


@pytest.mark.parametrize("bad", [{"memory_mb": 1}, {"pids": 0}, {"cpus": 0},
                                 {"exec_timeout_s": -1}, {"unknown_limit": 3}])
def test_limit_overrides_are_validated(bad: dict) -> None:
    with pytest.raises(ValidationError):
        SandboxLimits(**bad)


@pytest.mark.parametrize("workdir", ["work", "/", "/tmp"])
def test_workdir_must_be_a_dedicated_absolute_path(workdir: str) -> None:
    with pytest.raises(ValidationError, match="absolute path"):
        SandboxSpec(workdir=workdir)


@pytest.mark.parametrize("answer", [b"", b"HTTP/1.1 101 UPGRADED\r\n"])
def test_an_engine_that_dies_mid_attach_is_an_unreachable_host(tmp_path, answer) -> None:
    """A Docker engine killed while a sandbox attaches resets the socket. That is the host
    going away (HostUnreachable: the backend marks the host, the pool retries elsewhere),
    not an anyio error escaping the pool's task group and failing the job."""
    import socket
    import threading

    import anyio

    from core.sandbox import HostUnreachable
    from sandboxes.attach import open_attach

    path = str(tmp_path / "docker.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def engine_killed_mid_handshake() -> None:
        conn, _ = server.accept()
        conn.sendall(answer)  # nothing, or half a response head
        conn.close()  # the request still unread: the client's next read is a reset

    thread = threading.Thread(target=engine_killed_mid_handshake, daemon=True)
    thread.start()
    try:
        with pytest.raises(HostUnreachable, match=r"dropped the attach to 0123456789ab"):
            anyio.run(open_attach, f"unix://{path}", "1.43", "0123456789abcdef")
    finally:
        thread.join(5)
        server.close()
