"""Turn pydantic validation errors into one line per problem that says how to fix it."""

from __future__ import annotations

import difflib
import json
import tomllib
from pathlib import Path
from typing import Any, TypeVar, get_args

from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)


class ConfigError(ValueError):
    """A config file could not be read or validated; `problems` holds one line per problem."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems))


def _field_path(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item.startswith("function-") or item in ("literal", "list", "dict"):
            continue  # validator names pydantic adds to the location
        else:
            parts.append(("." if parts else "") + item)
    return "".join(parts) or "(top level)"


def _model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that owns the field at `loc[:-1]`, for unknown-key hints
    (through lists and optional values: `tools.mcp[0]` is a `McpServerConfig`)."""
    current: Any = model
    for item in loc[:-1]:
        if isinstance(item, int):
            continue  # an element of the list whose annotation `_inner_model` unwraps
        owner = _inner_model(current)
        field = owner.model_fields.get(item) if owner else None
        if field is None:
            return None
        current = field.annotation
    return _inner_model(current)


def _inner_model(annotation: Any) -> type[BaseModel] | None:
    """`annotation` itself when it is a model, else the model inside `list[M]`, `M | None`..."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in get_args(annotation):
        found = _inner_model(argument)
        if found is not None:
            return found
    return None


def describe(error: dict[str, Any], model: type[BaseModel]) -> str:
    path = _field_path(error["loc"])
    kind = error["type"]
    got = error.get("input")
    if kind == "extra_forbidden":
        owner = _model_at(model, error["loc"])
        allowed = sorted(owner.model_fields) if owner else []
        key = str(error["loc"][-1])
        close = difflib.get_close_matches(key, allowed, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return f"{path}: unknown field; {hint}allowed fields: {', '.join(allowed)}"
    if kind == "literal_error":
        expected = error.get("ctx", {}).get("expected", "")
        return f"{path}: got {got!r}; allowed values: {expected}"
    if kind == "missing":
        return f"{path}: required field is missing; add it to the file"
    if kind in ("model_type", "dict_type"):
        return f"{path}: expected a table of key = value settings, got {got!r}"
    if kind == "list_type" and not isinstance(got, dict):
        return f"{path}: expected a list, got {got!r}; write it in brackets, e.g. [{got!r}]"
    message = error["msg"].removeprefix("Value error, ")
    if path == "(top level)":
        return message
    if got is not None and not isinstance(got, dict):
        return f"{path}: {message} (got {got!r})"
    return f"{path}: {message}"


def problems_of(exc: ValidationError, model: type[BaseModel]) -> list[str]:
    return [describe(err, model) for err in exc.errors()]


def validate(model: type[Model], data: dict[str, Any], source: str) -> Model:
    """`model` built from `data`, or a ConfigError with one line per problem."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, problems_of(exc, model)) from None


def read_json(path: str | Path, what: str) -> dict[str, Any]:
    """The parsed JSON object in `path`, or a ConfigError naming the file and what was
    expected (`what`), like `read_toml`."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:  # missing, a folder, no read permission
        raise ConfigError(str(path), [_unreadable(path, exc, what)]) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), [f"not valid JSON: {exc}; the job writes this file, so "
                                      f"start the job again or fix it by hand"]) from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), [f"expected a JSON object of settings, got "
                                      f"{type(data).__name__}"])
    return data


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """The parsed file, or a ConfigError naming the file and what was expected (`what`)."""
    path = Path(path)
    try:
        return tomllib.loads(path.read_text())
    except OSError as exc:  # missing, a folder, no read permission
        raise ConfigError(str(path), [_unreadable(path, exc, what)]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), [f"not valid TOML: {exc}"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), [f"not valid TOML: not UTF-8 text (byte {exc.start}); "
                                      f"pass the path of {what}"]) from None


def _unreadable(path: Path, exc: OSError, what: str) -> str:
    if isinstance(exc, FileNotFoundError):
        return f"file not found; pass the path of {what}"
    if path.is_dir():
        return f"is a folder, not a file; pass the path of {what}"
    return f"cannot be read ({exc.strerror or exc}); pass the path of {what}"
