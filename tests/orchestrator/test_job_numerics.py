"""The run summary's numerics: the dtypes the children resolve, and the sampler/trainer gaps
the learner's gap probe measured, combined over steps as the summary states them."""

from __future__ import annotations

from types import SimpleNamespace

from config.job import parse_config
from core.numerics import resolve_dtype
from engine.tiny import init_tiny
from orchestrator.job import precision_gaps, run_numerics


def _step(tokens: float, f32: tuple[float, float, float], bf16: tuple[float, float, float]):
    metrics = {"numerics/gap_tokens": tokens}
    for dtype, values in (("float32", f32), ("bfloat16", bf16)):
        metrics.update({f"numerics/gap_{dtype}_{k}": v
                        for k, v in zip(("mean", "p99", "max"), values)})
    return SimpleNamespace(metrics=metrics)


def test_gaps_are_token_weighted_means_and_worst_p99_and_max():
    store = SimpleNamespace(learner_steps=lambda run_id: [
        _step(100, (1e-5, 3e-5, 4e-5), (0.01, 0.05, 0.2)),
        SimpleNamespace(metrics={"loss/policy": 0.1}),  # a step without the probe
        _step(300, (2e-5, 2e-5, 9e-5), (0.03, 0.04, 0.1))])
    gap = precision_gaps(store, "r")["sampler_trainer_gap"]
    assert gap["tokens"] == 400
    assert gap["float32"] == {"mean": 1.75e-5, "p99": 3e-5, "max": 9e-5}
    assert gap["bfloat16"] == {"mean": 0.025, "p99": 0.05, "max": 0.2}
    assert precision_gaps(SimpleNamespace(learner_steps=lambda run_id: []), "r") == {}


def test_numerics_name_what_the_engine_and_learner_resolve_here(tmp_path):
    model = init_tiny(tmp_path / "tiny")
    job = parse_config({"model": {"path": str(model)}, "engine": {"dtype": "bfloat16"}})
    numerics = run_numerics(job, model)
    assert numerics["engine_dtype"] == "bfloat16"
    assert numerics["learner_dtype"] == resolve_dtype("auto", hidden_size=128) == "float32"
    assert isinstance(numerics["cpu_bf16"], list) and numerics["cpu"]
    remote = parse_config({"model": {"path": str(model)}, "engine": {"url": "http://127.0.0.1:1"}})
    assert run_numerics(remote, model)["engine_dtype"] is None
