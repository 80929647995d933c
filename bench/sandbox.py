"""Sandbox benchmark on the real Docker engine.

Prints: warm-pool acquire latency p50/p95; exec round trip p50/p95 for `true` and for a short
python command through the stalewise agent, side by side with the docker SDK's own exec path
(`exec_run`, create + start + inspect) on the same container; cold start time of one sandbox;
how long past a 1 s exec timeout the call returns (the process group killed);
and the wall time of N concurrent sandboxes each doing M execs, with the error count.

Targets on the 2-core reference machine: acquire p50 <= 10 ms, exec p50 <= 60 ms, zero errors.

    .venv/bin/python bench/sandbox.py [--sandboxes 64] [--execs 20] [--samples 100] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.sandbox import SandboxSpec  # noqa: E402
from sandboxes.cleanup import remove_all  # noqa: E402
from sandboxes.docker_backend import DockerSandbox  # noqa: E402
from sandboxes.engine import connect  # noqa: E402
from sandboxes.image import build_base  # noqa: E402
from sandboxes.pool import SandboxPool  # noqa: E402

PY_CMD = ["python3", "-c", "print(sum(range(10)))"]


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summary(name: str, samples_s: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in samples_s]
    row = {"p50_ms": pct(ms, 0.5), "p95_ms": pct(ms, 0.95), "n": len(ms)}
    print(f"{name:42s} p50 {row['p50_ms']:8.2f} ms   p95 {row['p95_ms']:8.2f} ms   (n={len(ms)})")
    return row


async def timed(fn: Callable[[], Awaitable[Any]], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t0)
    return out


async def bench_acquire(client: Any, run_id: str, samples: int) -> dict[str, float]:
    pool = SandboxPool(lambda: DockerSandbox(client=client, run_id=run_id), size=4, max_live=8)
    times = []
    async with pool:
        for _ in range(samples):
            await pool.wait_warm()
            t0 = time.perf_counter()
            async with pool.acquire(trajectory_id="bench"):
                times.append(time.perf_counter() - t0)
        cold = pool.stats["cold_starts"]
    row = summary("warm-pool acquire", times)
    row["cold_starts"] = cold
    return row


async def bench_exec(client: Any, run_id: str, samples: int) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    async with DockerSandbox(client=client, run_id=run_id) as sandbox:
        t0 = time.perf_counter()
        async with DockerSandbox(client=client, run_id=run_id):
            rows["cold_start_s"] = time.perf_counter() - t0
        print(f"{'cold start of one sandbox':42s} {rows['cold_start_s'] * 1000:8.1f} ms")
        container = client.containers.get(sandbox.container_id)
        for label, cmd in (("true", ["true"]), ("python", PY_CMD)):
            def sdk_exec(cmd: list[str] = cmd) -> Any:
                return container.exec_run(cmd, user="1000")

            for _ in range(5):  # warm up both paths
                await sandbox.exec(cmd)
                await anyio.to_thread.run_sync(sdk_exec)
            async def agent_exec(cmd: list[str] = cmd) -> Any:
                return await sandbox.exec(cmd)

            agent = await timed(agent_exec, samples)
            sdk = await timed(lambda: anyio.to_thread.run_sync(sdk_exec), max(10, samples // 4))
            rows[f"exec_{label}"] = summary(f"exec {label!r} (stalewise agent)", agent)
            rows[f"sdk_exec_{label}"] = summary(f"exec {label!r} (docker SDK exec_run)", sdk)
    return rows


async def bench_timeout_overshoot(client: Any, run_id: str, samples: int) -> dict[str, float]:
    """Seconds from the exec timeout to the call's return, with `sleep 1000` to kill."""
    overshoot = []
    async with DockerSandbox(client=client, run_id=run_id) as sandbox:
        for _ in range(samples):
            t0 = time.perf_counter()
            result = await sandbox.exec("sleep 1000 & sleep 1000", timeout=1)
            overshoot.append(time.perf_counter() - t0 - 1)
            assert result.timed_out, result
    return summary("exec return after a 1 s timeout, overshoot", overshoot)


async def bench_concurrent(client: Any, run_id: str, n: int, execs: int) -> dict[str, Any]:
    errors: list[str] = []
    exec_times: list[float] = []

    async def trajectory(pool: SandboxPool, i: int) -> None:
        async with pool.acquire(trajectory_id=f"c{i}") as sandbox:
            for j in range(execs):
                cmd = PY_CMD if j % 2 else ["true"]
                t0 = time.perf_counter()
                result = await sandbox.exec(cmd, timeout=60)
                exec_times.append(time.perf_counter() - t0)
                if not result.ok:
                    errors.append(f"{i}/{j}: {result.error_type} {result.stderr[:200]}")

    pool = SandboxPool(lambda: DockerSandbox(SandboxSpec(), client=client, run_id=run_id),
                       size=0, max_live=n, start_concurrency=8)
    t0 = time.perf_counter()
    async with pool:
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(trajectory, pool, i)
    wall = time.perf_counter() - t0
    print(f"{n} concurrent sandboxes x {execs} execs: {wall:.2f} s wall (including container "
          f"start and removal), {len(errors)} errors")
    row = summary(f"  exec under {n}-way concurrency", exec_times)
    for line in errors[:5]:
        print("  error:", line)
    return {"wall_s": wall, "errors": len(errors), "exec": row}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    client = connect()
    build_base(client=client, log=lambda line: print(line, file=sys.stderr))
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    try:
        results = {"acquire": await bench_acquire(client, run_id, args.samples)}
        results.update(await bench_exec(client, run_id, args.samples))
        results["timeout_overshoot"] = await bench_timeout_overshoot(client, run_id, 5)
        results["concurrent"] = await bench_concurrent(client, run_id, args.sandboxes,
                                                       args.execs)
    finally:
        remove_all(client, run_id=run_id)
    acquire_ok = results["acquire"]["p50_ms"] <= 10
    exec_ok = results["exec_true"]["p50_ms"] <= 60 and results["exec_python"]["p50_ms"] <= 60
    print(f"targets: acquire p50 <= 10 ms: {'met' if acquire_ok else 'MISSED'}; exec p50 <= 60 ms:"
          f" {'met' if exec_ok else 'MISSED'}; errors: {results['concurrent']['errors']}")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sandboxes", type=int, default=64)
    parser.add_argument("--execs", type=int, default=20)
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    arguments = parser.parse_args()
    out = anyio.run(main, arguments)
    if arguments.json:
        arguments.json.write_text(json.dumps(out, indent=2))
    sys.exit(1 if out["concurrent"]["errors"] else 0)
