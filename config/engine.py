"""The engine's settings, defined once: the job's `[engine]` section and the engine child's
config file are the same model.

`EngineServerConfig` is what the engine process itself uses; the job writes it as
`engine.json` next to `learner.json` and the child reads it with `--config` (the flags of
`stalewise engine serve` override single fields and take their defaults from here).
`EngineConfig` adds how the orchestrator starts or reaches the engine.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from config.base import ConfigSection, Seed


class EngineServerConfig(ConfigSection):
    """Settings of the embedded engine process (the vLLM backend takes `extra_args`)."""

    max_batch: int = Field(64, ge=1, description="sequences decoded together at most")
    session_cache_mb: float = Field(256.0, ge=0.0, description="KV kept for sessions between turns")
    max_resident_versions: int = Field(
        4, ge=1, description="weights versions held at once for pinned requests (async mode)")
    max_model_len: int | None = Field(
        None, ge=2, description="context length cap (default: the model's); bounds KV memory")
    max_prefill_tokens: int = Field(4096, ge=1, description="prompt tokens prefilled per step")
    threads: int = Field(1, ge=1, description="torch CPU threads (1 is fastest for tiny models)")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="weights, KV and products; 'auto': bfloat16 on a CPU with bfloat16 "
        "instructions (AMX or AVX-512-BF16) for a model at least 512 wide, else float32 "
        "(core.numerics); logits and log-probs are float32 either way")
    served_model_name: str | None = Field(None, description="name in /v1/models (default: path)")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "warning"

    def server_fields(self) -> "EngineServerConfig":
        return EngineServerConfig(**{k: getattr(self, k) for k in EngineServerConfig.model_fields})


# tokens per streamed vLLM event where a job does not say (JobConfig.engine_stream_interval)
DEFAULT_STREAM_INTERVAL = 16


class EngineConfig(EngineServerConfig):
    """The job's `[engine]` section."""

    kind: Literal["embedded", "vllm"] = "embedded"
    url: str | None = Field(None, description="attach to a running engine instead of starting one")
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    request_timeout_s: float = Field(600.0, gt=0)
    max_connections: int | None = Field(
        None, ge=1, description="connections the orchestrator keeps to each engine, opened on "
        "first use (default: rollout.max_concurrent, one per trajectory in flight, so no model "
        "call waits in the orchestrator for a free connection)")
    stream_interval: int | None = Field(
        None, ge=1, description="vLLM only: sampled tokens vLLM streams per event (the first "
        "token comes alone, the last with what is left). Default: 16, or 1 with pipeline mode "
        "'inflight', where a weight swap can fall inside a call and each token is recorded "
        "under the version that was served when it arrived; 1 is one event per token")
    startup_timeout_s: float = Field(120.0, gt=0)
    extra_args: list[str] = Field(default_factory=list, description="extra `vllm serve` arguments")
    replicas: int = Field(1, ge=1, description="engine processes the job starts, each on its "
                                                "own port (placed by Ray when cluster.backend = "
                                                "'ray'); sessions stick to one")
    urls: list[str] = Field(default_factory=list, description="several running engines (replicas) "
                                                              "instead of one `url`")
    replica_health_interval_s: float = Field(2.0, gt=0, description="seconds between probes")
    replica_health_failures: int = Field(3, ge=1, description="failed probes in a row: down")
    replica_max_restarts: int = Field(3, ge=0, description="restarts of each local replica")
    seed: Seed = Field(0, description="the sampler's seed for requests without their own (replica "
                      "i: seed + i), and the base of the evaluations' per-call seeds; in a job, "
                      "run.seed unless set here")

    @model_validator(mode="after")
    def _one_way_to_reach(self) -> "EngineConfig":
        if self.urls and self.url is not None:
            raise ValueError("engine.url and engine.urls are both set: list every running engine "
                             "in urls (one replica each) and remove url")
        if self.replicas > 1 and (self.urls or self.url is not None):
            raise ValueError(f"engine.replicas = {self.replicas} starts engine processes, but "
                             f"engine.{'urls' if self.urls else 'url'} attaches to running ones: "
                             f"with urls the replica count is the number of URLs; remove one")
        if self.replicas > 1 and self.kind == "vllm":
            raise ValueError("engine.replicas > 1 starts embedded engines only; for several vLLM "
                             "servers start each with `vllm serve` and list their URLs in "
                             "engine.urls")
        if self.replicas > 1 and self.port != 0:
            raise ValueError(f"engine.port = {self.port} cannot be shared by "
                             f"{self.replicas} replicas; leave port at 0 (each picks a free one)")
        if len(set(self.urls)) != len(self.urls):
            raise ValueError("engine.urls lists a URL twice; list each running engine once")
        return self

    @property
    def replica_count(self) -> int:
        """How many engines the job talks to (1: one client, no router)."""
        return len(self.urls) if self.urls else self.replicas
