"""The local process backend: the same `Sandbox` API without containers. NOT ISOLATION.

For machines where no Docker engine can run. Commands run as this user on this host, in a
private temporary directory that stands in for the work dir, driven by the same agent as the
Docker backend, so process groups, timeouts (the whole group and its descendants are killed)
and output caps behave identically. Each command also gets rlimits: address space (the memory
limit), file size, open files, CPU seconds (the TTL) and no core files.

What it does not do: it cannot stop network access, reading the host's files, or a process
count explosion (RLIMIT_NPROC counts every process of the user, so it is not set); paths under
the spec's work dir and /tmp are mapped to private directories for the sandbox API calls only,
not inside command strings; OOM is reported as the command's own failure (a MemoryError or
ENOMEM), not as `oom`. Every start logs a warning saying so.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import anyio
import anyio.abc

from core.sandbox import SandboxError, SandboxSpec
from sandboxes.channel import AgentChannel, AgentGone
from sandboxes.session import AgentSession, SessionSandbox

log = logging.getLogger("stalewise.sandboxes")
AGENT_PATH = Path(__file__).parent / "agent.py"
WARNING = ("local sandbox backend: commands run directly on this host as this user; this is "
           "NOT isolation (no network, filesystem or process-count containment)")


class ProcessTransport:
    def __init__(self, process: anyio.abc.Process) -> None:
        assert process.stdin is not None and process.stdout is not None
        self._stdin = process.stdin
        self._stdout = process.stdout

    async def send(self, data: bytes) -> None:
        await self._stdin.send(data)

    async def receive(self) -> bytes:
        return await self._stdout.receive(1 << 20)

    async def aclose(self) -> None:
        await self._stdin.aclose()


class LocalSandbox(SessionSandbox):
    """A `Sandbox` as a local agent process in a temp directory (see the module docstring)."""

    def __init__(self, spec: SandboxSpec | None = None, *, root: str | None = None,
                 shell: tuple[str, ...] = ("bash", "-c")) -> None:
        self.spec = spec or SandboxSpec()
        self.shell = shell
        self._root_arg = root
        self.root: Path | None = None
        self._process: anyio.abc.Process | None = None
        self._session: AgentSession | None = None
        self._closed = False

    def remap(self, path: str) -> str:
        """Map sandbox paths (the spec's work dir, /tmp) into this sandbox's private dirs."""
        assert self.root is not None
        for prefix, local in ((self.spec.workdir, self.root / "work"), ("/tmp", self.root / "tmp")):
            if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
                return str(local) + path[len(prefix.rstrip("/")):]
        return path

    def _rlimits(self) -> dict[str, int]:
        lim = self.spec.limits
        return {"AS": lim.memory_mb * 1024 * 1024, "FSIZE": lim.fsize_mb * 1024 * 1024,
                "NOFILE": lim.nofile, "CPU": int(lim.ttl_s) + 1, "CORE": 0}

    async def start(self) -> None:
        if self._session is not None or self._closed:
            raise SandboxError("LocalSandbox.start() called twice; create a new sandbox instead")
        if self.spec.scratch_dirs or self.spec.build is not None:
            raise SandboxError("this task needs an image built from a Dockerfile or scratch dirs "
                               f"({', '.join(self.spec.scratch_dirs) or 'none'}), which only the "
                               "Docker backend provides: set [sandbox] backend = \"docker\"")
        log.warning(WARNING)
        self.root = Path(tempfile.mkdtemp(prefix="stalewise-local-", dir=self._root_arg))
        work, tmp = self.root / "work", self.root / "tmp"
        work.mkdir()
        tmp.mkdir()
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
        with open(self.root / "agent.log", "ab") as agent_log:
            self._process = await anyio.open_process(
                [sys.executable, "-I", str(AGENT_PATH), str(work)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=agent_log, cwd=str(work), env=env,
                start_new_session=True)
        channel = AgentChannel(ProcessTransport(self._process), self._why_gone)
        session = AgentSession(channel, self.spec, shell=self.shell, rlimits=self._rlimits(),
                               remap=self.remap, home=str(work),
                               scratch_dirs=(str(work), str(tmp)))
        try:
            await channel.request("hello", workdir=str(work), container=False,
                                  ttl_s=self.spec.limits.ttl_s)
            self._session = session
            await session.put_files(self.spec.files)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.close()
            raise
        session.base_env["TMPDIR"] = str(tmp)

    def _why_gone(self) -> str:
        code = self._process.returncode if self._process is not None else None
        tail = ""
        if self.root is not None and (self.root / "agent.log").exists():
            tail = (self.root / "agent.log").read_text(errors="replace")[-2000:].strip()
        return f"local sandbox agent exited (code {code})" + (f": {tail}" if tail else "")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self._session is not None:
                self._session.channel.close("local sandbox was closed")
            if self._process is not None:
                if self._process.stdin is not None:
                    await self._process.stdin.aclose()  # EOF: the agent kills its commands
                with anyio.move_on_after(5):
                    await self._process.wait()
                if self._process.returncode is None:
                    self._process.kill()
                    await self._process.wait()
                await self._process.aclose()
            if self.root is not None:
                await anyio.to_thread.run_sync(shutil.rmtree, self.root, True)

    async def __aenter__(self) -> "LocalSandbox":
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()



__all__ = ["LocalSandbox", "AgentGone", "WARNING"]
