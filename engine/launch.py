"""Start an engine server as a child process, wait until it answers, stop it cleanly.

Torch-free: the orchestrator imports this module. Two launchers share one shape:

- `EngineProcess.start(model_dir, ...)` runs `python -m engine serve` (the same command as
  `stalewise engine serve`) on a free port chosen by the OS (no port race: the server binds
  port 0 and writes the bound port to a file), then polls `/health`. `EngineProcess.spawn`
  is the same without the wait: it forks the child and returns a `PendingEngine`, whose
  `ready()` does the waiting (from any thread; the job restarts engine replicas this way).
- `VllmProcess.start(model_dir, ...)` runs `vllm serve` with what stalewise needs: processed
  log-probs (`--logprobs-mode processed_logprobs`), the stalewise worker extension for weight
  reloads, development routes (`VLLM_SERVER_DEV_MODE=1`: /pause, /resume, /collective_rpc,
  /reset_prefix_cache) and cached-token counts in usage. Attaching to a running `vllm serve`
  needs no launcher: point `engine_client(url, backend="vllm")` at it.

Guarantees: `start` returns only once `/health` answers 200, or raises `LaunchError` with the
tail of the child's log (a child that exits early is reported at once, not after the timeout);
`stop` sends SIGTERM, waits, then SIGKILLs, always reaps the child, and removes the launcher's
temporary directory (the log stays readable through `log_tail`); on Linux a child started from
the main thread also gets SIGTERM if its parent dies, so a crashed caller leaves no engine
behind (from other threads that is not possible: the signal follows the forking thread). Both are context
managers.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from stalewise.children import child_env, death_signal_hook, python_command
from stalewise.engine_config import EngineServerConfig


class LaunchError(RuntimeError):
    """The engine process did not come up; the message carries its log tail."""


@dataclass
class _Child:
    process: subprocess.Popen
    url: str
    log_path: Path
    workdir: Path
    final_log: str | None = field(default=None)

    def log_tail(self, chars: int = 4000) -> str:
        if self.final_log is not None:
            return self.final_log[-chars:]
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def wait_healthy(self, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                code = self.process.poll()
                if code is not None:
                    raise LaunchError(f"{what} exited with code {code} before answering /health; "
                                      f"log tail:\n{self.log_tail()}")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
        self.terminate(5.0)
        raise LaunchError(f"{what} did not answer {self.url}/health within {timeout:.0f}s; "
                          f"log tail:\n{self.log_tail()}")

    def terminate(self, timeout: float) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.final_log is None and self.log_path.parent == self.workdir:
            self.final_log = self.log_tail(100_000)  # keep the log, drop the temp dir
            shutil.rmtree(self.workdir, ignore_errors=True)
        return self.process.returncode


def _wait_port_file(path: Path, process: subprocess.Popen, timeout: float, log: Path) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file():
            return int(path.read_text())
        code = process.poll()
        if code is not None:
            raise LaunchError(f"engine exited with code {code} before listening; log tail:\n"
                              f"{log.read_text(errors='replace')[-4000:]}")
        time.sleep(0.05)
    raise LaunchError(f"engine did not bind a port within {timeout:.0f}s; log tail:\n"
                      f"{log.read_text(errors='replace')[-4000:]}")


class EngineProcess:
    """A `stalewise engine serve` child process (see module docstring)."""

    def __init__(self, child: _Child) -> None:
        self._child = child

    @property
    def url(self) -> str:
        return self._child.url

    @property
    def pid(self) -> int:
        return self._child.process.pid

    @property
    def log_path(self) -> Path:
        return self._child.log_path

    def log_tail(self, chars: int = 4000) -> str:
        return self._child.log_tail(chars)

    def poll(self) -> int | None:
        """The exit code if the server has exited, else None."""
        return self._child.process.poll()

    @classmethod
    def start(cls, model_dir: str | Path, config: EngineServerConfig | None = None, *,
              host: str = "127.0.0.1", port: int = 0, initial_version: int = 0, seed: int = 0,
              config_path: str | Path | None = None, log_path: str | Path | None = None,
              startup_timeout: float = 120.0,
              env: dict[str, str] | None = None) -> EngineProcess:
        """Start `python -m engine serve`; the child reads `config` (default: the defaults)
        from one JSON file, written to `config_path` (default: the launcher's temp dir)."""
        return cls.spawn(model_dir, config, host=host, port=port,
                         initial_version=initial_version, seed=seed, config_path=config_path,
                         log_path=log_path, env=env).ready(startup_timeout)

    @classmethod
    def spawn(cls, model_dir: str | Path, config: EngineServerConfig | None = None, *,
              host: str = "127.0.0.1", port: int = 0, initial_version: int = 0, seed: int = 0,
              config_path: str | Path | None = None, log_path: str | Path | None = None,
              env: dict[str, str] | None = None) -> PendingEngine:
        """`start` without the wait: the child is forked here (call it from the main thread so
        the parent-death signal holds); `PendingEngine.ready` waits, from any thread."""
        workdir = Path(tempfile.mkdtemp(prefix="stalewise-engine-"))
        port_file = workdir / "port"
        log = Path(log_path) if log_path is not None else workdir / "engine.log"
        config_file = Path(config_path) if config_path is not None else workdir / "engine.json"
        config_file.write_text((config or EngineServerConfig()).model_dump_json(indent=2))
        command = python_command(
            "-m", "engine", "serve", "--model", str(model_dir), "--host", host,
            "--port", str(port), "--port-file", str(port_file),
            "--initial-version", str(initial_version), "--seed", str(seed),
            "--config", str(config_file))
        with open(log, "ab") as log_file:
            process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env=child_env(env),
                                       preexec_fn=death_signal_hook())
        return PendingEngine(process, host, port_file, log, workdir,
                             keep_workdir=log_path is not None)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, wait up to `timeout`, then SIGKILL; returns the exit code."""
        return self._child.terminate(timeout)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class PendingEngine:
    """An engine child that was forked but may not answer yet (`EngineProcess.spawn`)."""

    process: subprocess.Popen
    host: str
    port_file: Path
    log: Path
    workdir: Path
    keep_workdir: bool

    def ready(self, startup_timeout: float = 120.0) -> EngineProcess:
        """Block until `/health` answers 200 and return the process; on failure the child is
        killed and `LaunchError` carries its log tail."""
        started = time.monotonic()
        try:
            bound = _wait_port_file(self.port_file, self.process, startup_timeout, self.log)
            child = _Child(self.process, f"http://{self.host}:{bound}", self.log, self.workdir)
            child.wait_healthy(startup_timeout - (time.monotonic() - started), "engine")
        except BaseException:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            if not self.keep_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)
            raise
        return EngineProcess(child)


class VllmProcess(EngineProcess):
    """A `vllm serve` child process configured for stalewise (needs a GPU and vllm)."""

    @staticmethod
    def command(model_dir: str | Path, *, host: str, port: int,
                served_model_name: str | None = None, extra_args: tuple[str, ...] = ()
                ) -> list[str]:
        command = ["vllm", "serve", str(model_dir), "--host", host, "--port", str(port),
                   "--logprobs-mode", "processed_logprobs",
                   "--worker-extension-cls", "engine.vllm_ext.StalewiseWorkerExtension",
                   "--enable-prompt-tokens-details", "--max-logprobs", "128"]
        if served_model_name:
            command += ["--served-model-name", served_model_name]
        return command + list(extra_args)

    @classmethod
    def start(cls, model_dir: str | Path, *, host: str = "127.0.0.1", port: int = 8000,  # type: ignore[override]
              served_model_name: str | None = None, extra_args: tuple[str, ...] = (),
              log_path: str | Path | None = None, startup_timeout: float = 600.0,
              env: dict[str, str] | None = None) -> VllmProcess:
        workdir = Path(tempfile.mkdtemp(prefix="stalewise-vllm-"))
        log = Path(log_path) if log_path is not None else workdir / "vllm.log"
        vllm_env = child_env({"VLLM_SERVER_DEV_MODE": "1", **(env or {})})
        command = cls.command(model_dir, host=host, port=port,
                              served_model_name=served_model_name, extra_args=extra_args)
        with open(log, "ab") as log_file:
            try:
                process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, env=vllm_env,
                                           preexec_fn=death_signal_hook())
            except FileNotFoundError as exc:
                raise LaunchError("`vllm` is not on PATH; install it on a GPU machine with "
                                  "`pip install vllm` (see docs/engine.md)") from exc
        child = _Child(process, f"http://{host}:{port}", log, workdir)
        try:
            child.wait_healthy(startup_timeout, "vllm serve")
        except BaseException:
            child.terminate(10.0)
            raise
        return cls(child)
