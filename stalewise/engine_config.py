"""The engine's settings, defined once: the job's `[engine]` section and the engine child's
config file are the same model.

`EngineServerConfig` is what the engine process itself uses; the job writes it as
`engine.json` next to `learner.json` and the child reads it with `--config` (the flags of
`stalewise engine serve` override single fields and take their defaults from here).
`EngineConfig` adds how the orchestrator starts or reaches the engine.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from stalewise.config_base import ConfigSection


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
    served_model_name: str | None = Field(None, description="name in /v1/models (default: path)")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "warning"

    def server_fields(self) -> "EngineServerConfig":
        return EngineServerConfig(**{k: getattr(self, k) for k in EngineServerConfig.model_fields})


class EngineConfig(EngineServerConfig):
    """The job's `[engine]` section."""

    kind: Literal["embedded", "vllm"] = "embedded"
    url: str | None = Field(None, description="attach to a running engine instead of starting one")
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    request_timeout_s: float = Field(600.0, gt=0)
    startup_timeout_s: float = Field(120.0, gt=0)
    extra_args: list[str] = Field(default_factory=list, description="extra `vllm serve` arguments")
    replicas: int = Field(1, ge=1, description="engine servers the job starts (placed by Ray "
                                               "when cluster.backend = 'ray')")
