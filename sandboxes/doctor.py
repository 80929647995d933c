"""`stalewise sandbox doctor`: is this machine ready to run hardened sandboxes?

Checks, in order: the engine answers; the base image exists; which container runtimes are
registered (gVisor `runsc` is reported when present); and, inside a real sandbox started with
the default hardening, that every limit is in force (non-root, no capabilities, no-new-privileges,
loopback-only network, read-only root, writable tmpfs work dir, memory limit with swap off, pids
limit, CPU quota), plus a quick exec round-trip time. A check never raises: failures are rows.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from typing import Literal

from core.sandbox import SandboxError, SandboxSpec

Status = Literal["ok", "fail", "info"]

PROBE = r"""
import json, os
def read(path):
    try:
        with open(path) as f: return f.read().strip()
    except OSError: return None
status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
try:
    open("/stalewise-probe", "w").close(); root_ro = False
except OSError:
    root_ro = True
try:
    open("/work/.probe", "w").close(); work_rw = True
except OSError:
    work_rw = False
print(json.dumps({
    "uid": os.getuid(), "nnp": status.get("NoNewPrivs", "").strip(),
    "capeff": status.get("CapEff", "").strip(), "ifaces": sorted(os.listdir("/sys/class/net")),
    "root_ro": root_ro, "work_rw": work_rw,
    "mem": read("/sys/fs/cgroup/memory/memory.limit_in_bytes") or read("/sys/fs/cgroup/memory.max"),
    "memsw": read("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes"),
    "swapmax": read("/sys/fs/cgroup/memory.swap.max"),
    "pids": read("/sys/fs/cgroup/pids/pids.max") or read("/sys/fs/cgroup/pids.max"),
    "quota": read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") or read("/sys/fs/cgroup/cpu.max"),
}))
"""


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str


def _limit_checks(probe: dict, spec: SandboxSpec) -> list[Check]:
    lim = spec.limits
    mem = str(lim.memory_mb * 1024 * 1024)
    swap_off = probe["memsw"] == mem if probe["memsw"] is not None else probe["swapmax"] == "0"
    quota = str(probe["quota"] or "")
    rows = [
        ("non-root user", probe["uid"] != 0, f"uid {probe['uid']}"),
        ("no capabilities", int(probe["capeff"] or "1", 16) == 0, f"CapEff {probe['capeff']}"),
        ("no-new-privileges", probe["nnp"] == "1", f"NoNewPrivs {probe['nnp']}"),
        ("network off", probe["ifaces"] == ["lo"], f"interfaces {probe['ifaces']}"),
        ("read-only root", probe["root_ro"], "writing / fails" if probe["root_ro"] else
         "writing / succeeded"),
        ("writable work dir", probe["work_rw"], "tmpfs /work"),
        ("memory limit", probe["mem"] == mem, f"{probe['mem']} bytes (want {mem})"),
        ("swap off", swap_off, f"memory+swap {probe['memsw'] or probe['swapmax']}"),
        ("pids limit", probe["pids"] == str(lim.pids), f"{probe['pids']} (want {lim.pids})"),
        ("cpu quota", quota not in ("", "-1") and not quota.startswith("max"), quota),
    ]
    return [Check(name, "ok" if good else "fail", detail) for name, good, detail in rows]


async def run_doctor(spec: SandboxSpec | None = None) -> list[Check]:
    from sandboxes.docker_backend import DockerSandbox
    from sandboxes.engine import connect, docker_host
    from sandboxes.image import image_exists

    spec = spec or SandboxSpec()
    checks: list[Check] = []
    try:
        client = connect()
    except SandboxError as exc:
        return [Check("engine reachable", "fail", str(exc))]
    info = client.info()
    checks.append(Check("engine reachable", "ok",
                        f"{docker_host()} (Docker {info.get('ServerVersion')}, cgroup "
                        f"v{info.get('CgroupVersion', '1')})"))
    for warning in info.get("Warnings") or []:
        checks.append(Check("engine warning", "info", str(warning)))
    runtimes = sorted((info.get("Runtimes") or {}).keys())
    has_runsc = "runsc" in runtimes
    checks.append(Check("runtimes", "info", ", ".join(runtimes) + (
        "; gVisor runsc is registered (pass runtime='runsc' for a stronger boundary)"
        if has_runsc else "; gVisor runsc not registered (runc isolation only)")))
    if image_exists(client, spec.image) is None:
        checks.append(Check("image present", "fail",
                            f"{spec.image} missing: run `stalewise sandbox build-base`"))
        return checks
    checks.append(Check("image present", "ok", spec.image))
    try:
        async with DockerSandbox(spec, client=client, run_id="doctor") as sandbox:
            result = await sandbox.exec(["python3", "-c", PROBE], timeout=30)
            if not result.ok:
                raise SandboxError(f"probe failed: {result.stderr or result.error_message}")
            checks.extend(_limit_checks(json.loads(result.stdout), spec))
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                await sandbox.exec(["true"])
                times.append(time.perf_counter() - t0)
            checks.append(Check("exec round trip", "info",
                                f"p50 {statistics.median(times) * 1000:.1f} ms for `true`"))
    except SandboxError as exc:
        checks.append(Check("limits enforceable", "fail", str(exc)))
    return checks
