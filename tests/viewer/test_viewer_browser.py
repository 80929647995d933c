"""`stalewise view` in a real headless Chromium over a real run's database.

- every page loads: runs, the run's dashboard (SVG plots), the trajectories table, a trajectory;
- choosing a filter in the table's drop-down narrows the rows (the page's JavaScript submits it);
- a column heading sorts; a trajectory opens from the table;
- switching the colour channel recolours the token spans; hovering a token shows its fields
  and the sampler's top-k alternatives;
- untrusted text injected through a trajectory (`<script>`, `"><img onerror=...>`, control
  characters) is shown as text and nothing executes (see test_viewer_xss.py).
Screenshots of each page are saved under var/test-artifacts/.
"""

from __future__ import annotations

import pytest
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait
from viewer_support import screenshot

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture(scope="module")
def viewer(real_run, viewer_of):
    url, _ = real_run
    return viewer_of(url)


def wait_for(browser, condition, what: str):
    return WebDriverWait(browser, 20, poll_frequency=0.1).until(
        lambda b: condition(b), message=f"timed out waiting for {what}")


def test_runs_page_links_to_the_dashboard_with_plots(browser, viewer, real_run):
    _, run_id = real_run
    browser.get(viewer.url("/"))
    assert browser.title.startswith("runs")
    row = browser.find_element(By.CSS_SELECTOR, "table.runs tbody tr")
    assert run_id in row.text and "finished" in row.text and "async" in row.text
    screenshot(browser, "viewer-runs")
    row.find_element(By.LINK_TEXT, run_id).click()
    wait_for(browser, lambda b: "learning curve" in b.page_source, "the dashboard")
    headings = [h.text for h in browser.find_elements(By.TAG_NAME, "h2")]
    assert headings == ["learning curve", "evaluation before / after", "throughput", "lag",
                        "admission decisions by reason", "bias ledger"]
    charts = browser.find_elements(By.CSS_SELECTOR, "svg.chart")
    assert len(charts) >= 14
    titles = [c.find_element(By.CSS_SELECTOR, "text.ct").text for c in charts]
    assert "reward" in titles and "KL to the sampler (k3)" in titles
    # two learner steps: the loss is a drawn line, not "no data"
    loss = charts[titles.index("policy loss")]
    assert loss.find_elements(By.TAG_NAME, "polyline")
    evals = browser.find_element(By.CSS_SELECTOR, "table.evals").text
    assert "before" in evals and "after" in evals
    assert "admit" in browser.find_element(By.CSS_SELECTOR, "table.decisions").text
    screenshot(browser, "viewer-dashboard")


def test_a_filter_narrows_the_table_and_a_heading_sorts(browser, viewer, real_run):
    _, run_id = real_run
    browser.get(viewer.url(f"/runs/{run_id}/trajectories"))
    all_rows = browser.find_elements(By.CSS_SELECTOR, "#trajectories tbody tr")
    purposes = {r.find_elements(By.TAG_NAME, "td")[3].text for r in all_rows}
    assert purposes == {"train", "eval"}
    Select(browser.find_element(By.ID, "f-purpose")).select_by_visible_text("eval")
    wait_for(browser, lambda b: "purpose=eval" in b.current_url, "the filter to apply")
    rows = browser.find_elements(By.CSS_SELECTOR, "#trajectories tbody tr")
    assert 0 < len(rows) < len(all_rows)
    assert {r.find_elements(By.TAG_NAME, "td")[3].text for r in rows} == {"eval"}
    assert browser.find_element(By.ID, "pager").text.startswith(f"{len(rows)} trajectories")
    browser.find_element(By.LINK_TEXT, "tokens").click()
    wait_for(browser, lambda b: "sort=tokens" in b.current_url, "sorting by tokens")
    tokens = [int(r.find_elements(By.TAG_NAME, "td")[8].text)
              for r in browser.find_elements(By.CSS_SELECTOR, "#trajectories tbody tr")]
    assert tokens == sorted(tokens, reverse=True) and "purpose=eval" in browser.current_url
    screenshot(browser, "viewer-trajectories")


def _span_colours(browser) -> list[str]:
    return browser.execute_script(
        "return Array.from(document.querySelectorAll('.tokens span.t'))"
        ".map(s => getComputedStyle(s).backgroundColor)")


def test_a_trajectory_opens_and_its_tokens_change_colour_by_channel(browser, viewer, real_run):
    _, run_id = real_run
    # the longest training trajectory: an untrained model's turns may end completed or truncated
    browser.get(viewer.url(f"/runs/{run_id}/trajectories?purpose=train&sort=tokens&desc=1"))
    first = browser.find_element(By.CSS_SELECTOR, "#trajectories tbody tr td a")
    trajectory_id = first.text
    first.click()
    wait_for(browser, lambda b: b.title.startswith(f"trajectory {trajectory_id}"),
             "the trajectory page")
    assert "admission" in browser.find_element(By.CSS_SELECTOR, "table.info").text
    assert browser.find_elements(By.CSS_SELECTOR, "section.turn")
    spans = browser.find_elements(By.CSS_SELECTOR, ".tokens span.t")
    assert spans
    by_logprob = _span_colours(browser)
    assert all(c not in ("", "rgba(0, 0, 0, 0)") for c in by_logprob)
    assert "log-prob 0" in browser.find_element(By.ID, "legend").text
    Select(browser.find_element(By.ID, "channel")).select_by_value("v")
    wait_for(browser, lambda b: b.execute_script("return document.body.dataset.channel") == "v",
             "the channel switch")
    by_version = _span_colours(browser)
    assert by_version != by_logprob
    assert browser.find_element(By.ID, "legend").text == "one colour per version"
    # a token that wraps across lines, or is only a line break, has its centre outside its own
    # boxes: the pointer would land on the paragraph, so hover one laid out as a single box
    target = browser.execute_script(
        "return [...arguments[0]].find(s => { const r = s.getClientRects();"
        " return r.length === 1 && r[0].width > 2 && r[0].height > 2; });", spans)
    assert target is not None, "no token span is laid out as a single box"
    ActionChains(browser).move_to_element(target).perform()
    card = browser.find_element(By.ID, "card")
    wait_for(browser, lambda b: card.is_displayed(), "the hover card")
    assert "sampler log-prob" in card.text and "weights v" in card.text
    assert "top-3 of the sampler" in card.text
    screenshot(browser, "viewer-trajectory")
