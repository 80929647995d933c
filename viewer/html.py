"""HTML building blocks. Everything that reaches a page from the store goes through `esc`.

Guarantee: `esc` output contains no `<`, `>`, `"`, `'` or raw `&`, so it is inert both as text
and inside a quoted attribute; C0/C1 control characters are shown as visible `\\xNN` escapes.
`json_for_script` makes JSON that cannot close its `<script type="application/json">` block.
Pages are plain strings; a value is either escaped here or a constant written in this package.
"""

from __future__ import annotations

import html
import json
import re
from typing import Any, Iterable
from urllib.parse import urlencode

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def esc(value: Any) -> str:
    """Text safe to place in HTML text or a quoted attribute."""
    text = "" if value is None else str(value)
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    return html.escape(text, quote=True)


def json_for_script(value: Any) -> str:
    """JSON safe inside a `<script type="application/json">` element."""
    text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def fmt(value: Any, digits: int = 4) -> str:
    """A short, escaped rendering of a number or value; None is a dash."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return esc(f"{value:.{digits}g}")
    return esc(value)


def href(path: str, **query: Any) -> str:
    """An escaped URL with the query parameters that are not None or empty."""
    params = {k: v for k, v in query.items() if v is not None and v != ""}
    return esc(path + ("?" + urlencode(params) if params else ""))


def link(path: str, label: Any, **query: Any) -> str:
    return f'<a href="{href(path, **query)}">{esc(label)}</a>'


def table(headers: Iterable[str], rows: Iterable[Iterable[str]], *, css: str = "") -> str:
    """A table of already-rendered cells (each cell is HTML made by this package)."""
    headers = list(headers)
    head = ("<thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in headers) + "</tr></thead>"
            if any(headers) else "")
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table class="{esc(css)}">{head}<tbody>{body}</tbody></table>'


def page(title: str, body: str, *, crumbs: Iterable[tuple[str, str]] = (),
         script: bool = False) -> str:
    """A whole page. `crumbs` are (path, label) pairs leading to this page."""
    trail = " / ".join(link(path, label) for path, label in [("/", "runs"), *crumbs])
    js = '<script src="/static/viewer.js" defer></script>' if script else ""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<title>{esc(title)} · stalewise</title>'
            f'<link rel="stylesheet" href="/static/viewer.css">{js}</head>'
            f'<body><nav>{trail}</nav><h1>{esc(title)}</h1>{body}</body></html>')
