"""ARCHITECTURE.md stays current: every module or folder it names in backticks exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def named_paths(text: str) -> set[str]:
    """`path/to/module.py` and `folder/` mentions (backticked, relative to the project)."""
    return set(re.findall(r"`([A-Za-z_][\w/.-]*(?:\.py|/))`", text))


def test_every_module_architecture_md_names_exists():
    names = named_paths((ROOT / "ARCHITECTURE.md").read_text())
    assert len(names) > 50, "the page names the modules of every stage"
    assert sorted(p for p in names if not (ROOT / p).exists()) == []


def test_the_check_sees_a_module_that_is_gone():
    assert named_paths("see `core/store/store.py` and `gone/away.py`, not `RUN/`x") == {
        "core/store/store.py", "gone/away.py", "RUN/"}
