"""The Docker backend: one hardened container per sandbox, driven through an in-container agent.

Lifecycle: `start()` builds the spec's image first when it has an `ImageBuild` and the engine
lacks the image, creates the container (configuration in `sandboxes.hardening`), attaches
to its stdin/stdout, starts it, sends the agent source, and waits for the agent's hello;
`close()` kills the container, which the engine then removes (auto-remove). Blocking docker SDK
calls run in worker threads (`anyio.to_thread`); exec round trips go over the async attach
stream and never touch a thread.

With a `HostSet` (several engines, `sandboxes.hosts`) `start()` first takes a slot on the
least-loaded reachable host (waiting while all are full), connects to it, and makes the spec's
image present there; the slot is given back when the sandbox closes or fails to start. An
engine that stops answering raises `HostUnreachable` and is marked down in the set.

Guarantees: a sandbox that fails to start leaves no container behind and raises `SandboxError`
with the engine's or the agent's words; `close()` is idempotent and safe after the container
died; a started container dies on its own when this process dies (its agent exits on stdin EOF)
and in any case at its hard TTL; one created but not yet attached when this process died never
starts, and orphan cleanup removes it.
"""

from __future__ import annotations

import functools
import re
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from core.sandbox import HostUnreachable, SandboxError, SandboxSpec
from sandboxes import labels as lab
from sandboxes.attach import AttachTransport, open_attach
from sandboxes.channel import AgentChannel, AgentGone, AgentRequestError
from sandboxes.engine import connect, docker_errors, docker_host
from sandboxes.hardening import container_config
from sandboxes.hosts import DockerHost, HostSet
from sandboxes.image import ensure_image
from sandboxes.session import AgentSession, SessionSandbox

if TYPE_CHECKING:
    import docker

AGENT_SOURCE = (Path(__file__).parent / "agent.py").read_bytes()
_NAME_SAFE = re.compile(r"[^a-zA-Z0-9_.-]+")


def container_name(run_id: str, trajectory_id: str | None) -> str:
    """A readable, unique container name: sw-<run>-<trajectory or 'pool'>-<random>."""
    middle = _NAME_SAFE.sub("_", f"{run_id}-{trajectory_id or 'pool'}")[:100]
    return f"sw-{middle}-{secrets.token_hex(3)}"


class DockerSandbox(SessionSandbox):
    """A `Sandbox` in a fresh hardened container. Use `async with` or `start()`/`close()`."""

    def __init__(self, spec: SandboxSpec | None = None, *,
                 client: "docker.DockerClient | None" = None,
                 run_id: str = "adhoc", trajectory_id: str | None = None,
                 runtime: str | None = None, start_timeout_s: float = 60.0,
                 shell: tuple[str, ...] = ("bash", "-c"), hosts: HostSet | None = None) -> None:
        self.spec = spec or SandboxSpec()
        self.run_id = run_id
        self.trajectory_id = trajectory_id
        self.runtime = runtime
        self.start_timeout_s = start_timeout_s
        self.shell = shell
        self.container_id: str | None = None
        self.name: str | None = None
        self._client = client
        self._hosts = hosts
        self.host: DockerHost | None = None  # the engine it runs on, with a HostSet
        self._holds_slot = False
        self._host_epoch = 0  # the host's `went_down` count when this sandbox was placed
        self._transport: AttachTransport | None = None
        self._session: AgentSession | None = None
        self._closed = False
        self.started_ahead = False  # set by a pool: no trajectory waits for it (HostSet.reserve)

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        if self._session is not None or self._closed:
            raise SandboxError("DockerSandbox.start() called twice; create a new sandbox instead")
        if self._hosts is not None:
            await self._place(self._hosts)
        try:
            with anyio.fail_after(self.start_timeout_s):
                await self._start()
        except HostUnreachable as exc:
            self._host_failed(exc)
            with anyio.CancelScope(shield=True):
                await self._discard(quiet=True)
            raise
        except TimeoutError:
            await self._discard(quiet=True)
            raise SandboxError(f"sandbox did not start within {self.start_timeout_s:.0f} s "
                               f"({self._agent_stderr() or 'no agent output'})") from None
        except (OSError, anyio.BrokenResourceError, docker_errors().DockerException) as exc:
            # an engine call outside `_engine` (an image check, the attach) lost its engine:
            # the same infrastructure error as a failed create, never a crash of the job
            lost = HostUnreachable(f"Docker engine {self.host_url} unreachable while starting "
                                   f"{self.name or 'a sandbox'}: {exc}")
            self._host_failed(lost)
            with anyio.CancelScope(shield=True):
                await self._discard(quiet=True)
            raise lost from None
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._discard(quiet=True)
            raise

    async def _place(self, hosts: HostSet) -> None:
        """Take a slot on a reachable host (may wait for room); `_discard` gives it back."""
        host = await hosts.reserve(ahead=self.started_ahead)
        self.host, self._holds_slot, self._client = host, True, host.client
        self._host_epoch = host.stats["went_down"]

    def _host_failed(self, exc: BaseException) -> None:
        if self._hosts is not None and self.host is not None and not self.host.down:
            self._hosts.mark_down(self.host, exc)

    @property
    def host_url(self) -> str:
        return self.host.api_url if self.host is not None else docker_host()

    @property
    def usable(self) -> bool:
        """False once its agent is gone or its host went down since it started (a pool then
        drops it, even when the host has come back: the container went with the engine)."""
        gone = self._session is None or self._session.channel.gone is not None
        host_lost = self.host is not None and (
            self.host.down or self.host.stats["went_down"] != self._host_epoch)
        return not (self._closed or gone or host_lost)

    async def _start(self) -> None:
        if self._client is None:
            self._client = await anyio.to_thread.run_sync(connect)
        client: "docker.DockerClient" = self._client
        if self._hosts is not None and self.host is not None:
            await self._hosts.ensure_image(self.host, self.spec)
        if self.spec.build is not None:
            await anyio.to_thread.run_sync(
                functools.partial(ensure_image, self.spec.image, self.spec.build, client=client))
        labels = lab.container_labels(run_id=self.run_id, trajectory_id=self.trajectory_id,
                                      ttl_s=self.spec.limits.ttl_s)
        self.name = container_name(self.run_id, self.trajectory_id)
        kwargs = container_config(client.api, self.spec, labels=labels, name=self.name,
                                  runtime=self.runtime)
        self.container_id = await self._engine("create", client.api.create_container, **kwargs)
        self._transport = await open_attach(self.host_url, client.api.api_version,
                                            self.container_id)
        channel = AgentChannel(self._transport, self._why_gone)
        await self._engine("start", client.api.start, self.container_id)
        try:
            await channel.send_raw(b"%010d" % len(AGENT_SOURCE) + AGENT_SOURCE)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            # the container or its engine went away between start and the agent's upload
            raise SandboxError(f"could not send the sandbox agent: {self._why_gone()} "
                               f"({exc!r})") from None
        session = AgentSession(channel, self.spec, shell=self.shell)
        try:
            hello = await channel.request("hello", workdir=self.spec.workdir, container=True,
                                          ttl_s=self.spec.limits.ttl_s)
        except AgentGone as exc:
            raise SandboxError(f"the sandbox agent did not start in image {self.spec.image} "
                               f"(does it have python3 >= 3.8 and coreutils `timeout`?): "
                               f"{exc}") from None
        if int(hello["uid"]) == 0:
            raise SandboxError("the sandbox agent runs as root; refusing (check the image)")
        self._session = session
        await session.put_files(self.spec.files)

    async def _engine(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        import docker.errors

        def call() -> Any:
            return fn(*args, **kwargs)

        try:
            result = await anyio.to_thread.run_sync(call)
        except docker.errors.ImageNotFound as exc:
            hint = (" (run `stalewise sandbox build-base`)" if self.spec.image.startswith(
                "stalewise-base") else " (build it first; task images are FROM stalewise-base)")
            raise SandboxError(f"image {self.spec.image} not found{hint}: {exc}") from None
        except docker.errors.APIError as exc:
            raise SandboxError(f"docker {what} failed for {self.name}: {exc}") from None
        except OSError as exc:
            raise HostUnreachable(f"Docker engine {self.host_url} unreachable during {what}: "
                                  f"{exc}") from None
        if what == "create":
            return str(result["Id"])
        return result

    def _agent_stderr(self) -> str:
        if self._transport is None:
            return ""
        return bytes(self._transport.stderr_tail[-2000:]).decode(errors="replace").strip()

    def _why_gone(self) -> str:
        tail = self._agent_stderr()
        host = f" on Docker host {self.host.url}" if self.host is not None else ""
        return (f"container {self.name}{host} stopped (killed, out of memory, TTL reached, its "
                f"agent exited, or its engine went away)" + (f"; agent said: {tail}" if tail
                                                             else ""))

    async def _discard(self, *, quiet: bool = False) -> None:
        """Drop the attach stream and the container, and give the host slot back. `quiet`: an
        engine that went away is only recorded (the start's own error is the one to raise)."""
        try:
            if self._transport is not None:
                await self._transport.aclose()
            if self.container_id is not None and self._client is not None:
                await anyio.to_thread.run_sync(_remove_quietly, self._client, self.container_id)
        except HostUnreachable as exc:
            self._host_failed(exc)
            if not quiet:
                raise
        finally:
            if self._holds_slot and self.host is not None and self._hosts is not None:
                self._holds_slot = False
                self._hosts.release(self.host)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._session is not None:
            self._session.channel.close(f"container {self.name} was closed")
        with anyio.CancelScope(shield=True):
            await self._discard()

    async def __aenter__(self) -> "DockerSandbox":
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def assign(self, trajectory_id: str) -> None:
        """Record the trajectory a pooled container now serves (renames the container)."""
        self.trajectory_id = trajectory_id
        if self._client is None or self.container_id is None:
            return
        new_name = container_name(self.run_id, trajectory_id)
        try:
            await self._engine("rename", self._client.api.rename, self.container_id, new_name)
            self.name = new_name
        except SandboxError:
            pass  # the container may be gone already; the name is a convenience, not a guarantee

    # ---- Sandbox operations ------------------------------------------------------------------


def _remove_quietly(client: "docker.DockerClient", container_id: str) -> None:
    import docker.errors

    try:
        client.api.remove_container(container_id, force=True)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as exc:
        if exc.status_code != 409:  # 409: removal already in progress (auto-remove)
            raise SandboxError(f"could not remove container {container_id[:12]}: {exc}") from None
    except OSError as exc:  # the engine went away; its containers went (or go) with it
        raise HostUnreachable(f"could not remove container {container_id[:12]}: {exc}") from None


__all__ = ["DockerSandbox", "AgentRequestError", "container_name"]
