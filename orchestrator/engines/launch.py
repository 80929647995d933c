"""Start an engine server as a child process (a `core.children.Child`) and wait until it
answers; stopping it is the child's `stop`.

Torch-free: the orchestrator imports this module. Two launchers, one child type:

- `start_engine(model_dir, ...)` runs `python -m engine serve` (the same command as
  `stalewise engine serve`) on a free port chosen by the OS (no port race: the server binds
  port 0 and writes the bound port to a file), then polls `/health`. `spawn_engine` is the
  same without the wait: it forks the child, and `engine_ready` does the waiting (from any
  thread; the job restarts engine replicas this way).
- `start_vllm(model_dir, ...)` runs vLLM's OpenAI server (GPU build, or the CPU build in
  `.venv-vllm`) with what stalewise needs: processed log-probs
  (`--logprobs-mode processed_logprobs`), vLLM's own sampling defaults
  (`--generation-config vllm`), the stalewise worker extension for weight reloads, development
  routes (`VLLM_SERVER_DEV_MODE=1`: /pause, /resume, /collective_rpc, /reset_prefix_cache) and
  cached-token counts in usage. Attaching to a running `vllm serve`
  needs no launcher: point `engine_client(url, kind="vllm")` at it.

Guarantees: a start returns only once `/health` answers 200 (the child's `url` set), or raises
`LaunchError` with the tail of the child's log (a child that exits early is reported at once,
not after the timeout) and stops it; `stop` sends SIGTERM, waits, then SIGKILLs, always reaps
the child (vLLM leads a process group: its helpers are ended too), and removes the launcher's
temporary directory (the log stays readable through `log_tail`); on Linux a child started from
the main thread also gets SIGTERM if its parent dies, so a crashed caller leaves no engine
behind (from other threads that is not possible: the signal follows the forking thread). A
child is a context manager.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from config.engine import EngineServerConfig
from core.children import (
    PROJECT_ROOT,
    Child,
    LaunchError,
    free_port,
    port_file,
    python_command,
)

PORT_FILE = "port"  # in the launcher's temporary directory


def spawn_engine(model_dir: str | Path, config: EngineServerConfig | None = None, *,
                 host: str = "127.0.0.1", port: int = 0, initial_version: int = 0,
                 seed: int = 0, config_path: str | Path | None = None,
                 log_path: str | Path | None = None,
                 env: dict[str, str] | None = None) -> Child:
    """Fork `python -m engine serve` (call it from the main thread so the parent-death signal
    holds); `engine_ready` waits for it, from any thread. The child reads `config` (default:
    the defaults) from one JSON file, written to `config_path` (default: the launcher's
    temporary directory, which also holds the port file and, without `log_path`, the log)."""
    scratch = Path(tempfile.mkdtemp(prefix="stalewise-engine-"))
    log = Path(log_path) if log_path is not None else scratch / "engine.log"
    config_file = Path(config_path) if config_path is not None else scratch / "engine.json"
    config_file.parent.mkdir(parents=True, exist_ok=True)
    config_file.write_text((config or EngineServerConfig()).model_dump_json(indent=2))
    command = python_command(
        "-m", "engine", "serve", "--model", str(model_dir), "--host", host,
        "--port", str(port), "--port-file", str(scratch / PORT_FILE),
        "--initial-version", str(initial_version), "--seed", str(seed),
        "--config", str(config_file))
    return Child.start("engine", command, log, env=env, scratch=scratch)


def engine_ready(child: Child, startup_timeout: float = 120.0, *,
                 host: str = "127.0.0.1") -> Child:
    """Block until a spawned engine has bound its port and `/health` answers 200; returns it
    with its `url`. On failure the child is stopped and `LaunchError` carries its log tail."""
    started = time.monotonic()
    assert child.scratch is not None, "engine_ready takes a child from spawn_engine"
    bound = child.ready(port_file(child.scratch / PORT_FILE), timeout=startup_timeout,
                        before="listening", within="bind a port", interval_s=0.05)
    child.url = f"http://{host}:{bound}"
    return wait_healthy(child, startup_timeout - (time.monotonic() - started))


def start_engine(model_dir: str | Path, config: EngineServerConfig | None = None, *,
                 host: str = "127.0.0.1", port: int = 0, initial_version: int = 0,
                 seed: int = 0, config_path: str | Path | None = None,
                 log_path: str | Path | None = None, startup_timeout: float = 120.0,
                 env: dict[str, str] | None = None) -> Child:
    """`spawn_engine`, then `engine_ready`: an engine that answers."""
    child = spawn_engine(model_dir, config, host=host, port=port,
                         initial_version=initial_version, seed=seed, config_path=config_path,
                         log_path=log_path, env=env)
    return engine_ready(child, startup_timeout, host=host)


def wait_healthy(child: Child, timeout: float) -> Child:
    """Block until `child.url`/health answers 200 (`Child.ready`: its exit fails this at once)."""
    with httpx.Client(timeout=2.0) as http:
        def healthy() -> bool:
            try:
                return http.get(f"{child.url}/health").status_code == 200
            except httpx.TransportError:
                return False

        child.ready(healthy, timeout=timeout, before="answering /health",
                    within=f"answer {child.url}/health")
    return child


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


def vllm_command(model_dir: str | Path, *, host: str, port: int,
                 served_model_name: str | None = None, extra_args: tuple[str, ...] = (),
                 python: str | Path | None = None) -> list[str]:
    """vLLM's OpenAI-compatible server, configured for stalewise.

    It runs `PYTHON -m vllm.entrypoints.openai.api_server` with the interpreter `vllm_python`
    finds, not the `vllm` script: the CPU build's script fails (its distribution is named
    vllm-cpu, and the script looks up the version of "vllm"), and the module runs the same
    server in both builds. `--generation-config vllm` keeps a checkpoint's
    `generation_config.json` from silently adding penalties or changing the sampling defaults,
    which would make the recorded log-probs differ from what the learner recomputes."""
    command = [vllm_python(python), "-m", VLLM_API_SERVER, "--model", str(model_dir),
               "--host", host, "--port", str(port),
               "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
               "--worker-extension-cls", "engine.vllm_ext.StalewiseWorkerExtension",
               "--enable-prompt-tokens-details", "--max-logprobs", "128"]
    if served_model_name:
        command += ["--served-model-name", served_model_name]
    return command + list(extra_args)


def start_vllm(model_dir: str | Path, *, host: str = "127.0.0.1", port: int = 0,
               served_model_name: str | None = None, extra_args: tuple[str, ...] = (),
               log_path: str | Path | None = None, startup_timeout: float = 600.0,
               env: dict[str, str] | None = None, initial_version: int = 0,
               python: str | Path | None = None) -> Child:
    """Start vLLM (`vllm_command`) on `port` (0: a free one) and wait for `/health`. The worker
    extension reports `initial_version` until the first checkpoint load. Without a GPU,
    `VLLM_CPU_DEFAULTS` fill in the CPU build's environment."""
    port = port or free_port(host)
    command = vllm_command(model_dir, host=host, port=port,
                           served_model_name=served_model_name, extra_args=extra_args,
                           python=python)
    defaults = {} if has_nvidia_gpu() else VLLM_CPU_DEFAULTS
    scratch = Path(tempfile.mkdtemp(prefix="stalewise-vllm-")) if log_path is None else None
    log = Path(log_path) if log_path is not None else scratch / "vllm.log"
    # a group of its own: vLLM's engine core and workers are its children, and outlive it
    # when it is SIGKILLed; stopping ends the whole group
    child = Child.start("vLLM", command, log, own_group=True, scratch=scratch, env={
        **defaults, **os.environ, "VLLM_SERVER_DEV_MODE": "1",
        "STALEWISE_INITIAL_VERSION": str(initial_version), **(env or {})})
    child.url = f"http://{host}:{port}"
    return wait_healthy(child, startup_timeout)


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
