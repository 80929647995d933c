"""Several Docker engines behind one pool: placement, capacity, lost hosts, images per host.

`HostSet` is shared by every pool of a job. Guarantees:
- placement: a new sandbox goes to the reachable host with the lowest load (live sandboxes over
  capacity; a host without a capacity weighs like the largest capped one), ties to the host
  listed first; `reserve()` waits while every reachable host is full;
- demand before cache: a sandbox started ahead (`reserve(ahead=True)`) takes no slot while a
  sandbox a trajectory waits for does, and such a waiting trajectory has an idle warm sandbox
  of any pool on a full reachable host closed for it (`add_idle_source`), so warm sandboxes of
  one pool (or of one spec) cannot hold the last slots while another waits;
- capacity: at most `capacity` sandboxes of this job are alive on a host at once, whatever
  their spec (a slot is taken by `reserve()` and given back by `release()`, exactly once per
  sandbox);
- a host that stops answering is marked down (`mark_down`): no sandbox is placed on it until
  its backoff (1 s, doubling, at most `max_backoff_s`) has passed; the next placement on it
  pings it first, and a ping that fails doubles the backoff. Sandboxes alive on it fail on
  their next call (`container_died` / `SandboxError`: infrastructure errors), and pools drop
  the warm ones (`DockerSandbox.usable`). When every host is down, `reserve()` raises
  `HostUnreachable` at once, naming each host's last error;
- orphan cleanup runs on every host when a pool opens, and again on a host that comes back;
- images: before a container is created on a host that lacks the spec's image, the image is
  copied from a host that has it (`docker save | docker load`, no registry), else built there
  from the spec's `ImageBuild` (its `FROM` images copied over first when missing);
- an ssh:// host is reached through a local unix socket forwarded by `ssh -N -L`
  (`SshForward`), reopened when the host is retried; `close()` ends every tunnel.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import anyio

from config.sandbox_hosts import DockerHostConfig
from core.sandbox import HostUnreachable, SandboxError, SandboxSpec
from sandboxes.engine import docker_errors

if TYPE_CHECKING:
    import docker

log = logging.getLogger("stalewise.sandboxes")


class SshForward:
    """An ssh:// engine as a local unix socket: `ssh -N -L LOCAL.sock:REMOTE.sock HOST`.

    API calls and attach streams then use the local socket, like any unix:// engine. The remote
    socket is the URL's path (default /var/run/docker.sock). ssh runs under a small shell that
    holds a pipe from this process: when this process dies, the pipe closes and the shell ends
    ssh, so no tunnel outlives its orchestrator."""

    def __init__(self, url: str) -> None:
        from urllib.parse import urlparse

        parsed = urlparse(url)
        self.target = f"{parsed.username}@{parsed.hostname}" if parsed.username else \
            str(parsed.hostname)
        self.port = parsed.port
        self.remote = parsed.path or "/var/run/docker.sock"
        self.local = f"{tempfile.gettempdir()}/stalewise-ssh-{os.getpid()}-{id(self):x}.sock"
        self._process: subprocess.Popen | None = None

    def argv(self) -> list[str]:
        port = ["-p", str(self.port)] if self.port else []
        return ["ssh", "-N", "-o", "BatchMode=yes", "-o", "ExitOnForwardFailure=yes",
                "-o", "StreamLocalBindUnlink=yes", "-o", "ServerAliveInterval=10", *port,
                "-L", f"{self.local}:{self.remote}", "--", self.target]

    def open(self, timeout_s: float) -> str:
        """The local unix:// URL, starting the tunnel when it is not running."""
        if self._process is not None and self._process.poll() is None and \
                os.path.exists(self.local):
            return f"unix://{self.local}"
        self.close()
        # ssh in the background; a watcher ends it when our pipe closes; the shell exits with ssh
        guard = ('exec 3<&0; "$@" & pid=$!; { read -r _ <&3; kill "$pid"; } 2>/dev/null & '
                 'wait "$pid"')
        self._process = subprocess.Popen(["sh", "-c", guard, "sh", *self.argv()],
                                         stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.local):
            if self._process.poll() is not None or time.monotonic() > deadline:
                err = b""
                if self._process.poll() is not None and self._process.stderr is not None:
                    err = self._process.stderr.read()
                self.close()
                raise HostUnreachable(f"ssh tunnel to {self.target} failed: "
                                      f"{err.decode(errors='replace').strip() or 'timed out'}")
            time.sleep(0.1)
        return f"unix://{self.local}"

    def close(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            try:
                if process.stdin is not None:
                    process.stdin.close()  # the guard shell ends ssh
                process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                process.kill()
        try:
            os.unlink(self.local)
        except OSError:
            pass


@dataclass(eq=False)
class DockerHost:
    url: str
    capacity: int | None = None
    forward: SshForward | None = None  # for ssh:// hosts
    live: int = 0
    client: "docker.DockerClient | None" = None
    failures: int = 0  # consecutive; 0 when the host answers
    retry_at: float = 0.0  # monotonic time before which nothing is placed here
    last_error: str = ""
    probing: bool = False  # a ping is under way: others neither place here nor ping again
    stats: dict[str, int] = field(default_factory=lambda: {
        "placed": 0, "lost": 0, "went_down": 0, "came_back": 0, "images_copied": 0})

    @property
    def api_url(self) -> str:
        """Where API calls and attach streams go (an ssh host's local forward)."""
        return f"unix://{self.forward.local}" if self.forward is not None else self.url

    @property
    def down(self) -> bool:
        return self.failures > 0

    def free(self) -> bool:
        return self.capacity is None or self.live < self.capacity


class HostSet:
    def __init__(self, hosts: Sequence[DockerHostConfig], *, max_backoff_s: float = 30.0,
                 base_backoff_s: float = 1.0, connect_timeout_s: float = 60.0) -> None:
        if not hosts:
            raise ValueError("HostSet needs at least one Docker host")
        self.hosts = [DockerHost(h.url, h.capacity, SshForward(h.url) if h.url.startswith(
            "ssh://") else None) for h in hosts]
        self.max_backoff_s = max_backoff_s
        self.base_backoff_s = base_backoff_s
        self.connect_timeout_s = connect_timeout_s
        self._released: anyio.Event | None = None  # made on first use, inside the event loop
        self._idle_sources: list[Callable[[Callable[[object], bool]], bool]] = []
        self._waiting_takers = 0  # reserve() calls for a trajectory, waiting for a slot
        self._evicting = 0  # warm sandboxes being closed for them, not yet released
        self._image_locks: dict[tuple[str, str], threading.Lock] = {}
        self._image_guard = threading.Lock()

    @classmethod
    def from_urls(cls, urls: Sequence[str | DockerHostConfig], **kwargs) -> "HostSet":
        return cls([u if isinstance(u, DockerHostConfig) else DockerHostConfig(url=u)
                    for u in urls], **kwargs)

    # ---- placement ---------------------------------------------------------------------------
    def _load(self, host: DockerHost) -> float:
        caps = [h.capacity for h in self.hosts if h.capacity is not None]
        return host.live / (host.capacity or (max(caps) if caps else 1))

    def add_idle_source(self, evict: Callable[[Callable[[object], bool]], bool]) -> None:
        """`evict(where)` closes one idle warm sandbox that `where` accepts and says whether it
        did (`SandboxPool.evict_idle`); call `wake()` when a sandbox becomes idle."""
        self._idle_sources.append(evict)

    def _evict_for_takers(self, candidates: list[DockerHost]) -> None:
        """Close one idle sandbox on a full reachable host, unless enough are being closed
        already for the trajectories waiting."""
        if self._evicting >= self._waiting_takers:
            return
        full = [h for h in candidates if not h.free()]
        for evict in self._idle_sources:
            if evict(lambda sandbox: any(getattr(sandbox, "host", None) is h for h in full)):
                self._evicting += 1
                log.info("every Docker host is full: closing a warm sandbox for a waiting "
                         "trajectory")
                return

    async def reserve(self, *, ahead: bool = False) -> DockerHost:
        """A slot on the least-loaded reachable host with room, connected; waits while every
        reachable host is full. A host whose backoff has passed is pinged before use. `ahead`:
        for a sandbox nobody waits for yet, which yields to every waiting trajectory."""
        while True:
            now = time.monotonic()
            candidates = [h for h in self.hosts if h.retry_at <= now and not h.probing]
            if not candidates and not any(h.probing for h in self.hosts):
                raise HostUnreachable("every Docker host is unreachable (retried with backoff): "
                                      + "; ".join(f"{h.url}: {h.last_error}" for h in self.hosts))
            free = [h for h in candidates if h.free()]
            if free and not (ahead and self._waiting_takers):
                host = min(free, key=self._load)  # min keeps the first of equals
                host.live += 1
                try:
                    await self.client_for(host)
                except HostUnreachable:
                    self.release(host)
                    continue
                except BaseException:
                    self.release(host)
                    raise
                host.stats["placed"] += 1
                return host
            waiting = [h.retry_at - now for h in self.hosts if h.retry_at > now]
            if self._released is None:
                self._released = anyio.Event()
            released = self._released
            if not ahead:
                self._waiting_takers += 1
                self._evict_for_takers(candidates)
            try:
                with anyio.move_on_after(min(waiting) if waiting else math.inf):
                    await released.wait()
            finally:
                if not ahead:
                    self._waiting_takers -= 1
                    if not self._waiting_takers:
                        self.wake()  # sandboxes started ahead may take slots again

    def release(self, host: DockerHost) -> None:
        host.live -= 1
        self._evicting = max(0, self._evicting - 1)
        self.wake()

    def wake(self) -> None:
        """Let waiting `reserve()` calls look again (a slot was freed, a ping ended, or a
        sandbox went idle)."""
        if self._released is not None:
            released, self._released = self._released, None
            released.set()

    async def client_for(self, host: DockerHost) -> "docker.DockerClient":
        """A connected client for `host`; a host that was down is pinged (and cleaned) first."""
        if host.client is not None and not host.down:
            return host.client
        host.probing = True
        try:
            client = await anyio.to_thread.run_sync(self._connect_and_clean, host)
        except SandboxError as exc:
            self.mark_down(host, exc)
            raise HostUnreachable(str(exc)) from None
        finally:
            host.probing = False
            self.wake()
        came_back = host.down
        host.client, host.failures, host.retry_at = client, 0, 0.0
        if came_back:
            host.stats["came_back"] += 1
            log.warning("Docker host %s answers again; placing sandboxes on it", host.url)
        return client

    def _connect_and_clean(self, host: DockerHost) -> "docker.DockerClient":
        from sandboxes.cleanup import remove_orphans
        from sandboxes.engine import connect

        import docker.errors

        url = host.forward.open(self.connect_timeout_s) if host.forward else host.url
        client = connect(url=url, timeout_s=self.connect_timeout_s)
        if host.down:  # it may have kept containers of ours while it was away
            try:
                _log_removals(host, remove_orphans(client))
            except (OSError, docker.errors.DockerException) as exc:
                client.close()
                raise SandboxError(f"Docker engine {host.url} failed during its orphan "
                                   f"sweep: {exc}") from None
        return client

    def mark_down(self, host: DockerHost, error: BaseException | str) -> None:
        """Stop placing on `host` for a backoff that doubles with every failure in a row."""
        if not host.down:
            host.stats["went_down"] += 1
            host.stats["lost"] += host.live
        host.failures += 1
        backoff = min(self.base_backoff_s * 2 ** (host.failures - 1), self.max_backoff_s)
        host.retry_at = time.monotonic() + backoff
        host.last_error = str(error)[:500]
        if host.client is not None:
            client, host.client = host.client, None
            try:
                client.close()
            except Exception:  # noqa: BLE001 - a dead engine's connections may not close cleanly
                pass
        log.warning("Docker host %s is unreachable (%s); its sandboxes fail as infrastructure "
                    "errors; retrying it in %.1f s", host.url, host.last_error, backoff)

    # ---- orphan cleanup ----------------------------------------------------------------------
    async def remove_orphans(self) -> None:
        """Clean every host; an unreachable one is marked down. Raises when none answers."""
        for host in self.hosts:
            try:
                client = await self.client_for(host)
                removals = await anyio.to_thread.run_sync(self._orphans_of, client)
            except HostUnreachable:
                continue
            except (OSError, docker_errors().DockerException) as exc:  # it died mid-sweep
                self.mark_down(host, exc)
                continue
            _log_removals(host, removals)
        if all(h.down for h in self.hosts):
            raise HostUnreachable("no Docker host answers: " + "; ".join(
                f"{h.url}: {h.last_error}" for h in self.hosts))

    def _orphans_of(self, client: "docker.DockerClient") -> list:
        from sandboxes.cleanup import remove_orphans

        return remove_orphans(client)

    # ---- images ------------------------------------------------------------------------------
    async def ensure_image(self, host: DockerHost, spec: SandboxSpec) -> None:
        """Make `spec.image` present on `host` (copy from another host, else build it there)."""
        await anyio.to_thread.run_sync(self._ensure_image_sync, host, spec)

    def _image_lock(self, host: DockerHost, image: str) -> threading.Lock:
        with self._image_guard:
            return self._image_locks.setdefault((host.url, image), threading.Lock())

    def _ensure_image_sync(self, host: DockerHost, spec: SandboxSpec) -> None:
        from sandboxes.image import ensure_image, from_images, image_exists, map_from_images

        client = host.client
        if client is None or image_exists(client, spec.image) is not None:
            return
        if self._copy_from_another(host, spec.image):
            return
        if spec.build is None:
            return  # creating the container names the missing image and how to build it
        dockerfile = f"{spec.build.context}/Dockerfile"
        try:
            text = map_from_images(open(dockerfile).read(), dict(spec.build.base_image_map))
        except OSError:
            text = ""
        for base in from_images(text):
            if image_exists(client, base) is None:
                self._copy_from_another(host, base)
        ensure_image(spec.image, spec.build, client=client)

    def _copy_from_another(self, host: DockerHost, image: str) -> bool:
        from sandboxes.image import image_exists

        assert host.client is not None
        with self._image_lock(host, image):
            if image_exists(host.client, image) is not None:
                return True
            for other in self.hosts:
                source = other.client
                if other is host or source is None or other.down:
                    continue
                try:
                    if image_exists(source, image) is None:
                        continue
                except Exception:  # noqa: BLE001 - a source that fails is simply not used
                    continue
                log.info("copying image %s from %s to %s", image, other.url, host.url)
                copy_image(source, host.client, image)
                host.stats["images_copied"] += 1
                return True
        return False

    def close(self) -> None:
        """Close the clients and end the ssh tunnels."""
        for host in self.hosts:
            if host.client is not None:
                host.client.close()
                host.client = None
            if host.forward is not None:
                host.forward.close()

    def summary(self) -> dict[str, dict[str, int | str]]:
        return {h.url: {**h.stats, "live": h.live, "down": int(h.down), "last_error":
                        h.last_error} for h in self.hosts}


@contextmanager
def connected(url: str, *, timeout_s: float = 10.0) -> Iterator["docker.DockerClient"]:
    """A pinged client for one engine URL (through a short-lived tunnel for ssh://)."""
    from sandboxes.engine import connect

    forward = SshForward(url) if url.startswith("ssh://") else None
    try:
        client = connect(url=forward.open(timeout_s) if forward else url, timeout_s=timeout_s)
        try:
            yield client
        finally:
            client.close()
    finally:
        if forward is not None:
            forward.close()


def copy_image(source: "docker.DockerClient", target: "docker.DockerClient", image: str) -> None:
    """`docker save IMAGE` on `source` streamed into `docker load` on `target`. Returns once
    `target` has the image; raises `SandboxError` naming the engine's reason when it has not
    (a full disk on `target` is the usual one)."""
    import docker.errors

    from sandboxes.image import image_exists

    failed = f"copying image {image} to another Docker host failed"
    try:
        # The load's progress stream carries its outcome: it must be read to the end, or the
        # engine's error (and whether the load finished at all) goes unseen.
        for message in target.api.load_image(source.api.get_image(image), quiet=True):
            error = isinstance(message, dict) and (
                message.get("error") or message.get("errorDetail", {}).get("message"))
            if error:
                raise SandboxError(f"{failed}: the target engine said: {error}")
        loaded = image_exists(target, image)
    except (docker.errors.DockerException, OSError) as exc:
        raise SandboxError(f"{failed}: {exc}") from exc
    if loaded is None:
        raise SandboxError(f"{failed}: the target engine reported no error, yet has no {image} "
                           "after the load (is its disk full? `docker system df` on it tells)")


def _log_removals(host: DockerHost, removals: list) -> None:
    for removal in removals:
        log.warning("removed orphan sandbox %s on %s: %s", removal.name, host.url, removal.reason)
