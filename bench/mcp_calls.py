"""MCP tool-call latency: one `tools/call` through stalewise's client, in the sandbox and on
the host (trusted), against the test server written with the official SDK.

In the sandbox every call is one `sandbox.exec` of a small python3 client that talks to the
server over named pipes; on the host it is a line on the child's stdin. Prints, per mode, the
first call (server start + initialize + call) and the median and p90 of the next N calls:

    .venv/bin/python bench/mcp_calls.py [--calls 30]

Needs Docker, stalewise-base and var/mcp-sdk (scripts/ensure_mcp_sdk.sh); the image with the
SDK and the server is built once (the same one tests/tasks/test_mcp_docker.py uses).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.sandbox import ImageBuild, SandboxSpec  # noqa: E402
from sandboxes.docker_backend import DockerSandbox  # noqa: E402
from sandboxes.engine import connect  # noqa: E402
from sandboxes.image import ensure_image, image_exists  # noqa: E402
from tasks.mcp import Connection, McpServerConfig  # noqa: E402
from tasks.mcp import connect as mcp_connect
from tasks.testing import FakeSandbox  # noqa: E402

SERVER = ROOT / "tests" / "tasks" / "mcp_servers" / "notes_server.py"


def image() -> str:
    subprocess.run(["bash", str(ROOT / "scripts" / "ensure_mcp_sdk.sh"), sys.executable],
                   check=True, cwd=ROOT)
    digest = hashlib.sha256(SERVER.read_bytes() + b"mcp==2.3.0").hexdigest()[:16]
    tag = f"stalewise-test-mcp:{digest}"
    client = connect()
    if image_exists(client, tag) is None:
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copytree(ROOT / "var" / "mcp-sdk", Path(tmp) / "mcp-sdk")
            shutil.copy(SERVER, Path(tmp) / "notes_server.py")
            (Path(tmp) / "Dockerfile").write_text(
                "FROM stalewise-base\nCOPY mcp-sdk /opt/mcp-sdk\n"
                "COPY notes_server.py /opt/notes_server.py\n")
            ensure_image(tag, ImageBuild(context=tmp), client=client)
    client.close()
    return tag


async def timed_calls(connection: Connection, calls: int) -> tuple[float, list[float]]:
    times = []
    for index in range(calls + 1):
        t0 = time.perf_counter()
        await connection.request("tools/call", {"name": "add_note", "arguments": {
            "text": str(index)}}, 60)
        times.append(time.perf_counter() - t0)
    await connection.aclose()
    return times[0], times[1:]


def report(mode: str, first: float, rest: list[float]) -> None:
    rest = sorted(rest)
    p90 = rest[int(0.9 * (len(rest) - 1))]
    median = statistics.median(rest)
    print(f"{mode:<10} first call {first * 1000:7.0f} ms   then median {median * 1000:6.1f} ms, "
          f"p90 {p90 * 1000:6.1f} ms  ({len(rest)} calls)")


async def main(calls: int) -> None:
    host = McpServerConfig(command=[sys.executable, str(SERVER)], trusted=True, name="notes")
    report("host", *await timed_calls(mcp_connect(host, FakeSandbox()), calls))
    inside = McpServerConfig(command=["python3", "/opt/notes_server.py"], name="notes",
                             env={"PYTHONPATH": "/opt/mcp-sdk"})
    async with DockerSandbox(SandboxSpec(image=image()), run_id="bench-mcp") as sandbox:
        report("sandbox", *await timed_calls(mcp_connect(inside, sandbox), calls))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=30)
    anyio.run(main, parser.parse_args().calls)
