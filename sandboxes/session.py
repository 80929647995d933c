"""What both backends share: the `Sandbox` operations expressed as agent requests.

`AgentSession` turns `exec`, file and reset calls into agent requests and replies into
`ExecResult`s. Guarantees:
- `exec` is sent exactly once and never retried; its failures are data on the result
  (`timeout`, `oom`, `exec_failed`, `container_died`) with a message in `error_message`;
- the command sees only the environment built here (PATH, HOME, LANG, plus what the caller
  passes), never the orchestrator's;
- if the agent does not answer within the exec timeout plus `REPLY_SLACK_S`, the sandbox is
  declared gone and the exec returns `container_died`, so a wedged sandbox cannot hang a caller;
- once the sandbox is gone, every further call raises `SandboxError` (no silent reuse).
"""

from __future__ import annotations

import base64
import io
import math
import os
import tarfile
import time
from typing import Callable, Mapping

import anyio

from core.sandbox import ExecResult, SandboxError, SandboxSpec
from sandboxes.channel import AgentChannel, AgentGone, AgentRequestError

REPLY_SLACK_S = 15.0
MAX_TRANSFER_BYTES = 128 * 1024 * 1024
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _identity(path: str) -> str:
    return path


def _b64(data: bytes | str) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def tar_directory(local_dir: str) -> bytes:
    """An uncompressed tar of `local_dir`'s contents; `SandboxError` when it is too large."""
    if not os.path.isdir(local_dir):
        raise SandboxError(f"put_dir: {local_dir} is not a directory")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in sorted(os.listdir(local_dir)):
            tar.add(os.path.join(local_dir, name), arcname=name)
            if buffer.tell() > MAX_TRANSFER_BYTES:
                raise SandboxError(f"put_dir: {local_dir} is larger than "
                                   f"{MAX_TRANSFER_BYTES >> 20} MiB; bake it into the image")
    return buffer.getvalue()


class AgentSession:
    def __init__(self, channel: AgentChannel, spec: SandboxSpec, *,
                 shell: tuple[str, ...] = ("bash", "-c"),
                 rlimits: Mapping[str, int] | None = None,
                 remap: Callable[[str], str] = _identity,
                 home: str | None = None,
                 scratch_dirs: tuple[str, ...] | None = None) -> None:
        self.channel = channel
        self.spec = spec
        self.shell = shell
        self.rlimits = dict(rlimits or {})
        self.remap = remap
        self.base_env = {"PATH": DEFAULT_PATH, "HOME": home or spec.workdir, "LANG": "C.UTF-8"}
        # emptied by reset(); paths as the agent sees them (already remapped)
        self.scratch_dirs = scratch_dirs if scratch_dirs is not None else (
            spec.workdir, "/tmp", *spec.scratch_dirs)

    def _check_alive(self) -> None:
        if self.channel.gone is not None:
            raise SandboxError(f"sandbox is gone: {self.channel.gone}")

    async def exec(self, cmd: str | list[str], *, timeout: float | None = None,
                   stdin: bytes | None = None, env: Mapping[str, str] | None = None,
                   workdir: str | None = None) -> ExecResult:
        self._check_alive()
        argv = [*self.shell, cmd] if isinstance(cmd, str) else [str(a) for a in cmd]
        if not argv or not argv[0]:
            raise ValueError("exec: empty command")
        timeout_s = self.spec.limits.exec_timeout_s if timeout is None else float(timeout)
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"exec: timeout must be a positive number of seconds, got {timeout}")
        request = {
            "argv": argv,
            "env": {**self.base_env, **(env or {})},
            "cwd": self.remap(workdir) if workdir else None,
            "timeout": timeout_s,
            "stdin": _b64(stdin) if stdin else None,
            "cap": self.spec.limits.output_bytes,
            "rlimits": self.rlimits,
        }
        started = time.monotonic()
        reply = None
        with anyio.move_on_after(timeout_s + REPLY_SLACK_S):
            try:
                reply = await self.channel.request("exec", **request)
            except AgentGone as exc:
                return self._failed("container_died", str(exc), started)
            except AgentRequestError as exc:
                return self._failed("exec_failed", str(exc), started)
        if reply is None:
            message = (f"the sandbox agent did not answer within {timeout_s + REPLY_SLACK_S:.0f}"
                       " s; the sandbox is marked unusable")
            self.channel.close(message)
            return self._failed("container_died", message, started)
        return self._result(reply, started)

    @staticmethod
    def _failed(error_type: str, message: str, started: float) -> ExecResult:
        return ExecResult(exit_code=None, stdout="", stderr=message,
                          duration_s=time.monotonic() - started, error_type=error_type,  # type: ignore[arg-type]
                          error_message=message)

    @staticmethod
    def _result(reply: dict, started: float) -> ExecResult:
        error_type = None
        message = ""
        if reply["timed_out"]:
            error_type, message = "timeout", "the command ran past its timeout and was killed"
        elif reply["oom_killed"]:
            error_type, message = "oom", "the command was killed for exceeding the memory limit"
        return ExecResult(
            exit_code=reply["exit_code"],
            stdout=base64.b64decode(reply["stdout"]).decode("utf-8", errors="replace"),
            stderr=base64.b64decode(reply["stderr"]).decode("utf-8", errors="replace"),
            duration_s=time.monotonic() - started,
            timed_out=bool(reply["timed_out"]),
            oom_killed=bool(reply["oom_killed"]),
            truncated=bool(reply["truncated"]),
            stdout_bytes=int(reply["stdout_bytes"]),
            stderr_bytes=int(reply["stderr_bytes"]),
            stdout_sha256=str(reply["stdout_sha256"]),
            stderr_sha256=str(reply["stderr_sha256"]),
            error_type=error_type,  # type: ignore[arg-type]
            error_message=message,
        )

    async def read_file(self, path: str, *, max_bytes: int = 64 * 1024 * 1024) -> bytes:
        self._check_alive()
        reply = await self.channel.request("read_file", path=self.remap(path), max_bytes=max_bytes)
        return base64.b64decode(reply["data"])

    async def write_file(self, path: str, data: bytes | str, *, mode: int | None = None) -> None:
        self._check_alive()
        size = len(data.encode() if isinstance(data, str) else data)
        if size > MAX_TRANSFER_BYTES:
            raise SandboxError(f"write_file: {size} bytes is over the {MAX_TRANSFER_BYTES >> 20}"
                               " MiB transfer limit; bake large files into the image")
        await self.channel.request("write_file", path=self.remap(path), data=_b64(data),
                                   mode=mode)

    async def put_dir(self, local_dir: str, dest: str) -> None:
        self._check_alive()
        archive = await anyio.to_thread.run_sync(tar_directory, local_dir)
        await self.channel.request("put_tar", dest=self.remap(dest), data=_b64(archive))

    async def put_files(self, files: Mapping[str, str]) -> None:
        for path, text in files.items():
            target = path if path.startswith("/") else f"{self.spec.workdir}/{path}"
            await self.write_file(target, text)

    async def reset(self) -> None:
        """Kill every process the sandbox's commands started and restore the spec's files."""
        self._check_alive()
        await self.channel.request("reset", paths=list(self.scratch_dirs))
        await self.put_files(self.spec.files)


class SessionSandbox:
    """The `Sandbox` operations of a backend whose sandbox talks to an agent over a session
    (Docker and local backends share them); subclasses set `_session` when started."""

    _session: AgentSession | None = None

    @property
    def session(self) -> AgentSession:
        if self._session is None:
            raise SandboxError("sandbox not started: call `await sandbox.start()` or use "
                               "`async with`")
        return self._session

    async def exec(self, cmd: str | list[str], *, timeout: float | None = None,
                   stdin: bytes | None = None, env: Mapping[str, str] | None = None,
                   workdir: str | None = None) -> ExecResult:
        return await self.session.exec(cmd, timeout=timeout, stdin=stdin, env=env,
                                       workdir=workdir)

    async def read_file(self, path: str) -> bytes:
        return await self.session.read_file(path)

    async def write_file(self, path: str, data: bytes | str) -> None:
        await self.session.write_file(path, data)

    async def put_dir(self, local_dir: str, dest: str) -> None:
        await self.session.put_dir(local_dir, dest)

    async def reset(self) -> None:
        await self.session.reset()
