"""A small in-memory `Sandbox` for unit tests of tasks, tools and the agent loop.

`FakeSandbox` keeps files in a dict and answers `exec` with a handler you pass (a function of
the argv and stdin returning an `ExecResult`, or a string taken as stdout with exit code 0); it
records every exec. It can be told to fail (`fail_with`) to test infrastructure-error paths.
It runs nothing: use a real backend (Docker or local) to test what commands do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from core.sandbox import ExecResult, SandboxError

Handler = Callable[[list[str], bytes | None], "ExecResult | str"]


def _no_commands(argv: list[str], stdin: bytes | None) -> ExecResult:
    return ExecResult(exit_code=127, stdout="", stderr=f"{argv[0]}: not available in FakeSandbox",
                      duration_s=0.0)


@dataclass
class FakeSandbox:
    handler: Handler = _no_commands
    files: dict[str, bytes] = field(default_factory=dict)
    fail_with: SandboxError | None = None  # raised by every call while set
    execs: list[list[str]] = field(default_factory=list)
    started: bool = False
    closed: bool = False

    async def start(self) -> None:
        self._check()
        self.started = True

    async def exec(self, cmd: str | list[str], *, timeout: float | None = None,
                   stdin: bytes | None = None, env: Mapping[str, str] | None = None,
                   workdir: str | None = None) -> ExecResult:
        self._check()
        argv = ["bash", "-c", cmd] if isinstance(cmd, str) else [str(a) for a in cmd]
        self.execs.append(argv)
        result = self.handler(argv, stdin)
        if isinstance(result, str):
            return ExecResult(exit_code=0, stdout=result, stderr="", duration_s=0.0)
        return result

    async def read_file(self, path: str) -> bytes:
        self._check()
        if path not in self.files:
            raise SandboxError(f"FakeSandbox: no file {path}")
        return self.files[path]

    async def write_file(self, path: str, data: bytes | str) -> None:
        self._check()
        self.files[path] = data.encode() if isinstance(data, str) else data

    async def put_dir(self, local_dir: str, dest: str) -> None:
        raise SandboxError("FakeSandbox.put_dir is not supported")

    async def close(self) -> None:
        self.closed = True

    def _check(self) -> None:
        if self.fail_with is not None:
            raise self.fail_with
