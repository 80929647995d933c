"""The sandbox boundary: what an agent's tools may do to the world, and what they get back.

`Sandbox` is the async Protocol every backend satisfies (Docker, the local process backend, test
fakes). `ExecResult` is frozen data: failures (timeouts, OOM kills, a container that died) are
fields on the result with an `error_type`, not exceptions, except for infrastructure failures
that make the sandbox unusable, which raise `SandboxError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Capped output is not an error: the command ran; `truncated` and the byte counts say so.
ExecErrorType = Literal["timeout", "oom", "container_died", "exec_failed"]


class SandboxError(Exception):
    """The sandbox itself failed (engine unreachable, container gone): an infrastructure error."""


class HostUnreachable(SandboxError):
    """A Docker engine did not answer (connection refused, socket gone, ssh failed)."""


@dataclass(frozen=True)
class ExecResult:
    exit_code: int | None
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool = False
    oom_killed: bool = False
    truncated: bool = False
    stdout_bytes: int = 0  # original size before capping
    stderr_bytes: int = 0
    stdout_sha256: str = ""
    stderr_sha256: str = ""
    error_type: ExecErrorType | None = None
    error_message: str = ""  # what went wrong, for error_type other than None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.error_type is None


class SandboxLimits(BaseModel):
    """Resource limits of one sandbox; every field can be overridden per task."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    memory_mb: int = Field(512, ge=16, description="memory limit in MiB (swap off)")
    cpus: float = Field(1.0, gt=0, le=64, description="CPU quota in cores")
    pids: int = Field(128, ge=8, description="max processes/threads in the container")
    workdir_mb: int = Field(256, ge=1, description="size of the tmpfs work dir /work")
    tmp_mb: int = Field(64, ge=1, description="size of the tmpfs /tmp")
    nofile: int = Field(1024, ge=16, description="open files per process (ulimit -n)")
    fsize_mb: int = Field(128, ge=1, description="largest file a process may write (ulimit -f)")
    output_bytes: int = Field(65536, ge=1024, description="stdout/stderr kept per exec (head+tail)")
    exec_timeout_s: float = Field(60.0, gt=0, description="default timeout of one exec")
    ttl_s: float = Field(3600.0, gt=0, description="hard lifetime of the container (kill switch)")
    network: bool = Field(False, description="allow network access (off by default)")


class ImageBuild(BaseModel):
    """How to build `SandboxSpec.image` when the engine does not have it: a Dockerfile folder.

    `base_image_map` replaces `FROM` images (a public name -> a local image, for machines
    without a registry); `seed_from` is a directory of the built image whose contents become
    the work dir's starting files (copied to the seed directory in an extra build step)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    context: str = Field(description="folder with a Dockerfile (absolute path)")
    base_image_map: Mapping[str, str] = Field(default_factory=dict)
    seed_from: str | None = Field(None, description="image directory copied into the work dir")
    timeout_s: float = Field(600.0, gt=0, description="build time limit")
    map_setting: str = Field("base_image_map", description="named in the missing-image error")


class SandboxSpec(BaseModel):
    """What to start: an image and its limits, plus files to place in the work dir."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    image: str = Field("stalewise-base:latest", description="local Docker image name")
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    files: Mapping[str, str] = Field(default_factory=dict, description="path -> text, put in /work")
    workdir: str = "/work"
    build: ImageBuild | None = Field(None, description="build `image` from this when missing")
    scratch_dirs: tuple[str, ...] = Field(
        (), description="extra empty writable directories (tmpfs, Docker only), e.g. /logs")

    @field_validator("scratch_dirs")
    @classmethod
    def _absolute_scratch(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for path in value:
            if not path.startswith("/") or path.rstrip("/") in ("", "/tmp"):
                raise ValueError(f"scratch dir {path!r} must be an absolute path other than / "
                                 "and /tmp, e.g. /logs")
        return tuple(p.rstrip("/") for p in value)

    @field_validator("workdir")
    @classmethod
    def _absolute_workdir(cls, value: str) -> str:
        if not value.startswith("/") or value.rstrip("/") == "" or value.rstrip("/") == "/tmp":
            raise ValueError(f"workdir {value!r} must be an absolute path other than / and /tmp, "
                             "e.g. /work")
        return value.rstrip("/")


class Sandbox(Protocol):
    async def start(self) -> None: ...

    async def exec(
        self,
        cmd: str | list[str],
        *,
        timeout: float | None = None,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
    ) -> ExecResult: ...

    async def read_file(self, path: str) -> bytes: ...

    async def write_file(self, path: str, data: bytes | str) -> None: ...

    async def put_dir(self, local_dir: str, dest: str) -> None: ...

    async def close(self) -> None: ...
