"""One trajectory (`/trajectories/{id}`): turns, tool calls, and every sampled token as a span.

Tokens are paginated (TOKENS_PER_PAGE across the whole trajectory) so a 100,000-token
trajectory opens quickly; turns outside the page keep their header and tool calls. Per-token
fields travel in one JSON block (`json_for_script`), and viewer.js colours the spans by the chosen
channel and fills the hover card with `textContent`: no untrusted text is ever parsed as HTML.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from core.store import audit
from core.store.reads import decisions_of, task_instance
from core.store.store import Store, StoredModelCall
from viewer.html import esc, fmt, href, json_for_script, link, page, table

TOKENS_PER_PAGE = 4000
PROMPT_CHARS = 20_000
OUTPUT_CHARS = 20_000
CHANNELS = (("lp", "sampler log-prob"), ("v", "weights version"), ("kv", "KV version"),
            ("t", "time since request start"), ("tlp", "trainer log-prob"),
            ("ratio", "log-ratio trainer − sampler"))

Decoder = Callable[[int], str]


class Decoders(NamedTuple):
    """A run's token decoder (one id) and text decoder (a sequence, e.g. a whole prompt)."""

    token: Decoder | None
    text: Callable[[Sequence[int]], str] | None


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return esc(text)
    return esc(text[:limit]) + f'<span class="cut">… [{len(text) - limit} more characters]</span>'


def _finite(value: float) -> float | None:
    return None if math.isnan(value) else round(float(value), 5)


def _header(info: Mapping[str, Any], task: Any, admission: list[Any]) -> str:
    rows = [["run", link(f"/runs/{info['run_id']}", info["run_id"])],
            ["task", esc(f"{task.family}/{task.key}" if task else "–")],
            ["difficulty", esc(task.difficulty if task else "")],
            ["purpose", esc(info["purpose"])], ["status", esc(info["status"])],
            ["stop reason", esc(info["stop_reason"])], ["reward", fmt(info["reward"], 4)],
            ["reward breakdown", esc(json.dumps(info["reward_breakdown"], ensure_ascii=False))],
            ["weights versions", esc(f"{info['min_version']}..{info['max_version']}")],
            ["oldest KV version", fmt(info["min_kv_version"])],
            ["turns / model calls / tool calls",
             esc(f"{info['num_turns']} / {info['num_model_calls']} / {info['num_tool_calls']}")],
            ["engine / tools / waiting s", esc(f"{info['engine_s']:.3f} / {info['tools_s']:.3f}"
                                               f" / {info['waiting_s']:.3f}")]]
    if info["error"]:
        rows.append(["error", f'<span class="err">{esc(info["error"])}</span>'])
    for d in admission:
        rows.append(["admission", esc(f"{d.decision} ({d.reason}), lag {d.lag}, "
                                      f"learner version {d.learner_version}")])
    return table(["", ""], rows, css="info")


def _tool_calls(tools: list[Any]) -> str:
    if not tools:
        return ""
    rows = []
    for t in tools:
        size = f"{t.output_bytes} bytes" + (" · truncated" if t.truncated else "")
        rows.append([esc(t.name), f'<pre class="args">{_clip(t.arguments, OUTPUT_CHARS)}</pre>',
                     fmt(t.exit_code), esc(t.error_type or ""),
                     esc("yes" if t.timed_out else ""), fmt(t.duration_s, 3), esc(size),
                     f'<pre class="obs">{_clip(t.observation, OUTPUT_CHARS)}</pre>'])
    return table(["tool", "arguments", "exit", "error", "timed out", "s", "output", "output text"],
                 rows, css="tools")


def _token_spans(call: StoredModelCall, lo: int, hi: int, first_index: int,
                 decode: Decoder | None, trained: np.ndarray | None,
                 data: dict[str, list]) -> str:
    """Spans for tokens [lo, hi) of this call; their fields are appended to `data`."""
    tok, parts = call.tokens, []
    versions = tok.weights_versions
    for i in range(lo, hi):
        if i > 0 and versions[i] != versions[i - 1]:
            parts.append(f'<span class="vb" title="weights v{int(versions[i - 1])} → '
                         f'v{int(versions[i])}">v{int(versions[i])}</span>')
        text = decode(int(tok.token_ids[i])) if decode else f"[{int(tok.token_ids[i])}]"
        parts.append(f'<span class="t" data-i="{first_index + i - lo}">{esc(text)}</span>')
        data["text"].append(text)
        data["id"].append(int(tok.token_ids[i]))
        data["lp"].append(_finite(tok.sampler_logprobs[i]))
        data["v"].append(int(versions[i]))
        data["kv"].append(int(tok.kv_versions[i]))
        data["t"].append(_finite(tok.time_offsets[i]))
        data["mask"].append(1)  # a call's tokens are all sampled: loss mask 1 (core.samples)
        tlp = None if trained is None else _finite(trained[i])
        data["tlp"].append(tlp)
        lp = data["lp"][-1]
        data["ratio"].append(None if tlp is None or lp is None else round(tlp - lp, 5))
        data["k"].append([] if tok.topk_ids is None else [
            [int(a), decode(int(a)) if decode else "", _finite(b)]
            for a, b in zip(tok.topk_ids[i], tok.topk_logprobs[i])])
    return "".join(parts)


def _turn(call: StoredModelCall, tools: list[Any], window: tuple[int, int], start: int,
          decoders: Decoders, trained: np.ndarray | None, data: dict[str, list],
          page_link: Callable[[int], str]) -> str:
    n = len(call.tokens)
    versions = call.tokens.weights_versions
    head = (f'<h3>turn {call.turn} <small>segment {call.segment} · {len(call.prompt_token_ids)} '
            f'new prompt tokens ({call.cached_prompt_tokens} cached) · {n} sampled · finish '
            f'{esc(call.finish_reason)} · {call.finished_at - call.started_at:.3f} s · engine '
            f'{esc(call.engine_id)} · versions '
            f'{esc(f"{versions.min()}..{versions.max()}" if n else "–")}</small></h3>')
    ids = call.prompt_token_ids[:PROMPT_CHARS]
    prompt = decoders.text(ids) if decoders.text else " ".join(str(int(i)) for i in ids)
    more = len(call.prompt_token_ids) - len(ids)
    prompt_html = (f'<details class="prompt"><summary>prompt added this turn</summary>'
                   f'<pre>{_clip(prompt, PROMPT_CHARS)}'
                   + (f'<span class="cut">… [{more} more tokens]</span>' if more else "")
                   + '</pre></details>')
    lo, hi = max(window[0] - start, 0), min(window[1] - start, n)
    if lo < hi:
        before = (f'<span class="cut">[{lo} earlier tokens on {page_link(start)}]</span>'
                  if lo else "")
        after = (f'<span class="cut">[{n - hi} more tokens on {page_link(start + hi)}]</span>'
                 if hi < n else "")
        spans = (before + _token_spans(call, lo, hi, len(data["id"]), decoders.token, trained,
                                       data) + after)
    else:
        spans = f'<span class="cut">[{n} sampled tokens on {page_link(start)}]</span>'
    return (f'<section class="turn">{head}{prompt_html}<div class="tokens">{spans}</div>'
            f'{_tool_calls(tools)}</section>')


def _task(store: Store, task_instance_id: int | None) -> Any:
    return None if task_instance_id is None else task_instance(store, task_instance_id)


def _admission(store: Store, trajectory_id: int) -> list[Any]:
    return decisions_of(store, trajectory_id)


def _controls(has_trainer: bool, has_topk: bool) -> str:
    options = "".join(f'<option value="{key}">{esc(label)}</option>' for key, label in CHANNELS
                      if has_trainer or key not in ("tlp", "ratio"))
    note = "" if has_trainer else " (no trainer log-probs recorded for this trajectory)"
    return (f'<p class="controls"><label>colour tokens by <select id="channel">{options}'
            f'</select></label>{esc(note)} <span id="legend"></span>'
            f'{" · hover a token for its fields and top-k" if has_topk else ""}</p>'
            '<div id="card" hidden></div>')


def trajectory_page(store: Store, trajectory_id: int, query: Mapping[str, str],
                    decoders_for: Callable[[str], Decoders]) -> str | None:
    row = store.trajectory(trajectory_id)
    if row is None:
        return None
    info = dict(row._mapping)
    decoders = decoders_for(info["run_id"])
    calls, tools = store.model_calls(trajectory_id), store.tool_calls(trajectory_id)
    trained = audit.trainer_logprobs(store, [c.id for c in calls])
    total = sum(len(c.tokens) for c in calls)
    pages = max((total + TOKENS_PER_PAGE - 1) // TOKENS_PER_PAGE, 1)
    try:
        page_no = min(max(int(query.get("page") or 1), 1), pages)
    except ValueError:
        page_no = 1
    window = ((page_no - 1) * TOKENS_PER_PAGE, page_no * TOKENS_PER_PAGE)
    path = f"/trajectories/{trajectory_id}"

    def page_link(position: int) -> str:
        number = position // TOKENS_PER_PAGE + 1
        return f'<a href="{href(path, page=number)}">page {number}</a>'

    data: dict[str, list] = {k: [] for k in ("text", "id", "lp", "v", "kv", "t", "tlp", "ratio",
                                             "mask", "k")}
    turns, start = [], 0
    for call in calls:
        turns.append(_turn(call, [t for t in tools if t.turn == call.turn], window, start,
                           decoders, trained.get(call.id), data, page_link))
        start += len(call.tokens)
    task = _task(store, info["task_instance_id"])
    pager = (f'<p class="pager" id="token-pager">{total} sampled tokens · token page {page_no} of '
             f'{pages} ' + " ".join(
                 f'<a href="{href(path, page=n)}">{n}</a>' if n != page_no else f"<b>{n}</b>"
                 for n in range(1, pages + 1)) + "</p>")
    prompt = (f'<details class="prompt" open><summary>task prompt</summary>'
              f'<pre>{_clip(task.prompt, PROMPT_CHARS)}</pre></details>' if task else "")
    body = (_header(info, task, _admission(store, trajectory_id)) + prompt
            + _controls(bool(trained), any(c.tokens.topk for c in calls)) + pager
            + "".join(turns)
            + f'<script type="application/json" id="token-data">{json_for_script(data)}</script>')
    return page(f"trajectory {trajectory_id}", body, script=True,
                crumbs=[(f"/runs/{info['run_id']}", info["run_id"]),
                        (f"/runs/{info['run_id']}/trajectories", "trajectories"),
                        (path, str(trajectory_id))])
