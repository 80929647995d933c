"""The viewer's pages over HTTP (Starlette's test client), without a browser.

- escaping: `esc` leaves no markup or raw control characters; `json_for_script` cannot close
  its script element;
- charts: missing values break a line instead of being drawn at zero; an empty series says
  "no data";
- a long trajectory is paginated: 4,000 token spans a page, the rest linked;
- bad query parameters are a 400 with a one-line message, unknown ids a 404; every page sends
  the Content-Security-Policy.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from starlette.testclient import TestClient

from core.records import SampledTokens
from core.store.store import Store, model_call_row
from core.tiny_tokenizer import save_tiny_tokenizer
from viewer.app import create_app
from viewer.html import esc, json_for_script
from viewer.svg import line_chart
from viewer.trajectory import TOKENS_PER_PAGE


def test_esc_leaves_no_markup_and_shows_control_characters():
    out = esc('<script>"\'&\x00\x1b\x7f\n')
    assert not set("<>\"'") & set(out.replace("&lt;", "").replace("&gt;", "")
                                   .replace("&quot;", "").replace("&#x27;", "")
                                   .replace("&amp;", ""))
    assert "\\x00" in out and "\\x1b" in out and "\\x7f" in out and "\n" in out
    assert esc(None) == ""


def test_json_for_script_cannot_close_the_script_element():
    text = json_for_script({"t": "</script><script>alert(1)</script><!--"})
    assert "<" not in text and ">" not in text
    assert json.loads(text) == {"t": "</script><script>alert(1)</script><!--"}


def test_line_chart_breaks_at_missing_values():
    svg = line_chart("loss", [1, 2, 3, 4, 5], {"loss": [1.0, 2.0, None, 3.0, 4.0]})
    assert svg.count("<polyline") == 2
    assert "no data" in line_chart("loss", [1, 2], {"loss": [None, None]})


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def client(tmp_path, request):
    model = tmp_path / "model"
    tokenizer = save_tiny_tokenizer(model)
    url = (request.getfixturevalue("pg_url") if request.param == "postgresql"
           else f"sqlite:///{tmp_path / 'v.db'}")
    store = Store.open(url, create=True)
    store.create_run("r1", name="long", config={"model": {"path": str(model)}},
                     pipeline_mode="inflight")
    task = store.task_instance_id("r1", family="f", key="k", content_hash="h",
                                  prompt="count the abc")
    trajectory = store.create_trajectory("r1", group_id=None, task_instance_id=task)
    ids = np.array(tokenizer.encode("abc " * 2500, add_special_tokens=False), np.int32)
    n = len(ids)
    store.insert_model_calls([model_call_row(
        trajectory_id=trajectory, turn=turn, segment=0, context_len=0, prompt_token_ids=[5],
        tokens=SampledTokens(ids, np.full(n, -0.5), np.r_[np.zeros(n // 2), np.ones(n - n // 2)],
                             np.zeros(n), np.zeros(n)),
        sampling={}, engine_id="e", finish_reason="length", cached_prompt_tokens=0,
        started_at=0.0, finished_at=1.0) for turn in range(2)])
    store.update_trajectory(trajectory, status="completed", num_sampled_tokens=2 * n)
    store.close()
    reader = Store.open_readonly(url)
    yield TestClient(create_app(reader)), trajectory, 2 * n
    reader.close()


def test_a_long_trajectory_is_paginated(client):
    http, trajectory, total = client
    assert total == 20_000
    first = http.get(f"/trajectories/{trajectory}")
    assert first.status_code == 200
    assert first.text.count('class="t"') == TOKENS_PER_PAGE
    assert f"token page 1 of {total // TOKENS_PER_PAGE}" in first.text
    data = json.loads(re.search(r'id="token-data">(.*?)</script>', first.text).group(1))
    assert len(data["id"]) == TOKENS_PER_PAGE and data["tlp"][0] is None
    # each turn has 10,000 tokens and a weights update after its 5,000th: positions 5,000 and
    # 15,000 of the trajectory, on token pages 2 and 4
    marks = [http.get(f"/trajectories/{trajectory}?page={n}").text.count('class="vb"')
             for n in range(1, 6)]
    assert marks == [0, 1, 0, 1, 0]
    last = http.get(f"/trajectories/{trajectory}?page=5")
    assert last.text.count('class="t"') == TOKENS_PER_PAGE
    assert "[6000 earlier tokens on" in last.text


def test_bad_queries_and_unknown_ids(client):
    http, _, _ = client
    bad = http.get("/runs/r1/trajectories?min_lag=two")
    assert bad.status_code == 400 and "min_lag=&#x27;two&#x27; is not an integer" in bad.text
    assert http.get("/runs/r1/trajectories?sort=colour").status_code == 400
    assert http.get("/runs/nope").status_code == 404
    assert http.get("/trajectories/999").status_code == 404
    # numbers past SQL's 64-bit integers were HTTP 500s (OverflowError in the driver)
    huge = "99999999999999999999"
    assert http.get(f"/trajectories/{huge}").status_code == 404
    bad = http.get(f"/runs/r1/trajectories?min_lag={huge}")
    assert bad.status_code == 400 and f"min_lag=&#x27;{huge}&#x27; is out of range" in bad.text
    # a page past the last is the last (page 10**18 was an offset past 64 bits: a 500)
    past = http.get(f"/runs/r1/trajectories?page={10**18}")
    assert past.status_code == 200 and "page 1 of 1" in past.text
    for path in ("/", "/runs/r1", "/runs/r1/trajectories?search=ABC&sort=reward&desc=1"):
        response = http.get(path)
        assert response.status_code == 200
        assert "script-src 'self'" in response.headers["content-security-policy"]
    assert "1 trajectories" in http.get("/runs/r1/trajectories?search=ABC").text  # any case
    assert "0 trajectories" in http.get("/runs/r1/trajectories?search=xyz").text
