"""Text <-> token ids for the chat formats, with fast paths that give the tokenizer's own ids.

`TokenCodec.encode(text)` is `tokenizer.encode(text, add_special_tokens=False)` and
`TokenCodec.decode(ids)` is `tokenizer.decode(ids, skip_special_tokens=False)`, as lists of
Python ints and a str. For a Hugging Face tokenizer backed by the `tokenizers` library whose
class does not override the encode/decode path (the plain `PreTrainedTokenizerFast` /
`TokenizersBackend`, which is what the tiny model and most checkpoints load as), both call the
Rust backend directly, skipping the wrapper's per-call bookkeeping (most of the cost on the short
texts of one turn). The shortcut is taken only while the wrapper would do nothing else: no
truncation or padding set on the backend, the wrapper's `split_special_tokens` already applied,
no clean-up of tokenization spaces on decode. Any other tokenizer goes through its own methods.

`SplitEncoder` encodes a chat text piece by piece, cut before marker tokens where probes at
construction show that cutting there gives the same ids, and remembers the pieces: the static
system prompt with its tool listing and the turn scaffolding are encoded once, not once per
trajectory or per turn.

`LRU` is the small bounded cache the formats keep per instance; `int_list` normalises ids.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

_WRAPPER_METHODS = {  # method -> the class of transformers that must provide it
    "encode": "PreTrainedTokenizerBase", "decode": "PreTrainedTokenizerBase",
    "_get_padding_truncation_strategies": "PreTrainedTokenizerBase",
    "_encode_plus": "TokenizersBackend", "_decode": "TokenizersBackend"}


class TokenCodec:
    """`encode`/`decode` of a tokenizer without special tokens added or skipped (see module)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._backend = _plain_backend(tokenizer)

    @property
    def direct(self) -> bool:
        """Whether calls go straight to the `tokenizers` backend (when nothing else would run)."""
        return self._backend is not None

    def encode(self, text: str) -> list[int]:
        backend = self._backend
        if (backend is None or backend.truncation is not None or backend.padding is not None
                or backend.encode_special_tokens != bool(self.tokenizer.split_special_tokens)):
            return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]
        return backend.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        ids = list(map(int, token_ids))
        if self._backend is None or self.tokenizer.clean_up_tokenization_spaces:
            return str(self.tokenizer.decode(ids, skip_special_tokens=False))
        return self._backend.decode(ids, skip_special_tokens=False)


def _plain_backend(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` behind `tokenizer` if the wrapper adds nothing to encode and
    decode (its class overrides none of the methods on that path), else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    backend_type = type(backend)
    if (backend_type.__module__.split(".")[0] != "tokenizers"
            or backend_type.__name__ != "Tokenizer"):
        return None
    owners = {cls.__name__: cls for cls in type(tokenizer).__mro__
              if cls.__module__.startswith("transformers.")}
    for method, owner in _WRAPPER_METHODS.items():
        provider = owners.get(owner)
        if provider is None or getattr(type(tokenizer), method, None) is not provider.__dict__.get(
                method):
            return None
    if not hasattr(tokenizer, "split_special_tokens") or not hasattr(
            tokenizer, "clean_up_tokenization_spaces"):
        return None
    return backend


class SplitEncoder:
    """`encode(text) == codec.encode(text)`, computed piece by piece with memoised pieces.

    The text is cut right before every occurrence of a marker (a single-token string such as
    `<|im_start|>`) for which such a cut is checked not to change the encoding; each piece is
    encoded once and remembered (up to `memo_chars` characters of pieces), so the constant
    scaffolding of a chat layout and a static system prompt cost a dictionary look-up, and only
    new text (an observation, a user prompt) reaches the tokenizer. Tokenizers split their input at added tokens before anything
    else, so the cut is normally exact; the probes at construction catch the exceptions (markers
    that strip the whitespace before them, pre-tokenizers that treat the start of a text
    specially), and a marker that fails them is simply not cut at. With no marker left, `encode`
    is the tokenizer's encode of the whole text.
    """

    def __init__(self, codec: TokenCodec, markers: Sequence[str],
                 memo_chars: int = 1 << 20) -> None:
        self.codec = codec
        self.markers = tuple(m for m in dict.fromkeys(markers) if self._cut_is_exact(m, markers))
        alternatives = "|".join(re.escape(m) for m in sorted(self.markers, key=len, reverse=True))
        self._cut = re.compile(f"(?={alternatives})") if self.markers else None
        self._memo: dict[str, tuple[int, ...]] = {}
        self._memo_chars, self._memo_budget = 0, memo_chars

    def encode(self, text: str) -> list[int]:
        if self._cut is None:
            return self.codec.encode(text)
        ids: list[int] = []
        for piece in self._cut.split(text):
            if piece:
                cached = self._memo.get(piece)
                if cached is None:
                    cached = tuple(self.codec.encode(piece))
                    self._remember(piece, cached)
                ids += cached
        return ids

    def _remember(self, piece: str, ids: tuple[int, ...]) -> None:
        if len(piece) > self._memo_budget // 8:
            return  # a huge observation: not worth keeping
        if self._memo_chars + len(piece) > self._memo_budget:
            self._memo.clear()  # start over: cheaper than LRU order upkeep on every hit
            self._memo_chars = 0
        self._memo[piece] = ids
        self._memo_chars += len(piece)

    def _cut_is_exact(self, marker: str, markers: Sequence[str]) -> bool:
        encode = self.codec.encode
        single = encode(marker)
        if len(single) != 1 or self.codec.decode(single) != marker:
            return False
        heads = [*_PROBE_HEADS, *(f"{other}{text}" for other in markers for text in ("", "x\n"))]
        for head in heads:
            for tail in _PROBE_TAILS:
                if encode(head + marker + tail) != encode(head) + encode(marker + tail):
                    return False
        return True


_PROBE_HEADS = ("", "\n", " ", "x", "a b\n", "\n\n", "  ", "é", "x ")
_PROBE_TAILS = ("", "user\nhi", "assistant\n", " x", "\n", "tool\n1\n")


def int_list(ids: Sequence[int]) -> list[int]:
    """`ids` as a list of Python ints. A list that starts and ends with Python ints (what the
    formats and `ndarray.tolist()` give) is used as it is: converting every element again is
    most of the cost of appending a long prompt."""
    if type(ids) is list and (not ids or (type(ids[0]) is int and type(ids[-1]) is int)):
        return ids
    return [int(i) for i in ids]


class LRU(Generic[K, V]):
    """A dict bounded to `size` entries, dropping the least recently used."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        value = self._items.get(key)
        if value is not None:
            try:
                self._items.move_to_end(key)
            except KeyError:  # dropped meanwhile by a put from another thread
                pass
        return value

    def put(self, key: K, value: V) -> V:
        self._items[key] = value
        if len(self._items) > self.size:
            self._items.popitem(last=False)
        return value
