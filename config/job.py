"""The job config: one TOML file, one typed tree.

Every choice is a `Literal`; unknown keys are errors (with a did-you-mean hint); every problem
is reported on its own line naming the field, the bad value and what is allowed. `load_config`
is the only way a job reads its settings, so what `stalewise run --dry-run` prints is exactly
what runs.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from config.base import ConfigSection as Section
from config.base import Seed
from config.cluster import ClusterConfig
from config.engine import DEFAULT_STREAM_INTERVAL, EngineConfig
from config.errors import ConfigError, read_toml, validate
from config.harbor import HarborSettings
from config.learner import LearnerConfig
from config.sandbox_hosts import DockerHostConfig, check_distinct
from config.tools import ToolsConfig
from core.engine_api import KvPolicy

_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class RunConfig(Section):
    name: str = Field("run", description="human-readable run name, the start of the run's "
                      "id and of its folder under output_dir: letters, digits, '_', '.', '-'")
    db_url: str = Field("sqlite:///var/stalewise.db", description="SQLite path/URL or PostgreSQL URL")
    output_dir: str = Field("var/runs", description="checkpoints and reports go in OUTPUT_DIR/RUN_ID")
    seed: Seed = 0
    log_format: Literal["auto", "console", "json"] = "auto"
    progress_every_s: float = Field(5.0, gt=0, description="plain progress line period (no TTY)")
    store_outage_s: float = Field(
        120.0, ge=0, description="how long the orchestrator keeps retrying a store that cannot "
                                 "answer (disk full, PostgreSQL restarting) before the run fails; "
                                 "recorded rows wait in memory meanwhile")

    @field_validator("name")
    @classmethod
    def _name_fits_a_path(cls, name: str) -> str:
        if not _RUN_NAME.fullmatch(name):
            raise ValueError("a run name is 1-64 letters, digits, '_', '.' or '-', starting with "
                             "a letter or digit: it starts the run's id and its folder under "
                             "run.output_dir")
        return name


class ModelConfig(Section):
    path: str = Field("var/models/tiny", description="local Hugging Face checkpoint directory")
    create_tiny: bool = Field(True, description="create the tiny default model of run.seed if "
                              "PATH is missing (PATH-seedN beside a tiny model of another seed)")
    chat_format: Literal["auto", "hermes", "template", "qwen2.5", "qwen3", "llama3.1",
                         "mistral-v0.3"] = Field(
        "auto", description="auto = the family recognised from the checkpoint's chat template, "
                            "else its template, else hermes (docs/tasks.md, Chat formats)")
    tool_listing: Literal["json", "names", "none"] = Field(
        "json", description="how tools are described in the prompt (none keeps prompts short "
                            "for tiny models trained on demonstrations)")

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "warm_start" in data:
            raise ValueError("model.warm_start moved to [learner.sft] (enabled, demonstrations, "
                             "wrong_fraction, steps, batch_size, lr): rename the table")
        return data

    def missing_checkpoint(self) -> str | None:
        """Why a job cannot start from `path`, or None: no tiny model is to be made there and it
        holds no checkpoint (read by `stalewise run`'s checks and by the job itself)."""
        if self.create_tiny or (Path(self.path) / "config.json").exists():
            return None
        return (f"{self.path} holds no checkpoint (config.json missing); point it at a Hugging "
                "Face model directory or set model.create_tiny = true")


class SandboxConfig(Section):
    """How sandboxes are provided; what each task gets (image, limits) is the task's spec."""

    backend: Literal["docker", "local"] = "docker"
    pool_size: int = Field(8, ge=0, description="warm containers kept ready per task spec")
    max_live: int = Field(64, ge=1, description="containers alive at once at most, per spec")
    reuse: bool = Field(False, description="reuse containers after a reset (opt-in)")
    hosts: list[DockerHostConfig] = Field(
        default_factory=list, description="Docker engines to spread sandboxes over, each a URL "
        "or { url, capacity }; empty: the engine at $DOCKER_HOST (docs/sandboxes.md)")

    @model_validator(mode="after")
    def _pool_fits(self) -> "SandboxConfig":
        if self.pool_size > self.max_live:
            raise ValueError(f"sandbox.pool_size ({self.pool_size}) exceeds sandbox.max_live "
                             f"({self.max_live}); lower pool_size or raise max_live")
        if self.hosts and self.backend != "docker":
            raise ValueError("sandbox.hosts lists Docker engines but sandbox.backend is "
                             f"{self.backend!r}; set backend = \"docker\" or remove hosts")
        check_distinct(self.hosts)
        return self


class TasksConfig(Section):
    family: str = Field("arith", description="entry-point name or 'path/to/file.py:attribute'")
    options: dict[str, Any] = Field(default_factory=dict, description="passed to the family")
    eval_instances: int = Field(64, ge=0, description="held-out instances for before/after eval")
    eval_split: Literal["test", "validation"] = Field(
        "test", description="the split the before/after evaluations read: test for the figures "
        "a job reports; validation while you tune settings, so the test split stays untouched")
    eval_before: bool = Field(True, description="evaluate the starting weights before RL "
                              "(stalewise compare turns this off for a run whose starting "
                              "checkpoint another run already evaluated the same way)")
    harbor: HarborSettings = Field(default_factory=HarborSettings,
                                   description="how family = 'harbor:PATH' tasks run")

    def family_options(self) -> dict[str, Any]:
        """What the family factory gets: `options`, plus `[tasks.harbor]` for Harbor folders."""
        if self.family.strip().startswith("harbor:"):
            return {**self.harbor.model_dump(), **self.options}
        return dict(self.options)


class RolloutConfig(Section):
    group_size: int = Field(4, ge=1, description="samples per task instance (G)")
    max_concurrent: int = Field(32, ge=1, description="trajectories in flight at most")
    temperature: float = Field(1.0, gt=0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    logprobs_topk: int = Field(0, ge=0, description="record the sampler's top-k (score centering)")
    max_turns: int | None = Field(None, ge=1, description="override the tasks' max turns")
    max_tokens_per_turn: int = Field(128, ge=1)
    wall_time_s: float | None = Field(None, gt=0, description="override the tasks' wall time")
    max_malformed: int = Field(2, ge=0, description="malformed tool calls tolerated per trajectory")


class AdmissionConfig(Section):
    max_lag: int = Field(2, ge=0, description="policy versions a trajectory may lag")
    stale: Literal["drop", "requeue", "keep"] = "drop"
    cancel_stale: bool = Field(
        False, description="with stale = \"drop\" (async and inflight): stop a trajectory in "
        "flight as soon as it can no longer be admitted within max_lag (its first token's "
        "version is too old for the version that would train it), instead of generating it to "
        "the end to drop it; it ends `aborted`, decided as `stale_cancel`")
    timeout: Literal["fail", "mask", "drop"] = "fail"
    zero_variance: Literal["drop", "keep"] = "keep"
    overlong: Literal["keep", "penalize", "mask", "drop"] = "keep"
    overlong_cache_len: int = Field(32, ge=0, description="DAPO soft-punishment window")
    overlong_factor: float = Field(1.0, ge=0)
    group_completion: Literal["wait", "stream"] = "wait"
    min_group_size: int = Field(2, ge=1, description="valid members a group needs to be scored")
    reweight: Literal["none", "propensity"] = Field(
        "none", description="propensity: weight each admitted trajectory by generated/admitted "
        "of its (family, difficulty, duration quartile) bucket, so the weighted training mix "
        "is the generated one (core/selection.py); the learner scales its advantage by it")
    reweight_clip: float = Field(5.0, ge=1.0, description="the largest weight (and 1/clip the "
                                                          "smallest)")
    reweight_window: int = Field(4096, ge=8, description="recent finished trajectories the "
                                                         "weights are estimated from")
    pacing_tv: float | None = Field(
        None, gt=0, lt=1, description="pacing: hold dispatch while the admitted mix of the last "
        "pacing_window decided trajectories is further than this TV from the generated one "
        "(by difficulty or by duration quartile); the learner then waits for the slow work in "
        "flight instead of outrunning it. None = off")
    pacing_window: int = Field(256, ge=32, description="decided trajectories pacing looks at")
    order: Literal["ready_first", "in_order", "weight_fifo"] = Field(
        "ready_first", description="the order decided groups enter the learner stream: as "
        "they are decided, in dispatch order, or older weights first (orchestrator/release.py)")


    @model_validator(mode="after")
    def _order_needs_whole_groups(self) -> "AdmissionConfig":
        if self.order != "ready_first" and self.group_completion != "wait":
            raise ValueError(f"admission.order = {self.order!r} releases whole decided groups; "
                             "it needs group_completion = \"wait\" (or order = \"ready_first\")")
        if self.cancel_stale and self.stale != "drop":
            raise ValueError(f"admission.cancel_stale stops work that stale = \"drop\" would "
                             f"drop; with stale = {self.stale!r} that work is still used: set "
                             "stale = \"drop\" or cancel_stale = false")
        return self


class PipelineConfig(Section):
    mode: Literal["sync", "async", "inflight"] = "async"
    kv: KvPolicy = "recompute"
    steps: int = Field(20, ge=1, description="learner steps of the RL phase (the batch size "
                       "and the weight refresh period are learner.batch_size and "
                       "learner.publish_every)")
    max_queue: int = Field(128, ge=1, description="admitted but unconsumed trajectories at most")
    reserve: Literal["every", "expected"] | float = Field(  # range: _reserve_is_named_or_a_share
        "every", description="how the async staleness bound counts the trajectories in flight: "
        "`every` as one future admission each (AReaL's bound: no admitted trajectory is ever "
        "pushed past max_lag by others), `expected` as the share admitted so far (more in "
        "flight and more throughput when admission drops much, at the price of more stale "
        "drops and a larger selection skew; bench/pipeline.py --reserve expected), or a number "
        "x in [0, 1] as the share admitted so far but never less than x (1 is `every`, 0 is "
        "`expected`; in between, a point on the throughput-skew trade-off: docs/pipeline.md)")
    budget_s: float | None = Field(
        None, gt=0, description="stop the RL phase after this many seconds even if `steps` "
                                "are not done (stalewise compare sets it); None = no limit")

    @property
    def reserve_floor(self) -> float:
        """The least stream share one trajectory in flight reserves: 1 for `every`, 0 for
        `expected`, else `reserve` itself (the share admitted so far counts where higher)."""
        named = {"every": 1.0, "expected": 0.0}
        return named[self.reserve] if isinstance(self.reserve, str) else self.reserve

    @field_validator("reserve", mode="before")
    @classmethod
    def _reserve_is_named_or_a_share(cls, value: Any) -> Any:
        if value in ("every", "expected") or (
                isinstance(value, (int, float)) and not isinstance(value, bool)
                and 0.0 <= value <= 1.0):
            return value
        raise ValueError("use \"every\", \"expected\" or a number from 0 to 1 (the least "
                         "share of a stream position that each trajectory in flight reserves)")


class JobConfig(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    tasks: TasksConfig = Field(default_factory=TasksConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    # which of "learner", "learner.sft", "engine" took their seed from run.seed (with_one_seed)
    _seeds_from_run: frozenset[str] = PrivateAttr(default_factory=frozenset)

    @model_validator(mode="after")
    def _consistent(self) -> "JobConfig":
        if self.rollout.group_size < self.admission.min_group_size \
                and self.learner.advantage.estimator != "gae":
            raise ValueError(
                f"rollout.group_size = {self.rollout.group_size} is below "
                f"admission.min_group_size = {self.admission.min_group_size}: group baselines "
                f"need at least that many samples; raise rollout.group_size or use "
                f"learner.advantage.estimator = 'gae'")
        if self.cluster.backend == "ray" and not is_postgres_url(self.run.db_url):
            raise ValueError(
                f"cluster.backend = 'ray' needs one store every node reaches, but run.db_url = "
                f"{self.run.db_url!r} is SQLite (a file on this machine); set run.db_url to a "
                f"PostgreSQL URL, e.g. 'postgresql+psycopg://USER@HOST:5432/DB'")
        self._stream_interval_fits()
        return self

    def _stream_interval_fits(self) -> None:
        interval = self.engine.stream_interval
        if interval is None:
            return
        if self.engine.kind != "vllm":
            raise ValueError(f"engine.stream_interval = {interval} is a setting of vLLM's "
                             f"streamed replies; engine.kind = {self.engine.kind!r} answers "
                             f"each call in one reply: remove engine.stream_interval")
        if interval > 1 and self.pipeline.mode == "inflight":
            raise ValueError(f"engine.stream_interval = {interval} with pipeline.mode = "
                             f"'inflight': vLLM would hold up to {interval} sampled tokens "
                             f"before streaming them, so tokens sampled before a weight swap "
                             f"would arrive after it and be recorded under the new version; "
                             f"set engine.stream_interval = 1 (or leave it out), or use "
                             f"pipeline.mode = 'async'")

    def engine_stream_interval(self) -> int:
        """Sampled tokens vLLM streams per event: `engine.stream_interval`, or 16 (1 in
        `inflight` pipelines, whose swaps may fall inside a call; 1 where nothing streams)."""
        if self.engine.stream_interval is not None:
            return self.engine.stream_interval
        if self.engine.kind != "vllm" or self.pipeline.mode == "inflight":
            return 1
        return DEFAULT_STREAM_INTERVAL

    def engine_connections(self) -> int:
        """Connections the orchestrator keeps to each engine: `engine.max_connections`, or one
        per trajectory in flight. A trajectory has at most one model call at the engine, so with
        fewer the calls beyond the connections queue in the client, and the engine's batch
        never sees them."""
        return self.engine.max_connections or self.rollout.max_concurrent


def is_postgres_url(url: str) -> bool:
    return url.split("://", 1)[0].split("+", 1)[0] in ("postgresql", "postgres")


def parse_config(data: dict[str, Any], source: str = "<config>") -> JobConfig:
    return with_one_seed(validate(JobConfig, data, source))


def with_one_seed(job: JobConfig) -> JobConfig:
    """`run.seed` seeds every process unless its section sets a seed of its own: the learner
    (torch), its warm start (`[learner.sft] seed`: the demonstrations and their order; the
    learner's seed when not set) and the engine (`[engine] seed`: sampling). The resolved seeds
    are in the config the run stores (`runs.config`) and hands its children; the job remembers
    which it derived, so `with_seed` derives them again."""
    derived = {name for name, section in (("learner", job.learner),
                                           ("learner.sft", job.learner.sft),
                                           ("engine", job.engine))
               if "seed" not in section.model_fields_set}
    return _seeded(job, job.run.seed, frozenset(derived))


def with_seed(job: JobConfig, seed: int) -> JobConfig:
    """The job with `run.seed = seed` and every seed it derived from `run.seed` derived again
    (what `--set run.seed=N` on the command line gives)."""
    return _seeded(job.model_copy(update={"run": job.run.model_copy(update={"seed": seed})}),
                   seed, job._seeds_from_run)


def _seeded(job: JobConfig, seed: int, derived: frozenset[str]) -> JobConfig:
    learner, engine = job.learner, job.engine
    if "learner" in derived:
        learner = learner.model_copy(update={"seed": seed})
    if "learner.sft" in derived:
        learner = learner.model_copy(update={"sft": learner.sft.model_copy(
            update={"seed": learner.seed})})
    if "engine" in derived:
        engine = engine.model_copy(update={"seed": seed})
    out = job.model_copy(update={"learner": learner, "engine": engine})
    out._seeds_from_run = derived
    return out


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> JobConfig:
    """The job config in `path`, with `overrides` ("section.key=value", the value a TOML
    literal or else a plain string) applied before validation."""
    data = read_with_base(Path(path), ())
    for item in overrides:
        apply_override(data, item, str(path))
    return parse_config(data, str(path))


def read_with_base(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    """The TOML file merged over the file its top-level `extends = "base.toml"` names (a path
    relative to it; bases may extend further): tables, inline ones too, merge key by key; any
    other value the file sets (a list included) replaces the base's."""
    data = read_toml(path, "a TOML job config")
    base = data.pop("extends", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(str(path), [f"extends = {base!r}: give the base config's path as a "
                                      f"string, e.g. extends = \"long.toml\""])
    seen = (*seen, path.resolve())
    base_path = (path.parent / base).resolve()
    if base_path in seen:
        raise ConfigError(str(path), [f"extends = {base!r}: the configs extend each other in "
                                      f"a loop"])
    if not base_path.exists():
        raise ConfigError(str(path), [f"extends = {base!r}: {base_path} does not exist (the "
                                      f"path is relative to {path.parent})"])
    return merged(read_with_base(base_path, seen), data)


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def apply_override(data: dict[str, Any], item: str, source: str) -> None:
    dotted, sep, text = item.partition("=")
    if not sep or not dotted.strip():
        raise ConfigError(source, [f"--set {item!r}: write it as section.key=value, "
                                   f"e.g. --set run.seed=1"])
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    node = data
    *parents, leaf = dotted.strip().split(".")
    for key in parents:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(source, [f"--set {item!r}: {key} is a value, not a table"])
        node = child
    node[leaf] = value
