"""Which Docker engines run sandboxes: `[sandbox] hosts`, validated.

A host is a Docker engine address and how many sandboxes it may run at once:

    [sandbox]
    hosts = [
      { url = "unix:///var/run/docker.sock", capacity = 16 },
      { url = "tcp://10.0.0.5:2375", capacity = 64 },
      "ssh://user@gpu-box",                      # a bare URL: no per-host cap
    ]

No hosts (the default) means the one engine at $DOCKER_HOST, or the local socket: the
behaviour of a single-machine job. Addresses are `unix://PATH`, `tcp://HOST:PORT` (plain HTTP;
put TLS engines behind ssh) and `ssh://[USER@]HOST[:PORT][/remote/socket]` (the remote socket
forwarded to a local one by `ssh -N -L`, `sandboxes.hosts.SshForward`).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SCHEMES = ("unix", "tcp", "ssh")


class DockerHostConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    url: str = Field(description="unix:///path/docker.sock, tcp://HOST:PORT or ssh://USER@HOST")
    capacity: int | None = Field(None, ge=1, description="sandboxes alive on this host at most "
                                                        "(all task specs together); none: no cap")

    @model_validator(mode="before")
    @classmethod
    def _bare_url(cls, data: Any) -> Any:
        return {"url": data} if isinstance(data, str) else data

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, value: str) -> str:
        value = value.strip()
        url = urlparse(value)
        if url.scheme not in SCHEMES:
            raise ValueError(f"Docker host {value!r}: use unix:///path/to/docker.sock, "
                             "tcp://HOST:PORT or ssh://USER@HOST")
        if url.scheme == "unix" and not url.path:
            raise ValueError(f"Docker host {value!r}: a unix socket needs a path, e.g. "
                             "unix:///var/run/docker.sock")
        if url.scheme in ("tcp", "ssh") and not url.hostname:
            raise ValueError(f"Docker host {value!r}: name the machine, e.g. "
                             f"{url.scheme}://10.0.0.5" + (":2375" if url.scheme == "tcp" else ""))
        return value


def check_distinct(hosts: list[DockerHostConfig]) -> list[DockerHostConfig]:
    """The hosts, refusing one address listed twice (its capacity would be counted twice)."""
    seen: set[str] = set()
    for host in hosts:
        if host.url in seen:
            raise ValueError(f"Docker host {host.url!r} is listed twice in sandbox.hosts; list "
                             "each engine once and give it the summed capacity")
        seen.add(host.url)
    return hosts
