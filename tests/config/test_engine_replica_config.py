"""`[engine] replicas` / `urls`: the default is one engine; conflicting settings are clear errors."""

from __future__ import annotations

import pytest

from config.errors import ConfigError
from config.job import parse_config


def engine(**fields):
    return parse_config({"engine": fields}).engine


def test_the_default_is_one_engine_and_no_router():
    cfg = engine()
    assert cfg.replicas == 1 and cfg.urls == [] and cfg.replica_count == 1


def test_replicas_and_urls_count_the_engines():
    assert engine(replicas=3).replica_count == 3
    assert engine(urls=["http://a:1", "http://b:2"]).replica_count == 2


@pytest.mark.parametrize("fields, message", [
    (dict(url="http://a:1", urls=["http://b:2"]), "engine.url and engine.urls are both set"),
    (dict(replicas=2, urls=["http://a:1", "http://b:2"]),
     "with urls the replica count is the number of URLs"),
    (dict(replicas=2, url="http://a:1"), "engine.url attaches to running ones"),
    (dict(replicas=2, kind="vllm"), "list their URLs in engine.urls"),
    (dict(replicas=2, port=8000), "leave port at 0"),
    (dict(urls=["http://a:1", "http://a:1"]), "lists a URL twice"),
    (dict(replicas=0), "replicas"),
])
def test_conflicting_engine_settings_say_what_to_change(fields, message):
    with pytest.raises(ConfigError, match=message):
        engine(**fields)


def test_the_engine_process_never_sees_the_replica_settings():
    assert "replicas" not in engine(replicas=2).server_fields().model_dump()
