"""`Store.write_batch`'s raw insert path (model and tool calls as the driver's executemany):
every column round-trips on SQLite and PostgreSQL, `sampling` may be a dict or JSON text, and
one batch is one transaction whose driver errors are still SQLAlchemy's (`DBAPIError`, which
the writer's outage handling reads)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sqlalchemy.exc import DBAPIError, IntegrityError

from core.records import SampledTokens
from core.store.store import Store, model_call_row

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(params=BACKENDS)
def store(request):
    url = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")
    store = Store.open(url, create=True)
    store.create_run("r", name="r", config={}, pipeline_mode="async")
    yield store
    store.close()


def _call(trajectory_id: int, turn: int, sampling) -> dict:
    tokens = SampledTokens([turn, 7], [-0.5, -1.5], [0, 0], [0, 0], [0.0, 0.25])
    return model_call_row(trajectory_id=trajectory_id, turn=turn, segment=0, context_len=4,
                          prompt_token_ids=[1, 2, 3], tokens=tokens, sampling=sampling,
                          engine_id="e", finish_reason="stop", cached_prompt_tokens=0,
                          started_at=100.0 + turn, finished_at=101.0 + turn)


def _tool(trajectory_id: int, turn: int, **values) -> dict:
    row = dict(trajectory_id=trajectory_id, turn=turn, index=0, name="python",
               arguments='{"code": "print(1)"}', observation="1\n", exit_code=0,
               error_type=None, timed_out=False, truncated=False, output_bytes=2,
               started_at=200.0 + turn, duration_s=0.5, reward=None)
    return {**row, **values}


def test_every_tool_call_column_round_trips(store):
    """Values that look like placeholders (`?`, `%s`, `:name`) are values, not SQL."""
    trajectory = store.create_trajectory("r", group_id=None, task_instance_id=None)
    rows = [_tool(trajectory, 0),
            _tool(trajectory, 1, name="sh", arguments='{"cmd": "echo %s ? :name"}',
                  observation="100% ? :turn \u00e9\u4e2d", exit_code=None, error_type="timeout",
                  timed_out=True, truncated=True, output_bytes=12, duration_s=30.0, reward=0.25)]
    store.write_batch(tool_calls=rows)
    read = store.tool_calls(trajectory)
    assert [{k: getattr(r, k) for k in rows[0]} for r in read] == rows


def test_sampling_may_be_a_dict_or_json_text(store):
    trajectory = store.create_trajectory("r", group_id=None, task_instance_id=None)
    store.write_batch(model_calls=[_call(trajectory, 0, {"temperature": 0.7, "top_k": 5}),
                                   _call(trajectory, 1, json.dumps({"temperature": 0.9}))])
    read = store.model_calls(trajectory)
    assert [c.sampling for c in read] == [{"temperature": 0.7, "top_k": 5}, {"temperature": 0.9}]
    assert [c.tokens.token_ids.tolist() for c in read] == [[0, 7], [1, 7]]
    assert np.array_equal(read[1].prompt_token_ids, [1, 2, 3])


def test_a_single_row_takes_the_same_path(store):
    trajectory = store.create_trajectory("r", group_id=None, task_instance_id=None)
    store.write_batch(model_calls=[_call(trajectory, 3, {"temperature": 1.0})],
                      tool_calls=[_tool(trajectory, 3)])
    assert [c.turn for c in store.model_calls(trajectory)] == [3]
    assert [c.turn for c in store.tool_calls(trajectory)] == [3]


def test_a_failing_row_rolls_back_the_whole_batch(store):
    """A tool call of a trajectory that does not exist breaks the batch after its model calls
    were inserted: none of them stays, and the error is SQLAlchemy's `IntegrityError`."""
    trajectory = store.create_trajectory("r", group_id=None, task_instance_id=None)
    with pytest.raises(IntegrityError) as raised:
        store.write_batch(model_calls=[_call(trajectory, 0, {}), _call(trajectory, 1, {})],
                          tool_calls=[_tool(trajectory, 0), _tool(trajectory + 999, 0)],
                          trajectory_updates=[(trajectory, {"status": "running"})])
    assert isinstance(raised.value, DBAPIError)
    assert store.model_calls(trajectory) == [] and store.tool_calls(trajectory) == []
    assert store.trajectory(trajectory).status == "queued"


def test_a_row_missing_a_required_column_is_refused_and_optional_ones_default(store):
    trajectory = store.create_trajectory("r", group_id=None, task_instance_id=None)
    row = _tool(trajectory, 0)
    del row["observation"]
    with pytest.raises(KeyError, match="observation"):
        store.write_batch(tool_calls=[row])
    assert store.tool_calls(trajectory) == []
    row = _tool(trajectory, 0)
    del row["reward"], row["timed_out"]  # nullable; a column with a default
    store.write_batch(tool_calls=[row])
    (stored,) = store.tool_calls(trajectory)
    assert stored.reward is None and stored.timed_out is False
