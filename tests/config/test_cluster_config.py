"""`[cluster]`: local by default; Ray only with one store every node reaches (PostgreSQL)."""

from __future__ import annotations

import pytest

from config.errors import ConfigError
from config.job import parse_config


def test_local_is_the_default_and_any_store_works():
    job = parse_config({})
    assert job.cluster.backend == "local"
    assert job.engine.replicas == 1 and job.learner.workers == 1


def test_ray_with_sqlite_is_refused_with_the_fix():
    with pytest.raises(ConfigError) as err:
        parse_config({"cluster": {"backend": "ray"},
                      "run": {"db_url": "sqlite:///var/stalewise.db"}})
    message = str(err.value)
    assert "cluster.backend = 'ray'" in message and "run.db_url" in message
    assert "PostgreSQL URL" in message


@pytest.mark.parametrize("url", ["postgresql+psycopg://u@db:5432/x", "postgresql://u@/x",
                                 "postgres://u@h/x"])
def test_ray_with_postgresql_is_accepted(url):
    job = parse_config({"cluster": {"backend": "ray", "address": "10.0.0.1:6379",
                                    "engine": {"gpus": 1, "resources": {"inference": 1}}},
                        "run": {"db_url": url}, "engine": {"replicas": 2}})
    assert job.cluster.engine.gpus == 1 and job.engine.replicas == 2


def test_zero_custom_resource_and_zero_replicas_are_refused():
    with pytest.raises(ConfigError, match="drop the key"):
        parse_config({"cluster": {"learner": {"resources": {"trainer": 0}}}})
    with pytest.raises(ConfigError, match="replicas"):
        parse_config({"engine": {"replicas": 0}})
