"""The job config: one TOML file, one typed tree.

Every choice is a `Literal`; unknown keys are errors (with a did-you-mean hint); every problem
is reported on its own line naming the field, the bad value and what is allowed. `load_config`
is the only way a job reads its settings, so what `stalewise run --dry-run` prints is exactly
what runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from learner.config import LearnerConfig
from stalewise.config_errors import read_toml, validate


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunConfig(Section):
    name: str = Field("run", description="human-readable run name")
    db_url: str = Field("sqlite:///var/stalewise.db", description="SQLite path/URL or PostgreSQL URL")
    output_dir: str = Field("var/runs", description="checkpoints and reports go in OUTPUT_DIR/RUN_ID")
    seed: int = 0
    log_format: Literal["auto", "console", "json"] = "auto"
    progress_every_s: float = Field(5.0, gt=0, description="plain progress line period (no TTY)")


class WarmStartConfig(Section):
    """Supervised warm start on synthetic demonstrations before RL."""

    enabled: bool = False
    demonstrations: int = Field(256, ge=1, description="number of demonstrations to train on")
    wrong_fraction: float = Field(0.0, ge=0.0, le=1.0, description="share of wrong demonstrations")
    steps: int = Field(200, ge=1)
    batch_size: int = Field(16, ge=1)
    lr: float = Field(3e-3, gt=0)


class ModelConfig(Section):
    path: str = Field("var/models/tiny", description="local Hugging Face checkpoint directory")
    create_tiny: bool = Field(True, description="create the tiny default model if PATH is missing")
    chat_format: Literal["auto", "hermes", "template", "qwen2.5", "qwen3", "llama3.1",
                         "mistral-v0.3"] = Field(
        "auto", description="auto = the family recognised from the checkpoint's chat template, "
                            "else its template, else hermes (docs/tasks.md, Chat formats)")
    tool_listing: Literal["json", "names", "none"] = Field(
        "json", description="how tools are described in the prompt (none keeps prompts short "
                            "for tiny models trained on demonstrations)")
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)


class EngineConfig(Section):
    kind: Literal["embedded", "vllm"] = "embedded"
    url: str | None = Field(None, description="attach to a running engine instead of starting one")
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    max_batch: int = Field(64, ge=1, description="sequences decoded together at most")
    request_timeout_s: float = Field(600.0, gt=0)
    startup_timeout_s: float = Field(120.0, gt=0)
    extra_args: list[str] = Field(default_factory=list, description="extra `vllm serve` arguments")


class SandboxConfig(Section):
    """How sandboxes are provided; what each task gets (image, limits) is the task's spec."""

    backend: Literal["docker", "local"] = "docker"
    pool_size: int = Field(8, ge=0, description="warm containers kept ready per task spec")
    max_live: int = Field(64, ge=1, description="containers alive at once at most, per spec")
    reuse: bool = Field(False, description="reuse containers after a reset (opt-in)")

    @model_validator(mode="after")
    def _pool_fits(self) -> "SandboxConfig":
        if self.pool_size > self.max_live:
            raise ValueError(f"sandbox.pool_size ({self.pool_size}) exceeds sandbox.max_live "
                             f"({self.max_live}); lower pool_size or raise max_live")
        return self


class TasksConfig(Section):
    family: str = Field("arith", description="entry-point name or 'path/to/file.py:attribute'")
    options: dict[str, Any] = Field(default_factory=dict, description="passed to the family")
    eval_instances: int = Field(64, ge=0, description="held-out instances for before/after eval")


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
    timeout: Literal["fail", "mask", "drop"] = "fail"
    zero_variance: Literal["drop", "keep"] = "keep"
    overlong: Literal["keep", "penalize", "mask", "drop"] = "keep"
    overlong_cache_len: int = Field(32, ge=0, description="DAPO soft-punishment window")
    overlong_factor: float = Field(1.0, ge=0)
    group_completion: Literal["wait", "stream"] = "wait"
    min_group_size: int = Field(2, ge=1, description="valid members a group needs to be scored")


class PipelineConfig(Section):
    mode: Literal["sync", "async", "inflight"] = "async"
    kv: Literal["retain", "recompute"] = "recompute"
    steps: int = Field(20, ge=1, description="learner steps of the RL phase (the batch size "
                       "and the weight refresh period are learner.batch_size and "
                       "learner.publish_every)")
    max_queue: int = Field(128, ge=1, description="admitted but unconsumed trajectories at most")


class JobConfig(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    tasks: TasksConfig = Field(default_factory=TasksConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)

    @model_validator(mode="after")
    def _consistent(self) -> "JobConfig":
        if self.rollout.group_size < self.admission.min_group_size \
                and self.learner.advantage.estimator != "gae":
            raise ValueError(
                f"rollout.group_size = {self.rollout.group_size} is below "
                f"admission.min_group_size = {self.admission.min_group_size}: group baselines "
                f"need at least that many samples; raise rollout.group_size or use "
                f"learner.advantage.estimator = 'gae'")
        return self


def parse_config(data: dict[str, Any], source: str = "<config>") -> JobConfig:
    return validate(JobConfig, data, source)


def load_config(path: str | Path) -> JobConfig:
    return parse_config(read_toml(path, "a TOML job config"), str(path))
