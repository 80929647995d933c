"""The third-party packages the product imports are the ones pyproject.toml declares.

`make demo` installs `dependencies` only; `make test` adds the `test` extra, which brings many
more packages with it. So an import of a package that only the tests bring passes the whole suite
and breaks the demo on a fresh clone: `import sniffio` in the engine client did exactly that
(sniffio came with trio, a test dependency; anyio and httpx no longer need it). Two rules, on
every module's source:

1. every imported distribution is declared by name, in `dependencies` or in an optional extra
   other than `test` (being another package's dependency today is not enough);
2. an import that runs when its module loads (not inside a function, not under
   `except ImportError`, not under `TYPE_CHECKING`) is of a base dependency: the extras' packages
   are imported where the feature that needs them starts.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from tests.test_import_rules import OURS

ROOT = Path(__file__).resolve().parents[1]
SCANNED = (*OURS, "bench")  # `make bench` runs on a base install too
# imported only when the user installed it themselves, each with the reason
OFFERED_WHEN_INSTALLED = {
    "wandb": "a metrics sink listed only when wandb is installed (learner/metrics.py)",
}


@dataclass(frozen=True)
class Import:
    file: str
    line: int
    module: str  # the top-level name
    on_load: bool  # runs when the module loads


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    return normalized(re.split(r"[\s<>=!~;\[(]", spec.strip(), maxsplit=1)[0])


def declared(pyproject: dict) -> tuple[set[str], dict[str, set[str]]]:
    """(the base dependencies, {extra: its distributions}) by normalized name, `test` left out."""
    project = pyproject["project"]
    base = {requirement_name(spec) for spec in project["dependencies"]}
    extras = {extra: {requirement_name(spec) for spec in specs}
              for extra, specs in project.get("optional-dependencies", {}).items()
              if extra != "test"}
    return base, extras


def _guards_import_errors(node: ast.Try) -> bool:
    names = {"ImportError", "ModuleNotFoundError"}
    for handler in node.handlers:
        kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if any(isinstance(kind, ast.Name) and kind.id in names for kind in kinds):
            return True
    return False


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def third_party_imports(source: str, file: str) -> list[Import]:
    """The imports of packages that are neither ours nor the standard library's."""
    found: list[Import] = []

    def visit(nodes: list[ast.AST], on_load: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node):
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                if isinstance(node, ast.ImportFrom):
                    names = [] if node.level or not node.module else [node.module]
                else:
                    names = [alias.name for alias in node.names]
                for name in names:
                    top = name.split(".")[0]
                    if top not in SCANNED and top not in sys.stdlib_module_names \
                            and top != "__future__":
                        found.append(Import(file, node.lineno, top, on_load))
            if isinstance(node, ast.Try) and _guards_import_errors(node):
                visit(node.body, False)
                visit([*node.handlers, *node.orelse, *node.finalbody], on_load)
                continue
            inner = on_load and not isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(list(ast.iter_child_nodes(node)), inner)

    visit(ast.parse(source).body, True)
    return found


def distribution_of(module: str) -> str:
    """The installed distribution that provides `module`, else the module's own name (a package
    not installed here, such as vllm in its own venv)."""
    providers = _providers().get(module)
    return normalized(providers[0]) if providers else normalized(module)


@functools.cache
def _providers() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def violations(imports: list[Import], base: set[str], extras: dict[str, set[str]]) -> list[str]:
    problems = []
    for item in imports:
        if item.module in OFFERED_WHEN_INSTALLED:
            continue
        dist = distribution_of(item.module)
        where = f"{item.file}:{item.line}"
        in_extras = sorted(extra for extra, names in extras.items() if dist in names)
        if dist not in base and not in_extras:
            problems.append(
                f"{where} imports {item.module} (distribution {dist}), which pyproject.toml does "
                "not declare: add it to [project] dependencies, or to the extra of the feature "
                "that needs it")
        elif dist not in base and item.on_load:
            problems.append(
                f"{where} imports {item.module} when the module loads, but {dist} is only in "
                f"the extra {', '.join(in_extras)}, so a base install (`make demo`) cannot "
                "import this module: import it where the feature starts, or make it a base "
                "dependency")
    return problems


def product_imports() -> list[Import]:
    imports = []
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            imports += third_party_imports(path.read_text(), rel)
    return imports


def test_the_product_imports_only_what_it_declares():
    base, extras = declared(tomllib.loads((ROOT / "pyproject.toml").read_text()))
    imports = product_imports()
    assert {item.module for item in imports} >= {"anyio", "numpy", "torch", "sniffio"}
    problems = violations(imports, base, extras)
    assert not problems, "\n".join(problems)


PYPROJECT = {"project": {"dependencies": ["anyio>=4.6", "httpx[http2]>=0.27 ; python_version>'3'"],
                         "optional-dependencies": {"ray": ["ray==2.60.0"],
                                                   "test": ["trio==0.35.0", "sniffio"]}}}


def test_a_package_that_only_the_tests_bring_is_named():
    """The day's defect: sniffio at module level, declared nowhere (trio brought it)."""
    base, extras = declared(PYPROJECT)
    assert base == {"anyio", "httpx"} and set(extras) == {"ray"}
    source = "import anyio\nimport sniffio\n"
    (problem,) = violations(third_party_imports(source, "engines/http.py"), base, extras)
    assert problem.startswith("engines/http.py:2 imports sniffio (distribution sniffio), which "
                              "pyproject.toml does not declare"), problem


def test_an_extra_imported_on_load_is_named_and_where_the_feature_starts_is_not():
    base, extras = declared(PYPROJECT)
    source = ("import ray\n"
              "def start():\n    import ray\n"
              "try:\n    import ray\nexcept ImportError:\n    ray = None\n"
              "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import ray\n")
    found = third_party_imports(source, "cluster.py")
    assert [(i.line, i.on_load) for i in found] == [(1, True), (3, False), (5, False)]
    (problem,) = violations(found, base, extras)
    assert problem.startswith("cluster.py:1 imports ray when the module loads, but ray is only "
                              "in the extra ray"), problem
