"""The body of every Ray actor of a job: one child process on this node, supervised.

Guarantees: the child (a `core.children.Child`) is started, watched and restarted by one
supervisor thread that lives as long as the actor, so the child gets SIGTERM if the actor's
process dies (it never outlives its host); a child that exits unexpectedly is restarted at
most `max_restarts` times in all (a `RestartBudget`; each restart and its log tail are kept in
`status()`), then the host reports `failed` and stops trying; a child whose launch says
`exit_ok` and that exits with code 0 is `exited` (its work is done) until the driver asks for
`restart()`; `replace()` restarts it with the weights the driver names (a router's restart of
a replica); every restart, asked for or not, counts against the budget; `stop()` ends the
supervisor first, then the child (SIGTERM, then SIGKILL), and always reaps it.

The class has no Ray import at module level: the driver wraps it with `ray.remote` (placement
module), and tests may drive it directly.
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass, field

import httpx

from core.children import Child, ChildOwnerThread, RestartBudget, free_port
from orchestrator.cluster.launch import Launch


@dataclass
class HostStatus:
    role: str
    node_ip: str
    node_id: str
    state: str = "starting"  # starting | running | exited | failed | stopped
    url: str | None = None
    pid: int | None = None
    restarts: int = 0
    exit_code: int | None = None
    log_path: str | None = None
    failures: list[str] = field(default_factory=list)  # one line per unexpected exit


class ChildHost:
    def __init__(self, launch: Launch, *, max_restarts: int = 3, poll_s: float = 0.25,
                 env: dict[str, str] | None = None) -> None:
        node_ip, node_id = _node_identity()
        self._launch, self._poll_s = launch, poll_s
        self._budget = RestartBudget(max_restarts, window_s=math.inf)
        self._env = dict(env or {})
        self._status = HostStatus(launch.name, node_ip, node_id)
        self._child: Child | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._first_start = threading.Event()
        self._restart_requested = False
        self._replace: tuple[tuple[str, int], float, threading.Event] | None = None
        self._thread = ChildOwnerThread(target=self._supervise, name=f"host-{launch.name}",
                                        daemon=True)

    # ------------------------------------------------------------------ driver's API
    def start(self, env: dict[str, str] | None = None) -> dict:
        """Start the child (its first launch, on the supervisor thread); returns the status
        once it answers (engine: /health) or has failed to start."""
        self._env.update(env or {})
        self._thread.start()
        self._first_start.wait()
        return self.status()

    def status(self) -> dict:
        with self._lock:
            return asdict(self._status)

    def health(self) -> bool:
        """For a served child: does its URL answer /health with 200 now?"""
        url = self._status.url
        if url is None or self._status.state != "running":
            return False
        try:
            return httpx.get(f"{url}/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, chars: int = 4000) -> str:
        child = self._child
        return child.log_tail(chars) if child is not None else ""

    def node_address(self) -> tuple[str, int]:
        """This node's IP and a free TCP port on it (a rendezvous point for rank 0)."""
        return self._status.node_ip, free_port(self._status.node_ip)

    def restart(self) -> dict:
        """Start the child again after it exited with code 0 (counts as a restart)."""
        with self._lock:
            self._restart_requested = True
        self._wake.set()
        return self.status()

    def replace(self, model_dir: str, version: int, timeout: float = 10.0) -> dict:
        """Stop the child and start it again (same port) serving `model_dir` as `version`: a
        router's restart of a replica that stopped answering. Returns once it has started."""
        done = threading.Event()
        with self._lock:
            self._replace = ((model_dir, version), timeout, done)
        self._wake.set()
        while not done.wait(0.5):
            if not self._thread.is_alive():  # failed or stopped: nothing will replace it
                break
        return self.status()

    def stop(self, timeout: float = 15.0) -> int | None:
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        code = self._child.stop(timeout) if self._child is not None else None
        with self._lock:
            self._status.state, self._status.exit_code = "stopped", code
        return code

    # ------------------------------------------------------------------ supervisor thread
    def _supervise(self) -> None:
        try:
            if not self._launch_child(previous=None):
                return
        finally:
            self._first_start.set()
        while not self._stopping.is_set():
            self._wake.wait(self._poll_s)
            self._wake.clear()
            if self._stopping.is_set():
                return
            code = self._child.poll() if self._child is not None else None
            with self._lock:
                state, requested = self._status.state, self._restart_requested
                replace, self._replace = self._replace, None
                self._restart_requested = False
            if replace is not None:
                weights, timeout, done = replace
                if self._child is not None:
                    self._child.stop(timeout)
                relaunched = self._relaunch(f"replaced by the driver with version {weights[1]}",
                                            weights=weights)
                done.set()
                if not relaunched:
                    return
            elif state == "exited" and requested:
                if not self._relaunch("restart requested by the driver"):
                    return
            elif state == "running" and code is not None:
                if code == 0 and self._launch.exit_ok:
                    with self._lock:
                        self._status.state, self._status.exit_code = "exited", 0
                elif not self._relaunch(f"exited with code {code}"):
                    return

    def _relaunch(self, why: str, weights: tuple[str, int] | None = None) -> bool:
        tail = self._child.log_tail(2000) if self._child is not None else ""
        with self._lock:
            self._status.failures.append(f"{why}; last log lines:\n{tail}")
            self._status.exit_code = self._child.poll() if self._child is not None else None
            if not self._budget.allow():
                self._status.state = "failed"
                return False
            self._status.restarts = self._budget.restarts
            self._status.state = "starting"
        return self._launch_child(previous=self._child, weights=weights)

    def _launch_child(self, previous: Child | None,
                      weights: tuple[str, int] | None = None) -> bool:
        try:
            child = self._launch.start(self._status.node_ip, previous, self._env, weights)
        except Exception as exc:  # a launch that fails is a failure of the role, reported
            with self._lock:
                self._status.failures.append(f"could not start: {exc}")
                self._status.state = "failed"
            return False
        with self._lock:
            self._child = child
            self._status.state, self._status.url = "running", child.url
            self._status.pid, self._status.log_path = child.pid, str(child.log_path)
            self._status.exit_code = None
        return True


def _node_identity() -> tuple[str, str]:
    """(IP, node id) of the Ray node this runs on; loopback outside Ray (tests)."""
    try:
        import ray

        if ray.is_initialized():
            context = ray.get_runtime_context()
            return ray.util.get_node_ip_address(), context.get_node_id()
    except ImportError:
        pass
    return "127.0.0.1", "local"
