"""The tokenizer of the tiny default model: characters plus a few chat special tokens.

Built locally (nothing is downloaded) and saved in Hugging Face format, so the engine, the
learner and the chat format load it with `transformers.AutoTokenizer` exactly like a real
checkpoint's tokenizer. Every printable ASCII character, newline and tab is one token; the
special tokens below are single ids and are never split, which makes tool calls and answers
cheap to find in sampled ids. The chat template is the Hermes/Qwen style the chat format uses.
"""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK = "<|unk|>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"

SPECIAL_TOKENS = [PAD, IM_START, IM_END, UNK]
MARKUP_TOKENS = [TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE,
                 ANSWER_OPEN, ANSWER_CLOSE]
CHARACTERS = list(string.printable.replace("\x0b", "").replace("\x0c", "").replace("\r", ""))

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + MARKUP_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL_TOKENS + MARKUP_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=IM_END,
        pad_token=PAD,
        unk_token=UNK,
        bos_token=None,
        additional_special_tokens=[IM_START] + MARKUP_TOKENS,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_tokenizer(directory: str | Path) -> PreTrainedTokenizerFast:
    tokenizer = build_tiny_tokenizer()
    tokenizer.save_pretrained(str(directory))
    return tokenizer
