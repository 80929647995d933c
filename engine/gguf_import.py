"""Turn a GGUF file into a Hugging Face checkpoint directory every stalewise process can load.

transformers reads GGUF files (with the `gguf` package) and dequantizes every tensor to
float32, but a model loaded that way carries a GGUF quantization config and refuses
`save_pretrained`. `import_gguf` copies its state into a plain model built from the same
config and saves that, with the tokenizer (and its chat template) from the same file.
Guarantees:

- the output directory holds `config.json`, `model.safetensors` (float32),
  `generation_config.json` and the tokenizer files, and `load_model` / the learner read it
  like any checkpoint; its logits equal those of the GGUF-loaded model exactly;
- the directory appears complete or not at all: everything is written to a sibling temporary
  directory that is renamed into place last, so an interrupted import leaves no half checkpoint;
- a missing file, a file transformers cannot read, or an existing output directory is a
  `GgufImportError` with a one-line message saying what to do.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path


class GgufImportError(ValueError):
    """The GGUF file cannot be imported (see the message for the fix)."""


@dataclass(frozen=True)
class ImportedModel:
    directory: Path
    model_type: str
    parameters: int
    vocab_size: int
    has_chat_template: bool


def _check_paths(gguf_file: Path, out_dir: Path) -> None:
    if not gguf_file.is_file():
        raise GgufImportError(f"{gguf_file} does not exist; pass the path of a .gguf file")
    if gguf_file.suffix != ".gguf":
        raise GgufImportError(f"{gguf_file} is not a .gguf file; pass a GGUF model file")
    if out_dir.exists():
        raise GgufImportError(f"{out_dir} already exists; remove it or choose another directory")


def _check_packages() -> None:
    import importlib.util

    absent = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if absent:
        raise GgufImportError(f"reading GGUF files needs {' and '.join(absent)}; install them "
                              f"with `pip install -e '.[gguf]'`")


def _load_gguf(gguf_file: Path):  # -> (PreTrainedModel, tokenizer)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (ValueError, KeyError, RuntimeError, ImportError) as exc:
        raise GgufImportError(f"transformers cannot read {gguf_file}: {exc}") from exc
    return model, tokenizer


def _plain_copy(gguf_model):  # -> PreTrainedModel without the GGUF quantization config
    import torch
    from transformers import AutoModelForCausalLM

    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing or unexpected:
        raise GgufImportError(f"the GGUF tensors do not fit a plain {config.model_type} model "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    plain.generation_config = gguf_model.generation_config
    plain.eval()
    return plain


def import_gguf(gguf_file: str | Path, out_dir: str | Path) -> ImportedModel:
    """Write `gguf_file` as a float32 Hugging Face checkpoint to `out_dir` (see module doc)."""
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    _check_paths(gguf_file, out_dir)
    _check_packages()
    gguf_model, tokenizer = _load_gguf(gguf_file)
    model = _plain_copy(gguf_model)
    del gguf_model
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(str(staging), safe_serialization=True)
        tokenizer.save_pretrained(str(staging))
        staging.chmod(0o755)  # mkdtemp makes it private; a checkpoint is read by other users
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ImportedModel(out_dir, model.config.model_type,
                         sum(p.numel() for p in model.parameters()),
                         int(model.config.vocab_size),
                         bool(getattr(tokenizer, "chat_template", None)))
