"""How many connections a job keeps to its engines, and the open files they need.

Contracts: a job opens one connection to each engine per trajectory in flight unless
`engine.max_connections` says otherwise, so with 300 trajectories in flight 300 model calls
reach the engine at once (a fixed 256 used to hold the rest in the client's queue); the job
raises its soft open-file limit to what those connections need, as far as the hard limit
allows, and says how to fix a hard limit below it.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

from config.job import parse_config
from config.errors import ConfigError
from core.engine_api import GenerateRequest, GenerateResult, SamplingParams, encode_generate_reply
from core.records import SampledTokens
from orchestrator.engines.fleet import EngineFleet
from orchestrator.job import open_files_needed

ROOT = Path(__file__).resolve().parents[3]
RESULT = GenerateResult(SampledTokens([5], [-0.5], [0], [0], [0.01]), "length", 1, 0,
                        "stalewise-x")


def test_a_job_keeps_one_connection_per_trajectory_in_flight_unless_told():
    job = parse_config({"rollout": {"max_concurrent": 1000}})
    assert job.engine.max_connections is None and job.engine_connections() == 1000
    job = parse_config({"rollout": {"max_concurrent": 1000}, "engine": {"max_connections": 64}})
    assert job.engine_connections() == 64
    with pytest.raises(ConfigError, match="max_connections"):
        parse_config({"engine": {"max_connections": 0}})


def test_the_open_files_a_job_needs_count_every_engines_connections():
    job = parse_config({"rollout": {"max_concurrent": 1000},
                        "engine": {"urls": [f"http://127.0.0.1:{9000 + i}" for i in range(4)]}})
    assert open_files_needed(job) == 4 * 1000 + 1000 + 256


class HoldingServer:
    """A loopback server for the generate route that holds every request until `expected`
    are open at once (or `hold_s` passes), then answers them all; `most` is the most open at
    once."""

    def __init__(self, expected: int, hold_s: float) -> None:
        self.expected, self.hold_s = expected, hold_s
        self.open = self.most = 0
        self.all_open = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                body = json.loads(await reader.readexactly(length))
                self.open += 1
                self.most = max(self.most, self.open)
                if self.open >= self.expected:
                    self.all_open.set()
                try:
                    await asyncio.wait_for(self.all_open.wait(), self.hold_s)
                except asyncio.TimeoutError:
                    pass
                self.open -= 1
                reply = json.dumps(encode_generate_reply(
                    RESULT, request_id=body["request_id"])).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(reply), reply))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def test_every_trajectory_in_flight_has_its_model_call_at_the_engine_at_once():
    """300 trajectories in flight, a job attached to one engine: all 300 calls are open at the
    engine together (with 256 connections, 44 waited in the client until others finished)."""
    in_flight = 300
    server = HoldingServer(in_flight, hold_s=10.0)

    async def main() -> list:
        listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{listening.sockets[0].getsockname()[1]}"
        job = parse_config({"rollout": {"max_concurrent": in_flight}, "engine": {"url": url}})
        fleet = EngineFleet.start(job, model_dir=Path("unused"), version=0,
                                  run_dir=Path("unused"), run_id="r")
        results = []
        try:
            async with fleet.client() as engine:
                async def one(i: int) -> None:
                    results.append(await engine.generate(GenerateRequest(
                        [1, i], SamplingParams(max_tokens=1), f"t{i}/0")))

                async with anyio.create_task_group() as tg:
                    for i in range(in_flight):
                        tg.start_soon(one, i)
        finally:
            listening.close()
        return results

    results = anyio.run(main)
    assert len(results) == in_flight and all(r.tokens == RESULT.tokens for r in results)
    assert server.most == in_flight


def limited(soft: int, hard: int, needed: int) -> dict:
    """`raise_open_files(needed)` in a child started with these limits; then the child opens
    `needed - 64` sockets, as many as the limit lets it."""
    script = textwrap.dedent(f"""
        import json, resource, socket
        resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))
        from core.open_files import raise_open_files
        files = raise_open_files({needed})
        held = []
        try:
            for _ in range({needed} - 64):
                held.append(socket.socket())
        except OSError:
            pass
        print(json.dumps(dict(soft=files.soft, hard=files.hard, enough=files.enough,
                              advice=files.advice(), opened=len(held))))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


def test_the_job_raises_its_open_file_limit_as_far_as_the_hard_limit_allows():
    raised = limited(soft=256, hard=4096, needed=2000)
    assert raised["soft"] == 2000 and raised["enough"] and raised["opened"] == 2000 - 64
    short = limited(soft=256, hard=1024, needed=2000)
    assert short["soft"] == 1024 and not short["enough"] and short["opened"] < 1024
    assert "ulimit -n 2000" in short["advice"] and "engine.max_connections" in short["advice"]
    assert "may open 1,024 (hard limit 1,024)" in short["advice"]
    kept = limited(soft=4096, hard=4096, needed=2000)  # never lowered
    assert kept["soft"] == 4096 and kept["enough"]
