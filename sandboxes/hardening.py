"""The hardened container configuration: a pure function from a `SandboxSpec` to create kwargs.

Defaults, every one overridable per task through `SandboxLimits` (validated by pydantic):
no network (opt in with `network=True`), all capabilities dropped, no-new-privileges, uid/gid
1000, read-only root with tmpfs /work, /tmp and the spec's scratch dirs (nosuid, nodev,
sized), pids limit, memory limit
with swap off (memory+swap = memory), CPU quota, nofile/fsize/core ulimits, an init process as
PID 1, no log driver (outputs travel over the attach stream only), auto-removal when stopped, and
the labels that orphan cleanup relies on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from core.sandbox import SandboxSpec
from sandboxes.agent import BOOTSTRAP
from sandboxes.image import SANDBOX_GID, SANDBOX_UID
from sandboxes.session import DEFAULT_PATH

if TYPE_CHECKING:
    from docker.api import APIClient


def agent_command(ttl_s: float) -> list[str]:
    """`timeout` is the hard TTL (a kill switch outside the agent); python3 reads the agent."""
    return ["timeout", "-s", "KILL", f"{ttl_s:.0f}", "python3", "-I", "-c", BOOTSTRAP]


def container_config(api: "APIClient", spec: SandboxSpec, *, labels: Mapping[str, str],
                     name: str | None, runtime: str | None = None) -> dict[str, Any]:
    """Keyword arguments for `APIClient.create_container` implementing the hardening above."""
    from docker.types import LogConfig, Ulimit

    lim = spec.limits
    memory = f"{lim.memory_mb}m"
    fsize = lim.fsize_mb * 1024 * 1024
    host_config = api.create_host_config(
        network_mode="bridge" if lim.network else "none",
        cap_drop=["ALL"],
        security_opt=["no-new-privileges:true"],
        read_only=True,
        tmpfs={
            spec.workdir: f"rw,nosuid,nodev,exec,size={lim.workdir_mb}m,"
                          f"uid={SANDBOX_UID},gid={SANDBOX_GID},mode=0755",
            "/tmp": f"rw,nosuid,nodev,exec,size={lim.tmp_mb}m,mode=1777",
            **{path: f"rw,nosuid,nodev,exec,size={lim.tmp_mb}m,"
                     f"uid={SANDBOX_UID},gid={SANDBOX_GID},mode=0755"
               for path in spec.scratch_dirs},
        },
        pids_limit=lim.pids,
        mem_limit=memory,
        memswap_limit=memory,
        nano_cpus=int(lim.cpus * 1e9),
        ulimits=[Ulimit(name="nofile", soft=lim.nofile, hard=lim.nofile),
                 Ulimit(name="fsize", soft=fsize, hard=fsize),
                 Ulimit(name="core", soft=0, hard=0)],
        init=True,
        auto_remove=True,
        log_config=LogConfig(type="none"),
        ipc_mode="private",
        runtime=runtime,
    )
    return {
        "image": spec.image,
        "command": agent_command(lim.ttl_s),
        "user": f"{SANDBOX_UID}:{SANDBOX_GID}",
        "working_dir": spec.workdir,
        "environment": {"PATH": DEFAULT_PATH, "HOME": spec.workdir, "LANG": "C.UTF-8"},
        "hostname": "sandbox",
        "stdin_open": True,
        # with detach=False the SDK sets StdinOnce: stdin closes when our attach connection ends
        # (close, crash, SIGKILL), so the agent sees EOF and the container exits with its owner
        "detach": False,
        "tty": False,
        "labels": dict(labels),
        "name": name,
        "network_disabled": not lim.network,
        "host_config": host_config,
    }
