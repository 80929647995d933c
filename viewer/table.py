"""The trajectories table (`/runs/{id}/trajectories`): the CLI's filters, free-text search,
sorting and pagination, all in the query string so every view is a link."""

from __future__ import annotations

from typing import Any, Mapping

from core.store import audit
from core.store.audit import SORT_KEYS, TrajectoryFilter
from core.store.store import Store
from viewer.html import esc, fmt, href, link, page

PAGE_SIZE = 50
CHOICES = ("status", "purpose", "decision", "task", "difficulty", "stop_reason")


class BadQuery(ValueError):
    """A query parameter that cannot be parsed; its message says which and how to fix it."""


def _number(query: Mapping[str, str], name: str, kind: type) -> Any:
    raw = query.get(name, "").strip()
    if not raw:
        return None
    try:
        value = kind(raw)
    except ValueError:
        raise BadQuery(f"{name}={raw!r} is not a{'n integer' if kind is int else ' number'}; "
                       f"fix or clear that filter") from None
    if kind is int and not -INT64_END <= value < INT64_END:  # SQL's integers (was a 500)
        raise BadQuery(f"{name}={raw!r} is out of range; fix or clear that filter")
    return value


INT64_END = 2**63  # SQL's integers are 64-bit: every id and filter is below it


def parse_filter(query: Mapping[str, str]) -> TrajectoryFilter:
    text = {name: (query.get(name) or None) for name in (*CHOICES, "search")}
    return TrajectoryFilter(min_lag=_number(query, "min_lag", int),
                            reward_min=_number(query, "reward_min", float),
                            reward_below=_number(query, "reward_below", float), **text)


def _select(name: str, options: list[str], current: str | None) -> str:
    items = ['<option value="">any</option>'] + [
        f'<option value="{esc(o)}"{" selected" if o == current else ""}>{esc(o)}</option>'
        for o in options]
    return (f'<label>{esc(name.replace("_", " "))} <select name="{esc(name)}" '
            f'id="f-{esc(name)}">{"".join(items)}</select></label>')


def _form(f: TrajectoryFilter, choices: dict[str, list[str]], sort: str, desc: bool) -> str:
    selects = "".join(_select(n, choices.get(n, []), getattr(f, n)) for n in CHOICES)
    numbers = "".join(
        f'<label>{esc(label)} <input name="{name}" id="f-{name}" size="6" '
        f'value="{esc("" if getattr(f, name) is None else getattr(f, name))}"></label>'
        for name, label in (("min_lag", "min lag"), ("reward_min", "reward ≥"),
                            ("reward_below", "reward <")))
    return (f'<form method="get" class="filters">{selects}{numbers}'
            f'<label>search <input name="search" id="f-search" size="18" '
            f'value="{esc(f.search or "")}"></label>'
            f'<input type="hidden" name="sort" value="{esc(sort)}">'
            f'<input type="hidden" name="desc" value="{int(desc)}">'
            f'<button type="submit" id="apply">apply</button> <a href="?">clear</a></form>')


def trajectories_page(store: Store, run_id: str, query: Mapping[str, str]) -> str | None:
    if store.run(run_id) is None:
        return None
    f = parse_filter(query)
    sort = query.get("sort") or "id"
    if sort not in SORT_KEYS:
        raise BadQuery(f"sort={sort!r} is not one of {', '.join(SORT_KEYS)}")
    desc = query.get("desc") == "1"
    total = audit.count_trajectories(store, run_id, f)
    pages = max((total + PAGE_SIZE - 1) // PAGE_SIZE, 1)
    page_no = min(max(_number(query, "page", int) or 1, 1), pages)  # past the last: the last
    rows = audit.trajectories(store, run_id, where=f, sort=sort, descending=desc,
                              limit=PAGE_SIZE, offset=(page_no - 1) * PAGE_SIZE)
    state = {k: v for k, v in query.items() if k not in ("page", "sort", "desc")}
    path = f"/runs/{run_id}/trajectories"

    def heading(label: str, key: str | None) -> str:
        if key is None:
            return esc(label)
        flip = "0" if sort == key and desc else "1"
        mark = (" ▼" if desc else " ▲") if sort == key else ""
        return f'<a href="{href(path, **state, sort=key, desc=flip)}">{esc(label)}{mark}</a>'

    headers = [("id", "id"), ("task", None), ("difficulty", None), ("purpose", None),
               ("status", "status"), ("stop reason", None), ("reward", "reward"),
               ("turns", "turns"), ("tokens", "tokens"), ("versions", None), ("lag", "lag"),
               ("decision", None), ("duration s", "duration")]
    body_rows = [[link(f"/trajectories/{r['id']}", r["id"]), esc(r["task"]),
                  esc(r["difficulty"]), esc(r["purpose"]), esc(r["status"]),
                  esc(r["stop_reason"]), fmt(r["reward"], 3), esc(r["turns"]), esc(r["tokens"]),
                  esc("{}..{}".format(*r["versions"])), fmt(r["lag"]), esc(r["decision"]),
                  fmt(r["duration_s"], 3)] for r in rows]
    head = "".join(f"<th>{heading(label, key)}</th>" for label, key in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in body_rows)
    nav = (f'<p class="pager" id="pager">{esc(total)} trajectories · page {page_no} of {pages} '
           + (f'<a href="{href(path, **state, sort=sort, desc=int(desc), page=page_no - 1)}">'
              f'previous</a> ' if page_no > 1 else "")
           + (f'<a href="{href(path, **state, sort=sort, desc=int(desc), page=page_no + 1)}">'
              f'next</a>' if page_no < pages else "") + "</p>")
    html = (_form(f, audit.filter_choices(store, run_id), sort, desc) + nav
            + f'<table class="trajectories" id="trajectories"><thead><tr>{head}</tr></thead>'
            f'<tbody>{body}</tbody></table>')
    return page(f"trajectories of {run_id}", html,
                crumbs=[(f"/runs/{run_id}", run_id), (path, "trajectories")], script=True)

