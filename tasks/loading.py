"""Load a task family from a Python file, a module, or an installed entry point.

References, tried in this order:
- `harbor:path/to/tasks`: Harbor task folders (`tasks.harbor`), options = `[tasks.harbor]`;
- `path/to/file.py:name` or `path/to/file.py` (attribute `family`): a file, loaded as a module;
- an entry-point name in the group `stalewise.tasks` (`arith`, `codefix`, `longhaul`, `vault`, ...);
- `package.module:name` or `package.module` (attribute `family`): an importable module.

The attribute is either a `TaskFamily` or a factory called with the config's `options` as keyword
arguments that returns one. The family's first instance is built at once, so a task that cannot
be made fails here. Every failure raises `TaskLoadError` saying what was looked for (the file and
line of an import that failed) and how to fix it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Mapping
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType
from typing import Any

from pydantic import ValidationError

from tasks.api import TaskFamily

GROUP = "stalewise.tasks"
HARBOR_PREFIX = "harbor:"


class TaskLoadError(ValueError):
    """A task family reference could not be resolved into a TaskFamily."""


def available_entry_points() -> list[str]:
    return sorted(ep.name for ep in entry_points(group=GROUP))


def load_family(ref: str, options: Mapping[str, Any] | None = None) -> TaskFamily:
    """The `TaskFamily` named by `ref` (see the module docstring), built with `options`."""
    if ref.strip().startswith(HARBOR_PREFIX):
        return _harbor(ref.strip()[len(HARBOR_PREFIX):], options)
    target, attribute = _split(ref)
    if target.endswith(".py") or "/" in target or "\\" in target:
        return _first_instance_builds(
            _build(_load_file(target), attribute or "family", ref, options), ref)
    points = {ep.name: ep for ep in entry_points(group=GROUP)}
    if attribute is None and target in points:
        try:
            value = points[target].load()
        except Exception as err:
            raise TaskLoadError(f"entry point {target!r} ({points[target].value}) failed to "
                                f"load: {type(err).__name__}: {err}") from err
        return _first_instance_builds(_build_value(value, ref, options), ref)
    try:
        module = importlib.import_module(target)
    except ImportError as err:
        raise TaskLoadError(
            f"task family {ref!r} not found: it is not a .py file, not an entry point in group "
            f"{GROUP!r} (installed: {', '.join(available_entry_points()) or 'none'}) and not an "
            f"importable module ({err}). Use 'path/to/file.py:family', an entry-point name, or "
            "'package.module:family'.") from err
    return _first_instance_builds(_build(module, attribute or "family", ref, options), ref)


def _harbor(path: str, options: Mapping[str, Any] | None) -> TaskFamily:
    from tasks.harbor import HarborSettings, HarborTaskError, harbor_family

    unknown = set(options or {}) - set(HarborSettings.model_fields) - {"extra_tools"}
    if unknown:
        raise TaskLoadError(f"harbor families take the [tasks.harbor] settings "
                            f"({', '.join(HarborSettings.model_fields)}), not {sorted(unknown)}")
    if not path:
        raise TaskLoadError('empty Harbor path; use family = "harbor:path/to/tasks"')
    try:
        return harbor_family(path, **dict(options or {}))
    except HarborTaskError as err:
        raise TaskLoadError(str(err)) from None


def _split(ref: str) -> tuple[str, str | None]:
    ref = ref.strip()
    if not ref:
        raise TaskLoadError("empty task family reference; set [tasks] family = ...")
    head, sep, tail = ref.rpartition(":")
    if sep and tail and not tail.startswith(("\\", "/")) and head and len(head) > 1:
        return head, tail
    return ref, None


def _load_file(path_text: str) -> ModuleType:
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise TaskLoadError(f"task file {path_text!r} does not exist (resolved to {path})")
    name = "stalewise_task_" + path.stem + "_" + hashlib.sha1(str(path).encode()).hexdigest()[:8]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise TaskLoadError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        fix = ("install it in this environment or fix the import"
               if isinstance(err, ImportError) else "fix the file")
        raise TaskLoadError(f"importing task file {path} failed{_line_in(err, path)}: "
                            f"{type(err).__name__}: {err}; {fix}") from err
    return module


def _line_in(err: BaseException, path: Path) -> str:
    """`err`'s line in `path` as " at line N" (the last traceback frame there, or a syntax
    error's own line), or "" when the error did not happen in that file."""
    line = err.lineno if isinstance(err, SyntaxError) and err.filename == str(path) else None
    for frame in traceback.extract_tb(err.__traceback__):
        if frame.filename == str(path):
            line = frame.lineno
    return f" at line {line}" if line else ""


def _build(module: ModuleType, attribute: str, ref: str,
           options: Mapping[str, Any] | None) -> TaskFamily:
    if not hasattr(module, attribute):
        found = [n for n, v in vars(module).items()
                 if isinstance(v, TaskFamily) or (callable(v) and n == "family")]
        raise TaskLoadError(f"{ref!r}: module {module.__name__} has no attribute {attribute!r}"
                            + (f"; candidates: {', '.join(found)}" if found else ""))
    return _build_value(getattr(module, attribute), ref, options)


def _build_value(value: Any, ref: str, options: Mapping[str, Any] | None) -> TaskFamily:
    options = dict(options or {})
    if isinstance(value, TaskFamily):
        if options:
            raise TaskLoadError(f"{ref!r} is a TaskFamily object, so it takes no options (got "
                                f"{sorted(options)}); expose a factory function to accept them")
        return value
    if not callable(value):
        raise TaskLoadError(f"{ref!r} is a {type(value).__name__}, not a TaskFamily or a "
                            "factory returning one")
    try:
        inspect.signature(value).bind(**options)
    except TypeError as err:
        raise TaskLoadError(f"options {sorted(options)} do not fit {ref!r}{_signature(value)}: "
                            f"{err}") from err
    try:
        family = value(**options)
    except (TypeError, ValueError) as err:
        raise TaskLoadError(f"{ref!r} rejected its options {options}: {err}") from err
    if not isinstance(family, TaskFamily):
        raise TaskLoadError(f"{ref!r} returned {type(family).__name__}, expected a TaskFamily")
    return family


def _first_instance_builds(family: TaskFamily, ref: str) -> TaskFamily:
    """`family`, once its first instance builds: a task that cannot be made (a missing field, a
    value of the wrong type) fails the job before it starts, not at its first dispatch."""
    if family.size == 0:
        raise TaskLoadError(f"{ref!r}: family {family.name} has no instances (size 0)")
    split = family.splits[0]
    try:
        family.instance(0, split)
    except Exception as err:
        raise TaskLoadError(f"{ref!r}: building {split} instance 0 of family {family.name} "
                            f"failed: {_one_line(err)}; fix the family's make function") from err
    return family


def _one_line(err: Exception) -> str:
    if isinstance(err, ValidationError):  # a TaskLimits or SandboxSpec with a bad value
        return "ValidationError: " + "; ".join(
            f"{err.title}.{'.'.join(map(str, e['loc']))}: {e['msg']} (got {e.get('input')!r})"
            for e in err.errors())
    return f"{type(err).__name__}: " + " ".join(str(err).split())


def _signature(value: Any) -> str:
    try:
        return str(inspect.signature(value))
    except (TypeError, ValueError):
        return ""
