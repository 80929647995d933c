"""Import every module of the product, and fail naming each one that does not import.

`.ci/run` runs this on the demo's install (`make setup`: the base dependencies only) before
`make test` adds the tests' packages, so a module that needs a package only the tests bring
fails here instead of in a newcomer's `make demo` (tests/test_dependencies.py checks the same
statically). The Alembic migrations (they run inside Alembic) and the `__main__` modules
(importing one runs its command) are left out.
"""

from __future__ import annotations

import importlib
import sys
import tomllib
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the installed packages, as pyproject.toml names them ("core*" -> "core")
PACKAGES = tuple(pattern.rstrip("*") for pattern in tomllib.loads(
    (ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"])
LEFT_OUT = ("core.store.migrations.",)


def modules() -> list[str]:
    names = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if parts[-1] != "__main__" and not name.startswith(LEFT_OUT):
                names.append(name)
    return names


def main() -> int:
    sys.path.insert(0, str(ROOT))
    failed = []
    names = modules()
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, then the exit code
            failed.append(name)
            last = traceback.format_exception_only(exc)[-1].strip()
            print(f"check_imports: {name} does not import: {last}", file=sys.stderr)
    if failed:
        print(f"check_imports: {len(failed)} of {len(names)} modules do not import on this "
              "install; declare what they need in pyproject.toml's dependencies, or import an "
              "extra's package where its feature starts", file=sys.stderr)
        return 1
    print(f"check_imports: all {len(names)} modules import")
    return 0


if __name__ == "__main__":
    sys.exit(main())
