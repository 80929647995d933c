"""ARCHITECTURE.md's import rules, checked on every module's source (lazy imports included).

A rule names a package and the modules of ours it must not import; `allowed` carves out the
torch-free pieces it may use. A violation names the file, the line and the rule it breaks.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = ("stalewise", "orchestrator", "sandboxes", "tasks", "engine", "learner", "lab",
        "migrations", "viewer")
HEAVY = ("torch", "transformers", "safetensors")


@dataclass(frozen=True)
class Rule:
    where: str  # a package, or a module path prefix
    forbidden: tuple[str, ...]
    allowed: tuple[str, ...] = field(default=())


RULES = (
    Rule("sandboxes", tuple(p for p in OURS if p != "sandboxes") + HEAVY),
    Rule("tasks", tuple(p for p in OURS if p != "tasks") + HEAVY,
         allowed=("sandboxes.api", "stalewise.config_base")),
    # the orchestrator loads tokenizers (transformers, without torch) but never a model
    Rule("orchestrator", ("learner", "lab", "torch", "safetensors"), allowed=("learner.config",)),
    Rule("orchestrator", ("engine",), allowed=("engine.launch",)),
    Rule("learner", ("orchestrator", "sandboxes", "engine", "lab")),
    Rule("engine", ("orchestrator", "learner", "lab", "tasks", "sandboxes")),
    Rule("lab", ("orchestrator", "sandboxes", "tasks", "engine")),
    # the viewer reads the store (and shared records) only: no torch, no other area, no CLI
    Rule("viewer", tuple(p for p in OURS if p not in ("stalewise", "viewer")) + HEAVY
         + ("stalewise.cli", "stalewise.commands")),
    Rule("stalewise/store", ("viewer",)),
    Rule("stalewise/records.py", OURS + HEAVY),
    Rule("stalewise/engine_api.py", OURS + HEAVY, allowed=("stalewise.records",)),
    Rule("stalewise/config_base.py", OURS + HEAVY),
    Rule("stalewise/engine_config.py", OURS + HEAVY, allowed=("stalewise.config_base",)),
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
                if _matches(module, rule.forbidden) and not _matches(module, rule.allowed):
                    found.append(f"{path.relative_to(ROOT)}:{line} imports {module} "
                                 f"({rule.where} must not import {', '.join(rule.forbidden)})")
    return found


def test_every_module_keeps_the_import_rules():
    assert violations() == []


def test_the_checker_sees_lazy_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from orchestrator.job import run\n    import torch\n")
    assert [m for _, m in _imports(module)] == ["orchestrator.job", "torch"]
    assert _matches("learner.config", ("learner",)) and not _matches("learners", ("learner",))
