"""The engine's config reaches the engine child whole: every `EngineServerConfig` field, set to
a value that is not its default, is what the running server reports in /stalewise/info."""

from __future__ import annotations

import httpx
import pytest

from config.engine import EngineConfig, EngineServerConfig
from config.errors import ConfigError
from config.job import parse_config
from orchestrator.engines.launch import start_engine

NOT_DEFAULT = EngineServerConfig(max_batch=5, session_cache_mb=3.5, max_resident_versions=2,
                                 max_model_len=96, max_prefill_tokens=77, threads=2, dtype="bfloat16",
                                 served_model_name="cfg-check", log_level="error")


def test_the_check_sets_every_field_to_something_else_than_its_default():
    defaults = EngineServerConfig()
    same = [name for name in EngineServerConfig.model_fields
            if getattr(NOT_DEFAULT, name) == getattr(defaults, name)]
    assert same == []


def test_every_engine_config_field_reaches_the_engine_child(model_v0, tmp_path):
    with start_engine(model_v0, NOT_DEFAULT, config_path=tmp_path / "engine.json") as p:
        info = httpx.get(f"{p.url}/stalewise/info", timeout=30).json()
    assert info["config"] == NOT_DEFAULT.model_dump()
    assert EngineServerConfig.model_validate_json((tmp_path / "engine.json").read_text()) \
        == NOT_DEFAULT


def test_the_job_engine_section_is_the_engine_config_plus_how_to_reach_it():
    job = parse_config({"engine": {**NOT_DEFAULT.model_dump(), "port": 9}})
    assert isinstance(job.engine, EngineConfig)
    assert job.engine.server_fields() == NOT_DEFAULT
    with pytest.raises(ConfigError, match="session_budget_mb"):
        parse_config({"engine": {"session_budget_mb": 1}})
