"""Start an engine server as a child process, wait until it answers, stop it cleanly.

Torch-free: the orchestrator imports this module. Two launchers share one shape:

- `EngineProcess.start(model_dir, ...)` runs `python -m engine serve` (the same command as
  `stalewise engine serve`) on a free port chosen by the OS (no port race: the server binds
  port 0 and writes the bound port to a file), then polls `/health`. `EngineProcess.spawn`
  is the same without the wait: it forks the child and returns a `PendingEngine`, whose
  `ready()` does the waiting (from any thread; the job restarts engine replicas this way).
- `VllmProcess.start(model_dir, ...)` runs vLLM's OpenAI server (GPU build, or the CPU build
  in `.venv-vllm`) with what stalewise needs: processed log-probs
  (`--logprobs-mode processed_logprobs`), vLLM's own sampling defaults
  (`--generation-config vllm`), the stalewise worker extension for weight reloads, development
  routes (`VLLM_SERVER_DEV_MODE=1`: /pause, /resume, /collective_rpc, /reset_prefix_cache) and
  cached-token counts in usage. Attaching to a running `vllm serve`
  needs no launcher: point `engine_client(url, kind="vllm")` at it.

Guarantees: `start` returns only once `/health` answers 200, or raises `LaunchError` with the
tail of the child's log (a child that exits early is reported at once, not after the timeout);
`stop` sends SIGTERM, waits, then SIGKILLs, always reaps the child, and removes the launcher's
temporary directory (the log stays readable through `log_tail`); on Linux a child started from
the main thread also gets SIGTERM if its parent dies, so a crashed caller leaves no engine
behind (from other threads that is not possible: the signal follows the forking thread). Both are context
managers.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from config.engine import EngineServerConfig
from core.children import PROJECT_ROOT, child_env, death_signal_hook, free_port, python_command


class LaunchError(RuntimeError):
    """The engine process did not come up; the message carries its log tail."""


@dataclass
class _Child:
    process: subprocess.Popen
    url: str
    log_path: Path
    workdir: Path
    final_log: str | None = field(default=None)
    own_group: bool = False  # the process leads a process group of its own (its helpers too)

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
        if self.own_group:  # helpers left behind when it died (vLLM's EngineCore): end them
            _end_group(self.process.pid, timeout)
        if self.final_log is None and self.log_path.parent == self.workdir:
            self.final_log = self.log_tail(100_000)  # keep the log, drop the temp dir
            shutil.rmtree(self.workdir, ignore_errors=True)
        return self.process.returncode


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`, from /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


def _end_group(pgid: int, timeout: float) -> None:
    """SIGTERM every process left in group `pgid`, then SIGKILL what is still there."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + (timeout if sig == signal.SIGTERM else 10.0)
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)


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


VLLM_API_SERVER = "vllm.entrypoints.openai.api_server"
VLLM_VENV = Path(PROJECT_ROOT) / ".venv-vllm"   # built by scripts/setup_vllm.sh
# The CPU build's settings, used where the caller's environment does not set them: KV cache in
# GiB (its default, 4 GiB, is too much for a small test machine shared with other processes).
VLLM_CPU_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "2"}


def vllm_python(explicit: str | Path | None = None) -> str:
    """The Python interpreter that has vLLM installed: `explicit`, else `$STALEWISE_VLLM_PYTHON`,
    else the project's `.venv-vllm` (scripts/setup_vllm.sh), else the interpreter of the `vllm`
    script on PATH (its first line). Raises `LaunchError` saying how to install vLLM."""
    for candidate in (explicit, os.environ.get("STALEWISE_VLLM_PYTHON")):
        if candidate:
            if not Path(candidate).is_file():
                raise LaunchError(f"the vLLM Python interpreter {candidate} does not exist")
            return str(candidate)
    venv_python = VLLM_VENV / "bin" / "python"
    if venv_python.is_file():
        return str(venv_python)
    script = shutil.which("vllm")
    if script is not None:
        first = Path(script).read_bytes()[:512].split(b"\n", 1)[0].decode(errors="replace")
        if first.startswith("#!") and Path(first[2:].strip().split()[0]).is_file():
            return first[2:].strip().split()[0]
    raise LaunchError("vLLM is not installed: build the project's vLLM environment with "
                      "`bash scripts/setup_vllm.sh` (CPU build vllm-cpu, or vllm where a GPU "
                      "answers), or point STALEWISE_VLLM_PYTHON at a Python that has vllm")


def has_nvidia_gpu() -> bool:
    """True when `nvidia-smi -L` lists a GPU (no torch import: the orchestrator is torch-free)."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and b"GPU" in done.stdout


class VllmProcess(EngineProcess):
    """vLLM's OpenAI-compatible server as a child process, configured for stalewise.

    It runs `PYTHON -m vllm.entrypoints.openai.api_server` with the interpreter `vllm_python`
    finds, not the `vllm` script: the CPU build's script fails (its distribution is named
    vllm-cpu, and the script looks up the version of "vllm"), and the module runs the same
    server in both builds. `--generation-config vllm` keeps a checkpoint's
    `generation_config.json` from silently adding penalties or changing the sampling defaults,
    which would make the recorded log-probs differ from what the learner recomputes. Without a
    GPU, `VLLM_CPU_DEFAULTS` fill in the CPU build's environment."""

    @staticmethod
    def command(model_dir: str | Path, *, host: str, port: int,
                served_model_name: str | None = None, extra_args: tuple[str, ...] = (),
                python: str | Path | None = None) -> list[str]:
        command = [vllm_python(python), "-m", VLLM_API_SERVER, "--model", str(model_dir),
                   "--host", host, "--port", str(port),
                   "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
                   "--worker-extension-cls", "engine.vllm_ext.StalewiseWorkerExtension",
                   "--enable-prompt-tokens-details", "--max-logprobs", "128"]
        if served_model_name:
            command += ["--served-model-name", served_model_name]
        return command + list(extra_args)

    @classmethod
    def start(cls, model_dir: str | Path, *, host: str = "127.0.0.1", port: int = 0,  # type: ignore[override]
              served_model_name: str | None = None, extra_args: tuple[str, ...] = (),
              log_path: str | Path | None = None, startup_timeout: float = 600.0,
              env: dict[str, str] | None = None, initial_version: int = 0,
              python: str | Path | None = None) -> VllmProcess:
        """Start vLLM on `port` (0: a free one) and wait for `/health`. The worker extension
        reports `initial_version` until the first checkpoint load."""
        workdir = Path(tempfile.mkdtemp(prefix="stalewise-vllm-"))
        log = Path(log_path) if log_path is not None else workdir / "vllm.log"
        port = port or free_port(host)
        defaults = {} if has_nvidia_gpu() else VLLM_CPU_DEFAULTS
        vllm_env = child_env({**defaults, **os.environ, "VLLM_SERVER_DEV_MODE": "1",
                              "STALEWISE_INITIAL_VERSION": str(initial_version), **(env or {})})
        try:
            command = cls.command(model_dir, host=host, port=port,
                                  served_model_name=served_model_name, extra_args=extra_args,
                                  python=python)
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        with open(log, "ab") as log_file:
            # a group of its own: vLLM's engine core and workers are its children, and outlive
            # it when it is SIGKILLed; stopping ends the whole group
            process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env=vllm_env,
                                       preexec_fn=death_signal_hook(), start_new_session=True)
        child = _Child(process, f"http://{host}:{port}", log, workdir, own_group=True)
        try:
            child.wait_healthy(startup_timeout, "vLLM")
        except BaseException:
            child.terminate(10.0)
            raise
        return cls(child)


def hold_checkpoint(checkpoint: Path, hold: Path) -> Path:
    """`hold`, replaced by a copy of the checkpoint directory whose files are hard links (a
    plain copy across file systems): the files stay readable when the learner deletes the
    original. Raises `FileNotFoundError` naming the checkpoint when it is already gone."""
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"checkpoint {checkpoint} is no longer on disk")
    shutil.rmtree(hold, ignore_errors=True)

    def link(source: str, target: str) -> None:
        try:
            os.link(source, target)
        except OSError:  # another file system, or links not allowed there
            shutil.copy2(source, target)

    shutil.copytree(checkpoint, hold, copy_function=link)
    return hold
