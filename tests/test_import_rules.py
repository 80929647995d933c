"""ARCHITECTURE.md's import rules, checked on every module's source (lazy imports included).

Three layers and the areas between them: `core` (the ground) imports nothing of ours;
`config` (the config tree) imports only `core`; the areas import `core` and `config` and, as
the rules below say, each other; nothing imports `stalewise` (the roof: the CLI, its commands,
exports); only the store (`core/store/`) writes SQL. A rule names where it applies and what may not be imported there; there are no
exceptions. A violation names the file, the line and the rule it breaks.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AREAS = ("orchestrator", "sandboxes", "tasks", "engine", "learner", "lab", "viewer")
OURS = ("core", "config", *AREAS, "stalewise")
HEAVY = ("torch", "transformers", "safetensors")
SQL = ("sqlalchemy", "alembic")


@dataclass(frozen=True)
class Rule:
    where: str  # a package, or a module path prefix
    forbidden: tuple[str, ...]


def but(*keep: str) -> tuple[str, ...]:
    """Every package of ours except `keep`."""
    return tuple(p for p in OURS if p not in keep)


CORE_MODULES = tuple(f"core.{p.stem}" for p in (ROOT / "core").glob("*.py")
                     if p.stem != "__init__") + ("core.store",)

RULES = (
    # the layers
    Rule("core", but("core") + ("torch", "safetensors")),  # tokenizers: transformers, no torch
    Rule("config", but("core", "config") + HEAVY),
    *(Rule(area, ("stalewise",)) for area in AREAS),
    # SQL lives in the store: nobody else imports SQLAlchemy or Alembic
    *(Rule(where, SQL) for where in (*AREAS, "config", "stalewise",
                                     *(f"core/{p.name}" for p in (ROOT / "core").glob("*.py")))),
    # inside the ground: the records stand alone, the engine protocol on them only
    Rule("core/records.py", OURS + HEAVY),
    Rule("core/engine_api.py", but("core") + HEAVY
         + tuple(m for m in CORE_MODULES if m != "core.records")),
    # between the areas
    Rule("sandboxes", but("core", "config", "sandboxes") + HEAVY),
    Rule("tasks", but("core", "config", "tasks") + HEAVY),
    # the orchestrator loads tokenizers (transformers, without torch) but never a model
    Rule("orchestrator", ("learner", "lab", "engine", "torch", "safetensors")),
    Rule("learner", ("orchestrator", "sandboxes", "engine", "lab")),
    Rule("engine", ("orchestrator", "learner", "lab", "tasks", "sandboxes")),
    Rule("lab", ("orchestrator", "sandboxes", "tasks", "engine")),
    # the viewer reads the store (and shared records) only: no torch, no other area
    Rule("viewer", but("core", "config", "viewer") + HEAVY),
)


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _matches(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations() -> list[str]:
    found = []
    for rule in RULES:
        target = ROOT / rule.where
        files = [target] if target.suffix == ".py" else sorted(target.rglob("*.py"))
        assert files, f"rule for {rule.where}: no such module"
        for path in files:
            for line, module in _imports(path):
                if _matches(module, rule.forbidden):
                    found.append(f"{path.relative_to(ROOT)}:{line} imports {module} "
                                 f"({rule.where} must not import {', '.join(rule.forbidden)})")
    return found


def test_every_module_keeps_the_import_rules():
    assert violations() == []


def test_the_checker_sees_lazy_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from orchestrator.job import run\n    import torch\n")
    assert [m for _, m in _imports(module)] == ["orchestrator.job", "torch"]
    assert _matches("learner.trainer", ("learner",)) and not _matches("learners", ("learner",))
