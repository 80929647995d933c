"""Tokenizers for the chat-format tests: small ones trained here, and the real templates and
tokenizers fetched from package registries (tests/tasks/fixtures/PROVENANCE.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast


def byte_level_bpe(corpus: str, chat_template: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (vocabulary 400, Qwen-style special tokens) trained on
    `corpus`, so common pieces merge ('pr' is one token) while single bytes still exist."""
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400,
                                  special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator([corpus] * 50, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>",
                                        unk_token="<unk>")
    tokenizer.chat_template = chat_template
    return tokenizer


FIXTURES = Path(__file__).resolve().parents[2] / "var" / "fixtures" / "chat"
FAMILIES = ("qwen2.5", "qwen3", "llama3.1", "mistral-v0.3")
# fixture directory -> the chat format for it (Llama 3.2 uses the Llama 3.1 format)
FIXTURES_AND_FORMATS = (*((name, name) for name in FAMILIES), ("llama3.2", "llama3.1"))


def real_tokenizer_dir(family: str) -> Path:
    """A real template + tokenizer directory fetched by scripts/fetch_chat_fixtures.sh."""
    directory = FIXTURES / family
    if not (directory / "tokenizer_config.json").exists():
        raise AssertionError(f"missing chat fixture {directory}; run: bash "
                             "scripts/fetch_chat_fixtures.sh (scripts/setup.sh runs it)")
    return directory


def real_tokenizer(family: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(real_tokenizer_dir(family)))
