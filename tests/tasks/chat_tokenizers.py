"""Tokenizers for the chat-format tests, trained here (no model hub)."""

from __future__ import annotations

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
