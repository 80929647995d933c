"""`stalewise compare --merge`: the finished runs of earlier comparisons' folders as rows of
one table, and the checks that say where they are not one experiment (the module docstring of
`stalewise.commands.compare` says what the user sees)."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any


class MergeError(ValueError):
    """An earlier comparison's folder that cannot be merged, with what to do about it."""


_ROW_KEYS = ("label", "config", "run_id", "exit_code", "before", "after")


def merged_runs(folders: list[Path]) -> tuple[list[dict[str, Any]], list[str]]:
    """The finished runs of each folder's compare.json, each marked with its folder, and one
    note per folder saying how many runs came from it and which it left out (failed or stopped
    runs: their seeds are rerun, not averaged in)."""
    rows: list[dict[str, Any]] = []
    notes = []
    for folder in folders:
        path = folder / "compare.json"
        try:
            runs = json.loads(path.read_text())["runs"]
        except FileNotFoundError:
            raise MergeError(f"{path} does not exist; name a folder that `stalewise compare` "
                             "wrote (its --out)") from None
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise MergeError(f"{path} is not a comparison's output ({err})") from None
        if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
            raise MergeError(f"{path}: `runs` is not a list of rows")
        for r in runs:
            missing = [k for k in _ROW_KEYS if k not in r]
            if missing:
                raise MergeError(f"{path}: run {r.get('label', '?')} has no "
                                 f"{', '.join(missing)}; was the file edited by hand?")
        kept, left = [], []
        for r in runs:
            if r["exit_code"] == 0 and r["after"][1]:
                kept.append({**r, "merged_from": str(folder), "machine": r.get("machine") or
                             _machine_from_report(folder / "runs" / str(r["run_id"]))})
            else:
                left.append(f"{r['label']} (exit {r['exit_code']})")
        rows += kept
        notes.append(f"{folder}: {len(kept)} of {len(runs)} runs"
                     + (f"; left out: {', '.join(left)}" if left else ""))
    return rows, notes


def _machine_from_report(run_dir: Path) -> dict[str, Any] | None:
    """The CPU a run recorded in its report (runs of comparisons that predate `machine`)."""
    try:
        cpu = json.loads((run_dir / "report.json").read_text())["summary"]["numerics"]["cpu"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {"cpu": cpu}


def check_labels(merged: list[dict[str, Any]], new: list[str]) -> None:
    """One label (recipe and seed) once in the table: merged runs against each other and
    against the runs about to start."""
    seen: dict[str, str] = {}
    for label, where in [(r["label"], r["merged_from"]) for r in merged] + [
            (label, "this comparison's jobs") for label in new]:
        if label in seen:
            raise MergeError(f"two runs are labelled {label} (from {seen[label]} and {where}): "
                             "one seed of one recipe belongs in the table once; drop one of "
                             "them (another --first-seed, or one folder fewer)")
        seen[label] = where


def mixed_conditions(rows: list[dict[str, Any]], out: Path) -> list[str]:
    """Warnings where merged runs differ in what the table assumes they share: the number of
    test instances evaluated, and the checkpoint RL started from (told apart by its weights,
    so one checkpoint copied to two folders counts once)."""
    if not any("merged_from" in r for r in rows):
        return []
    notes = []
    sizes = sorted({r["after"][1] for r in rows if r.get("after", (0, 0))[1]})
    if len(sizes) > 1:
        notes.append("the runs were evaluated on different numbers of test instances ("
                     + ", ".join(map(str, sizes)) + "): their success rates are not comparable")
    cpus = sorted({(r.get("machine") or {}).get("cpu") for r in rows} - {None})
    if len(cpus) > 1:
        notes.append(f"the runs ran on different CPUs ({', '.join(cpus)}): their seconds and "
                     "any run that hit a wall-clock limit are not comparable")
    starts: dict[str, list[str]] = {}
    for row in rows:
        starts.setdefault(start_checkpoint(row, rows, out), []).append(row["label"])
    if len(starts) > 1:
        notes.append("the runs started RL from different checkpoints ("
                     + "; ".join(", ".join(labels) for labels in starts.values())
                     + "): their gains share no baseline")
    return notes


def start_checkpoint(row: dict[str, Any], rows: list[dict[str, Any]], out: Path) -> str:
    """What a run's RL started from: the digest of the checkpoint's weights where they are on
    disk, else its path or the run that made it."""
    folder = Path(row.get("merged_from") or out)
    start = row.get("warm_start_from")
    if not start:  # its own warm start, or its job's model as it was
        return _weights_digest((folder / "runs" / str(row["run_id"]) / "sft").resolve()) or \
            f"{row['label']}'s own model"
    if "/" in start:
        return _weights_digest(Path(start).resolve()) or start
    owner = next((r for r in rows if r["label"] == start
                  and r.get("merged_from") == row.get("merged_from")), None)
    return start_checkpoint(owner, rows, out) if owner else f"{start}'s warm start"


@functools.lru_cache(maxsize=None)
def _weights_digest(checkpoint: Path) -> str | None:
    """The digest of a checkpoint's weight files, read once per folder (many runs of a
    comparison start from one checkpoint)."""
    files = sorted(checkpoint.glob("*.safetensors")) + sorted(checkpoint.glob("*.bin"))
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
