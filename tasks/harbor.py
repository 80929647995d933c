"""Harbor task folders as a task family: `[tasks] family = "harbor:path/to/tasks"`.

A Harbor task is a folder with `task.toml`, `instruction.md`, `environment/Dockerfile`,
`tests/test.sh` (plus helpers) and optionally `solution/solve.sh`. PATH is one task folder or a
folder of task folders (every sub-folder with a `task.toml`, sorted by name).

Guarantees:
- every task is read and checked when the family is built, so a bad folder stops a job before
  it starts with one line (`HarborTaskError`) naming the task, the problem and the fix;
- instance `i` is the `i`-th task (`size` = number of tasks; the train, validation and test
  splits hold the same tasks, so the family is not held out: `held_out` is false and a job's
  summary says so); its prompt is `instruction.md` verbatim; its tools are `bash`, `read_file`,
  `write_file` plus the job's extra tools;
- the sandbox image is built from `environment/` by the Docker backend when missing, tagged by
  the content hash of that folder and the `FROM` substitutions (`base_image_map`), so an
  unchanged environment is built once; the image's work dir (its last `WORKDIR`, else /work)
  is the agent's work dir, seeded from the image;
- hardening stays on: the read-only root, no network unless both the task (`allow_internet`)
  and the job (`allow_network`) allow it, memory and CPUs from `task.toml` capped by the job's;
- `tests/` reaches the sandbox (at /tests) only after the last turn; the verifier then runs
  `bash /tests/test.sh` in the same container under `[verifier] timeout_sec` and reads
  `/logs/verifier/reward.txt` (one number) or `reward.json`/`rewards.json` (name -> number;
  the reward is the `reward` entry, else the mean); a script that times out, dies or writes no
  valid reward raises `VerifierError` (an infrastructure error, never reward 0);
- `solution/` is never in the task instance: only `harbor_oracle` copies it to /solution.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from config.harbor import HarborSettings
from core.sandbox import ExecResult, ImageBuild, Sandbox, SandboxError, SandboxLimits, SandboxSpec
from tasks.api import TaskFamily, TaskInstance, TaskLimits
from tasks.builtin_tools import bash, read_file, write_file
from tasks.tools import Tool
from tasks.verify import Reward, VerifierError, VerifyContext

PREFIX = "harbor:"
TESTS_DIR, LOGS_DIR, SOLUTION_DIR = "/tests", "/logs", "/solution"
REWARD_FILES = ("/logs/verifier/reward.txt", "/logs/verifier/reward.json",
                "/logs/verifier/rewards.json")
MAP_SETTING = "[tasks.harbor] base_image_map"
DEFAULT_WORKDIR = "/work"
_WORKDIR = re.compile(r"^\s*WORKDIR\s+(\S+)\s*$", re.IGNORECASE | re.MULTILINE)
_SLUG = re.compile(r"[^a-z0-9_.-]+")


class HarborTaskError(ValueError):
    """A Harbor task folder cannot be used; the message names the task and the fix."""


# -- task.toml -------------------------------------------------------------------------------

class _Open(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Verifier(_Open):
    timeout_sec: float = Field(600.0, gt=0)
    env: dict[str, str] = Field(default_factory=dict)


class _Agent(_Open):
    timeout_sec: float = Field(600.0, gt=0)


class _Environment(_Open):
    build_timeout_sec: float = Field(600.0, gt=0)
    cpus: float = Field(1.0, gt=0)
    memory_mb: int | None = Field(None, ge=16)
    memory: str | None = None  # deprecated spelling: "2G", "512M"
    gpus: int = Field(0, ge=0)
    allow_internet: bool = True
    docker_image: str | None = None


class _TaskSection(_Open):
    name: str | None = None
    description: str = ""


class TaskToml(_Open):
    """The fields of task.toml that stalewise reads (older `version = "1.0"` files and newer
    `schema_version` files alike); unknown keys are ignored, as Harbor ignores them."""

    version: str | None = None
    schema_version: str | None = None
    task: _TaskSection = Field(default_factory=_TaskSection)
    metadata: dict[str, Any] = Field(default_factory=dict)
    verifier: _Verifier = Field(default_factory=_Verifier)
    agent: _Agent = Field(default_factory=_Agent)
    environment: _Environment = Field(default_factory=_Environment)
    steps: list[Any] | None = None

    def memory(self) -> int:
        env = self.environment
        if env.memory_mb is not None:
            return env.memory_mb
        if env.memory:
            match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([GgMm])[Bb]?\s*", env.memory)
            if match is None:
                raise ValueError(f"environment.memory = {env.memory!r} is not like '2G' or "
                                 "'512M'; use memory_mb = 2048")
            value = float(match.group(1))
            return int(value * 1024 if match.group(2) in "Gg" else value)
        return 2048


# -- one task --------------------------------------------------------------------------------

@dataclass(frozen=True)
class HarborTask:
    """One parsed task folder."""

    name: str
    path: Path
    config: TaskToml
    instruction: str
    dockerfile: str | None  # None when the task names a prebuilt `docker_image`
    tests: Mapping[str, str]  # path under /tests -> text
    solution: Mapping[str, str]  # path under /solution -> text (empty without solution/)


def _fail(task: str, path: Path, problem: str) -> HarborTaskError:
    return HarborTaskError(f"harbor task {task} ({path}): {problem}")


def read_task(path: Path) -> HarborTask:
    """Parse and check one task folder; `HarborTaskError` says what is wrong and how to fix it."""
    name = path.name
    config = _read_toml(name, path)
    name = config.task.name or name
    instruction_path = path / "instruction.md"
    if not instruction_path.is_file():
        raise _fail(name, path, "instruction.md is missing; add it with the prompt the agent "
                    "gets")
    instruction = _text(name, path, "instruction.md").strip()
    if not instruction:
        raise _fail(name, path, "instruction.md is empty; write the task's prompt in it")
    if config.steps:
        raise _fail(name, path, "multi-step tasks ([[steps]]) are not supported yet; split "
                    "them into single-step tasks")
    if config.environment.gpus:
        raise _fail(name, path, f"environment.gpus = {config.environment.gpus}: GPU sandboxes "
                    "are not supported yet; set gpus = 0")
    env_dir = path / "environment"
    dockerfile = env_dir / "Dockerfile"
    if not dockerfile.is_file():
        compose = [f.name for f in env_dir.glob("docker-compose.y*ml")] if env_dir.is_dir() else []
        if compose:
            raise _fail(name, path, f"environment/{compose[0]} environments are not supported "
                        "yet; give the task a single environment/Dockerfile")
        if config.environment.docker_image is None:
            raise _fail(name, path, "environment/Dockerfile is missing; add one (e.g. FROM "
                        "stalewise-base) or set [environment] docker_image")
    test_sh = path / "tests" / "test.sh"
    if not test_sh.is_file():
        raise _fail(name, path, "tests/test.sh is missing; add a script that writes "
                    "/logs/verifier/reward.txt")
    try:
        config.memory()
    except ValueError as err:
        raise _fail(name, path, str(err)) from None
    return HarborTask(
        name=name, path=path, config=config, instruction=instruction,
        dockerfile=_text(name, path, "environment/Dockerfile") if dockerfile.is_file() else None,
        tests=_texts(name, path, "tests"), solution=_texts(name, path, "solution"))


def _read_toml(name: str, path: Path) -> TaskToml:
    toml_path = path / "task.toml"
    if toml_path.is_dir():
        raise _fail(name, path, "task.toml is a folder; make it a file")
    if not toml_path.is_file():
        raise _fail(name, path, "task.toml is missing; add one (version = \"1.0\" with "
                    "[verifier] and [agent] timeout_sec is enough)")
    try:
        data = tomllib.loads(_text(name, path, "task.toml"))
    except tomllib.TOMLDecodeError as err:
        raise _fail(name, path, f"task.toml is not valid TOML ({err}); fix its syntax") from None
    try:
        return TaskToml.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise _fail(name, path, f"task.toml: {where}: {first['msg']} (got "
                    f"{first.get('input')!r}); fix that value") from None


def _text(name: str, path: Path, relative: str) -> str:
    """The task folder's file `relative` as UTF-8 text, or one line naming it."""
    try:
        return (path / relative).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise _fail(name, path, f"{relative} is not UTF-8 text (byte {err.start}); save it as "
                    "UTF-8") from None
    except OSError as err:
        raise _fail(name, path, f"{relative} cannot be read ({err.strerror})") from None


def _texts(name: str, path: Path, folder: str) -> dict[str, str]:
    root = path / folder
    if not root.is_dir():
        return {}
    texts = {}
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        relative = file.relative_to(root).as_posix()
        try:
            texts[relative] = file.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise _fail(name, path, f"{folder}/{relative} is not UTF-8 text; binary files in "
                        f"{folder}/ are not supported yet (generate them in the script)") from None
    return texts


def find_tasks(root: Path) -> list[Path]:
    """The task folders under `root`: itself when it has a task.toml, else its sub-folders
    that look like tasks (a task.toml, an instruction.md or an environment/)."""
    if not root.is_dir():
        raise HarborTaskError(f"harbor task folder {root} does not exist; use "
                              "family = \"harbor:path/to/tasks\"")
    if (root / "task.toml").is_file():
        return [root]
    found = sorted(p for p in root.iterdir() if p.is_dir() and any(
        (p / marker).exists() for marker in ("task.toml", "instruction.md", "environment")))
    if not found:
        raise HarborTaskError(f"{root} has no Harbor task folders (folders with a task.toml); "
                              "point family = \"harbor:...\" at a task or a folder of tasks")
    return found


# -- the task instance -----------------------------------------------------------------------

def workdir_of(dockerfile: str | None) -> str:
    """The image's work dir: the Dockerfile's last absolute WORKDIR, else /work."""
    found = [w for w in _WORKDIR.findall(dockerfile or "") if w.startswith("/")]
    workdir = found[-1].rstrip("/") if found else DEFAULT_WORKDIR
    return workdir if workdir not in ("", "/tmp") else DEFAULT_WORKDIR


def environment_hash(task: HarborTask, base_image_map: Mapping[str, str]) -> str:
    digest = hashlib.sha256()
    env_dir = task.path / "environment"
    if env_dir.is_dir():
        for file in sorted(p for p in env_dir.rglob("*") if p.is_file()):
            digest.update(file.relative_to(env_dir).as_posix().encode() + b"\0")
            digest.update(hashlib.sha256(file.read_bytes()).digest())
    digest.update(json.dumps(dict(base_image_map), sort_keys=True).encode())
    digest.update((task.config.environment.docker_image or "").encode())
    return digest.hexdigest()


def sandbox_spec(task: HarborTask, settings: HarborSettings) -> SandboxSpec:
    env = task.config.environment
    limits = SandboxLimits(
        memory_mb=min(task.config.memory(), settings.max_memory_mb),
        cpus=min(env.cpus, settings.max_cpus),
        network=env.allow_internet and settings.allow_network,
        exec_timeout_s=settings.tool_timeout_s, output_bytes=settings.output_bytes,
        ttl_s=task.config.agent.timeout_sec + task.config.verifier.timeout_sec + 600.0)
    scratch = (TESTS_DIR, LOGS_DIR, SOLUTION_DIR)
    if task.dockerfile is None:
        image = str(env.docker_image)
        return SandboxSpec(image=settings.base_image_map.get(image, image), limits=limits,
                           scratch_dirs=scratch)
    workdir = workdir_of(task.dockerfile)
    slug = _SLUG.sub("-", task.path.name.lower()).strip("-.") or "task"
    tag = f"stalewise-harbor-{slug[:60]}:{environment_hash(task, settings.base_image_map)[:16]}"
    build = ImageBuild(context=str((task.path / "environment").resolve()),
                       base_image_map=dict(settings.base_image_map), seed_from=workdir,
                       timeout_s=env.build_timeout_sec, map_setting=MAP_SETTING)
    return SandboxSpec(image=tag, limits=limits, workdir=workdir, build=build,
                       scratch_dirs=scratch)


def task_limits(task: HarborTask, settings: HarborSettings) -> TaskLimits:
    values: dict[str, Any] = {
        "wall_time_s": task.config.agent.timeout_sec,
        "verify_timeout_s": task.config.verifier.timeout_sec + 60.0,
        "tool_timeout_s": settings.tool_timeout_s,
    }
    values.update(settings.limits)
    return TaskLimits(**values)


class HarborVerifier:
    """Runs `bash /tests/test.sh` after the episode and reads the reward it wrote."""

    def __init__(self, task: str, timeout_s: float, env: Mapping[str, str]) -> None:
        self.task, self.timeout_s, self.env = task, timeout_s, dict(env)

    def describe(self) -> str:
        return f"harbor tests/test.sh (timeout {self.timeout_s:g}s)"

    async def __call__(self, ctx: VerifyContext) -> Reward:
        return await run_harbor_tests(ctx.sandbox, self.task, self.timeout_s, self.env)


async def run_harbor_tests(sandbox: Sandbox, task: str, timeout_s: float,
                           env: Mapping[str, str] | None = None) -> Reward:
    """Run /tests/test.sh (already in the sandbox) and return the reward it wrote."""
    prepare = await sandbox.exec(["sh", "-c", "mkdir -p /logs/verifier /logs/agent && rm -f "
                                  + " ".join(REWARD_FILES)], timeout=30)
    _raise_if_dead(prepare, task)
    result = await sandbox.exec(["bash", f"{TESTS_DIR}/test.sh"], timeout=timeout_s,
                                env=dict(env or {}))
    _raise_if_dead(result, task)
    if result.timed_out:
        raise VerifierError(f"harbor task {task}: tests/test.sh ran past its {timeout_s:g}s; "
                            "raise [verifier] timeout_sec in task.toml or speed the tests up")
    for path in REWARD_FILES:
        text = await _read_optional(sandbox, path, task)
        if text is not None:
            return _parse_reward(task, path, text)
    output = (result.stderr or result.stdout).strip().splitlines()
    said = f"; it said: {output[-1][:200]}" if output else ""
    raise VerifierError(f"harbor task {task}: tests/test.sh (exit {result.exit_code}) wrote no "
                        f"/logs/verifier/reward.txt or reward.json{said}; make it write the "
                        "reward, e.g. echo 1 > /logs/verifier/reward.txt")


def _raise_if_dead(result: ExecResult, task: str) -> None:
    if result.error_type == "container_died":
        raise SandboxError(result.error_message or "the sandbox died while verifying")
    if result.error_type == "exec_failed":
        raise VerifierError(f"harbor task {task}: cannot run the verifier "
                            f"({result.error_message}); the image needs sh and bash")


async def _read_optional(sandbox: Sandbox, path: str, task: str) -> str | None:
    probe = await sandbox.exec(["test", "-f", path], timeout=30)
    _raise_if_dead(probe, task)
    if probe.exit_code != 0:
        return None
    return (await sandbox.read_file(path)).decode("utf-8", errors="replace")


def _parse_reward(task: str, path: str, text: str) -> Reward:
    try:
        if path.endswith(".txt"):
            value = float(text.strip())
            breakdown = {"reward": value}
        else:
            data = json.loads(text)
            if not isinstance(data, dict) or not data:
                raise ValueError("not a JSON object of numbers")
            breakdown = {str(k): float(v) for k, v in data.items()}
            value = breakdown["reward"] if "reward" in breakdown else \
                sum(breakdown.values()) / len(breakdown)
    except (ValueError, TypeError) as err:
        raise VerifierError(f"harbor task {task}: {path} holds {text.strip()[:80]!r}, not a "
                            f"reward ({err}); write one number, or a JSON object of numbers"
                            ) from None
    if not math.isfinite(value) or not all(math.isfinite(v) for v in breakdown.values()):
        raise VerifierError(f"harbor task {task}: {path} holds a non-finite reward; write a "
                            "finite number")
    return Reward(value, breakdown)


def make_instance(task: HarborTask, settings: HarborSettings,
                  extra_tools: Sequence[Tool] = ()) -> TaskInstance:
    difficulty = task.config.metadata.get("difficulty")
    return TaskInstance(
        prompt=task.instruction,
        tools=(bash, read_file, write_file, *extra_tools),
        verifier=HarborVerifier(task.name, task.config.verifier.timeout_sec,
                                task.config.verifier.env),
        sandbox=sandbox_spec(task, settings),
        limits=task_limits(task, settings),
        hidden_files={f"{TESTS_DIR}/{path}": text for path, text in task.tests.items()},
        data={"harbor_task": task.name, "harbor_path": str(task.path.resolve())},
        difficulty=str(difficulty) if isinstance(difficulty, str) and difficulty else "all")


# -- the family ------------------------------------------------------------------------------

def read_tasks(root: str | Path) -> list[HarborTask]:
    tasks = [read_task(path) for path in find_tasks(Path(root).expanduser())]
    names = [t.name for t in tasks]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise HarborTaskError(f"two Harbor tasks under {root} are named {duplicate!r}; give "
                              "each [task] name (or folder) its own name")
    return tasks


def harbor_family(path: str, *, extra_tools: Sequence[Tool] = (),
                  **settings: Any) -> TaskFamily:
    """The task family of the Harbor task folder(s) at `path`; `settings` are
    `HarborSettings` fields (the job's `[tasks.harbor]`)."""
    try:
        parsed = HarborSettings(**settings)
    except ValidationError as err:
        first = err.errors()[0]
        raise HarborTaskError(f"[tasks.harbor] {'.'.join(map(str, first['loc']))}: "
                              f"{first['msg']}") from None
    tasks = read_tasks(path)
    try:
        instances = [make_instance(task, parsed, extra_tools) for task in tasks]
    except ValidationError as err:
        first = err.errors()[0]
        raise HarborTaskError(f"[tasks.harbor] {err.title} {'.'.join(map(str, first['loc']))}: "
                              f"{first['msg']}; fix that setting") from None
    root = Path(path).expanduser().resolve()
    name = "harbor-" + (_SLUG.sub("-", root.name.lower()).strip("-.") or "tasks")

    def make(index: int, split: str) -> TaskInstance:
        return instances[index]

    return TaskFamily(name, make, size=len(instances),
                      description=f"Harbor tasks in {root}: " + ", ".join(t.name for t in tasks),
                      options={"path": str(root), **parsed.model_dump(mode="json")})


def task_of(instance: TaskInstance) -> HarborTask:
    """The Harbor task folder an instance was made from (for the oracle)."""
    return read_task(Path(str(instance.data["harbor_path"])))


async def run_oracle(sandbox: Sandbox, task: HarborTask) -> ExecResult:
    """Copy solution/ to /solution and run `bash /solution/solve.sh` in the work dir."""
    if "solve.sh" not in task.solution:
        raise HarborTaskError(f"harbor task {task.name} ({task.path}): solution/solve.sh is "
                              "missing; add it to check the task with its oracle")
    for path, text in task.solution.items():
        await sandbox.write_file(f"{SOLUTION_DIR}/{path}", text)
    return await sandbox.exec(["bash", f"{SOLUTION_DIR}/solve.sh"],
                              timeout=task.config.agent.timeout_sec)
