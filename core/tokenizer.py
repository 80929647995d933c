"""The one way every process loads a checkpoint's tokenizer (torch-free: fast tokenizers need
no torch, so the orchestrator can use it too).

transformers 5's AutoTokenizer picks the tokenizer class from config.json's model_type and may
rebuild the pre-tokenizer (Qwen2's byte-level one drops the tiny character tokenizer's
whitespace); a checkpoint whose tokenizer_config names the generic backend class is therefore
loaded with that class, exactly as its tokenizer.json defines it. Any other checkpoint gets
AutoTokenizer, which keeps family-specific behaviour (chat templates, special tokens).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def has_tokenizer(path: str | Path) -> bool:
    path = Path(path)
    return (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer of the checkpoint directory `path`."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config_path = Path(path) / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    if config.get("tokenizer_class") in GENERIC_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))
