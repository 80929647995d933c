"""Untrusted text from a trajectory cannot run in the viewer (real Chromium).

A copy of a real run's database gets one more trajectory whose task prompt, difficulty, stop
reason, error, reward breakdown, tool name, arguments and output, admission reason and sampled
tokens carry `<script>`, `"><img onerror=...>`, `'><svg onload=...>` and control characters.
Every page that shows them is loaded: no alert opens, no payload sets its marker, and the
payload is visible as literal text (so it was escaped, not dropped).
"""

from __future__ import annotations

import shutil
import time

import numpy as np
import pytest
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.common.by import By
from tokenizers import Tokenizer
from viewer_support import screenshot

from core.records import SampledTokens
from core.store.store import Store, model_call_row

pytestmark = [pytest.mark.browser, pytest.mark.slow]

SCRIPT = "<script>window.pwned=1;alert(1)</script>"
IMG = '"><img src=x onerror="window.pwned=2;alert(2)">'
SVG = "'><svg onload=alert(3)>"
CONTROL = "bell\x07 escape\x1b[31m nul\x00 end"
PAYLOAD = f"{SCRIPT} {IMG} {SVG} {CONTROL}"


def inject(url: str, run_id: str) -> int:
    """A trajectory in `run_id` whose every text field carries the payload; its id."""
    store = Store.open(url)
    try:
        model = store.run(run_id).config["model"]["path"]
        ids = Tokenizer.from_file(f"{model}/tokenizer.json").encode(f"{SCRIPT} {IMG} {SVG}").ids
        task = store.task_instance_id(run_id, family="arith", key=f"xss {IMG}",
                                      content_hash="x", difficulty=SVG, prompt=PAYLOAD)
        trajectory = store.create_trajectory(run_id, group_id=None, task_instance_id=task)
        now = time.time()
        n = len(ids)
        tokens = SampledTokens(ids, np.full(n, -1.0), np.zeros(n), np.zeros(n),
                               np.linspace(0, 1, n), topk_ids=np.tile(ids[:2], (n, 1)),
                               topk_logprobs=np.full((n, 2), -2.0))
        store.insert_model_calls([model_call_row(
            trajectory_id=trajectory, turn=0, segment=0, context_len=0, prompt_token_ids=ids,
            tokens=tokens, sampling={}, engine_id=IMG, finish_reason="stop",
            cached_prompt_tokens=0, started_at=now, finished_at=now + 1)])
        store.insert_tool_calls([dict(
            trajectory_id=trajectory, turn=0, index=0, name=SCRIPT, arguments=PAYLOAD,
            observation=PAYLOAD, exit_code=1, error_type=None, timed_out=False, truncated=True,
            output_bytes=len(PAYLOAD), started_at=now, duration_s=0.5)])
        store.update_trajectory(trajectory, status="completed", stop_reason=SVG[:32],
                                reward=0.5, reward_breakdown={PAYLOAD: 0.5}, error=PAYLOAD,
                                started_at=now, finished_at=now + 2, num_turns=1,
                                num_model_calls=1, num_tool_calls=1, num_sampled_tokens=n,
                                min_version=0, max_version=0, min_kv_version=0)
        store.record_decision(run_id, decision="drop", reason=IMG[:64], learner_version=0,
                              trajectory_id=trajectory, lag=0)
        return trajectory
    finally:
        store.close()


def assert_nothing_ran(browser) -> None:
    try:
        alert = browser.switch_to.alert
        text = alert.text
        alert.dismiss()
        raise AssertionError(f"an alert opened: {text!r}")
    except NoAlertPresentException:
        pass
    assert browser.execute_script("return window.pwned === undefined")
    # the only script elements: ours (by src) and the inert JSON block of token data
    assert not browser.find_elements(
        By.CSS_SELECTOR, 'body img, body svg:not(.chart), '
                         'body script:not([src]):not([type="application/json"])')


def test_injected_markup_is_shown_as_text_and_never_runs(browser, viewer_of, real_run,
                                                          tmp_path):
    url, run_id = real_run
    copy = tmp_path / "copy.db"
    shutil.copy(url.removeprefix("sqlite:///"), copy)
    trajectory = inject(f"sqlite:///{copy}", run_id)
    viewer = viewer_of(f"sqlite:///{copy}")
    pages = ["/", f"/runs/{run_id}", f"/runs/{run_id}/trajectories?search=onerror",
             f"/trajectories/{trajectory}"]
    for path in pages:
        browser.get(viewer.url(path))
        assert_nothing_ran(browser)
    text = browser.find_element(By.TAG_NAME, "body").text
    assert SCRIPT in text and IMG in text and SVG in text  # escaped, shown literally
    assert "bell\\x07 escape\\x1b[31m nul\\x00 end" in text  # control characters made visible
    tokens = "".join(s.text for s in browser.find_elements(By.CSS_SELECTOR, ".tokens span.t"))
    assert tokens == f"{SCRIPT} {IMG} {SVG}"
    screenshot(browser, "viewer-xss")
    browser.get(viewer.url(f"/runs/{run_id}/trajectories?search=onerror"))
    rows = browser.find_elements(By.CSS_SELECTOR, "#trajectories tbody tr")
    assert [r.find_element(By.TAG_NAME, "a").text for r in rows] == [str(trajectory)]
