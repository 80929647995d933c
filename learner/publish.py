"""Weight publishing: write completely, then rename, then mark.

`publish_version` writes safetensors weights, config.json and the tokenizer files (copied
verbatim from the starting checkpoint) into a hidden temporary directory next to the target,
fsyncs every file and the directory, renames it atomically to `<root>/v{version:06d}/` and
fsyncs the root; only then does it call `mark_published(version, path)` (which inserts the
policy_versions row). A reader that trusts
only marked versions never sees a partial checkpoint; a crash leaves at most an unmarked
temporary directory, which the next publish of that version removes.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

MarkPublished = Callable[[int, Path], None]


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"v{version:06d}"


def _fsync_tree(directory: Path) -> None:
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with path.open("rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


NOT_TOKENIZER = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
MODEL_FILES = ("config.json", "generation_config.json", "stalewise.json")


def read_tokenizer_files(directory: str | Path) -> dict[str, bytes]:
    """The tokenizer files of a checkpoint directory, by name, as bytes: a learner reads them
    once at start, so it can publish after the checkpoint it started from is gone (a restart
    resumes from a published version, which pruning later deletes)."""
    return {path.name: path.read_bytes() for path in tokenizer_files(directory)}


def tokenizer_files(directory: str | Path) -> list[Path]:
    """The files of a checkpoint directory that are not weights, model config or our metadata."""
    return sorted(
        p
        for p in Path(directory).iterdir()
        if p.is_file()
        and not p.name.startswith(".")
        and p.name not in MODEL_FILES
        and not p.name.endswith(NOT_TOKENIZER)
    )


def machine_numerics(dtype: str = "float32") -> dict[str, Any]:
    """What decides how this process rounds: torch's version, the CPU kernels it dispatches to
    (AVX2, AVX512, ...), its thread count, the CPU and its bfloat16 instructions, and the dtype
    of the products (`dtype`, resolved). Two machines that differ in any of them can take
    another SFT path from the same seed (docs/pipeline.md has one), so a checkpoint records
    them next to its figures."""
    import torch

    from core.numerics import cpu_facts

    return {"torch": torch.__version__, "cpu_kernels": torch.backends.cpu.get_cpu_capability(),
            "torch_threads": torch.get_num_threads(), "dtype": dtype, **cpu_facts()}


Tokenizer = str | Path | Mapping[str, bytes] | None  # a directory, or its files read already


def write_checkpoint(
    model: Any,
    tokenizer: Tokenizer,
    final_dir: str | Path,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write an HF checkpoint (safetensors) to final_dir atomically; final_dir must not exist.

    The tokenizer files are written byte for byte as `tokenizer` holds them (a directory, such
    as the checkpoint the learner started from, or `read_tokenizer_files` of one), never
    re-serialised, so what the engine loads is what was sampled
    with."""
    final_dir = Path(final_dir)
    if final_dir.exists():
        raise FileExistsError(
            f"{final_dir} already exists; a published checkpoint is never "
            "overwritten (choose a new version or directory)"
        )
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = final_dir.parent / f".tmp-{final_dir.name}-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        if tokenizer is not None:
            files = tokenizer if isinstance(tokenizer, Mapping) else read_tokenizer_files(tokenizer)
            for name, data in files.items():
                (tmp / name).write_bytes(data)
        (tmp / "stalewise.json").write_text(
            json.dumps({"written_at": time.time(), **(metadata or {})}, indent=1)
        )
        _fsync_tree(tmp)
        os.rename(tmp, final_dir)
        _fsync_dir(final_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final_dir


def publish_version(
    model: Any,
    tokenizer: Tokenizer,
    root: str | Path,
    version: int,
    mark_published: MarkPublished | None = None,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Publish `version` under root (publish-then-mark); returns the version directory."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f".tmp-v{version:06d}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    path = write_checkpoint(
        model, tokenizer, version_dir(root, version), {"version": version, **(metadata or {})}
    )
    if mark_published is not None:
        mark_published(version, path)
    return path
