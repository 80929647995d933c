"""`stalewise audit export` round trips on a real run's database.

- parquet and JSONL hold one row per sampled token, equal to what the store holds (ids,
  sampler log-probs, versions, times, loss mask) and to the learner's recorded log-probs;
- the Inspect eval log reads back with `inspect_ai.log.read_eval_log`: one sample per
  trajectory, the reward as its score, versions and admission in its metadata, and the
  conversation (the task prompt, then one assistant message per model call, tool results).
"""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from core.store import audit
from core.store.store import Store
from stalewise.cli import app

pytestmark = [pytest.mark.slow]
runner = CliRunner()


def _export(url: str, run_id: str, fmt: str, out) -> None:
    result = runner.invoke(app, ["audit", "export", "--run", run_id, "--url", url,
                                 "--format", fmt, str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output


def _expected_rows(url: str, run_id: str) -> list[dict]:
    store = Store.open_readonly(url)
    try:
        rows = []
        for t in audit.trajectories(store, run_id, limit=10_000):
            detail = audit.trajectory_detail(store, t["id"])
            for turn in detail["turns"]:
                for tok in turn["tokens"]:
                    rows.append((t["id"], turn["turn"], tok["position"], tok["id"], tok["text"],
                                 tok["sampler_logprob"], tok["version"], tok["kv_version"],
                                 tok["time_s"], tok["trainer_logprob"], tok["loss_mask"]))
        return rows
    finally:
        store.close()


def _as_tuple(row: dict) -> tuple:
    return (row["trajectory_id"], row["turn"], row["position"], row["token_id"], row["text"],
            row["sampler_logprob"], row["weights_version"], row["kv_version"], row["time_s"],
            row["trainer_logprob"], row["loss_mask"])


def _same(a: tuple, b: tuple) -> bool:
    for x, y in zip(a, b):
        if isinstance(x, float) or isinstance(y, float):
            if x is None or y is None or not math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-6):
                return False
        elif x != y:
            return False
    return True


def test_parquet_and_jsonl_hold_every_token_as_stored(real_run, tmp_path):
    url, run_id = real_run
    expected = sorted(_expected_rows(url, run_id), key=lambda r: (r[0], r[1], r[2]))
    assert expected and any(r[9] is not None for r in expected), "no trainer log-probs recorded"
    _export(url, run_id, "jsonl", tmp_path / "tokens.jsonl")
    _export(url, run_id, "parquet", tmp_path / "tokens.parquet")
    lines = [json.loads(line) for line in (tmp_path / "tokens.jsonl").read_text().splitlines()]
    import pyarrow.parquet as pq

    parquet_rows = pq.read_table(tmp_path / "tokens.parquet").to_pylist()
    assert len(parquet_rows) == len(lines) == len(expected)
    assert {r["run_id"] for r in parquet_rows} == {run_id}
    for exported in (lines, parquet_rows):
        got = sorted((_as_tuple(r) for r in exported), key=lambda r: (r[0], r[1], r[2]))
        mismatched = [(a, b) for a, b in zip(got, expected) if not _same(a, b)]
        assert not mismatched, mismatched[:3]


def test_inspect_log_reads_back_one_sample_per_trajectory(real_run, tmp_path):
    from inspect_ai.log import read_eval_log

    url, run_id = real_run
    _export(url, run_id, "inspect", tmp_path / "inspect")
    log = read_eval_log(str(tmp_path / "inspect" / f"{run_id}.eval"))
    store = Store.open_readonly(url)
    try:
        trajectories = audit.trajectories(store, run_id, limit=10_000)
        calls = {t["id"]: store.model_calls(t["id"]) for t in trajectories}
    finally:
        store.close()
    assert log.status == "success" and log.eval.run_id == run_id
    assert sorted(s.id for s in log.samples) == sorted(t["id"] for t in trajectories)
    by_id = {t["id"]: t for t in trajectories}
    for sample in log.samples:
        info = by_id[sample.id]
        assert sample.scores["reward"].value == (info["reward"] or 0.0)
        assert sample.metadata["purpose"] == info["purpose"]
        assert [sample.metadata["min_version"], sample.metadata["max_version"]] == info["versions"]
        assert sample.metadata["lag"] == info["lag"]
        roles = [m.role for m in sample.messages]
        assert roles[0] == "user" and roles.count("assistant") == len(calls[sample.id])
        assert sample.messages[0].text == sample.input
