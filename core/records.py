"""Frozen token-level records: the spine of stalewise.

A `SampledTokens` holds everything the engine knows about the tokens of one model call: the
sampled ids, the log-probability of the (processed) distribution each id was drawn from, the
weights version of the forward pass that produced it, the oldest policy version among the KV
entries it attended to, and when it was produced. All arrays have the same length T, checked at
construction, and the record never changes afterwards. Nothing downstream re-tokenizes model
output: these ids are what the learner trains on.

`pack_*` / `unpack_*` turn arrays into little-endian bytes for the store's binary columns and
back; the round trip is exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

INT32 = np.dtype("<i4")
FLOAT32 = np.dtype("<f4")
UINT8 = np.dtype("u1")


def pack(array: np.ndarray | list, dtype: np.dtype) -> bytes:
    """Little-endian bytes of `array` as `dtype` (int32, float32 or uint8)."""
    return np.ascontiguousarray(np.asarray(array, dtype=dtype)).tobytes()


def unpack(data: bytes | memoryview | None, dtype: np.dtype, width: int = 1) -> np.ndarray:
    """Inverse of `pack`; `width` > 1 reshapes to (T, width). A read-only view, no copy."""
    if data is None:
        return np.zeros((0, width) if width > 1 else 0, dtype=dtype)
    array = np.frombuffer(data, dtype=dtype)
    return array.reshape(-1, width) if width > 1 else array


def _as(array, dtype: np.dtype) -> np.ndarray:
    out = np.asarray(array, dtype=dtype)
    out.setflags(write=False)
    return out


def _rows(array: np.ndarray, length: int, name: str) -> np.ndarray:
    """`array` as `length` rows; a 2-D array keeps its width (also with zero rows)."""
    if array.ndim != 2:
        return array.reshape(length, -1)
    if array.shape[0] != length:
        raise ValueError(f"SampledTokens.{name} has {array.shape[0]} rows, expected {length} "
                         f"like token_ids")
    return array


@dataclass(frozen=True, eq=False)
class SampledTokens:
    """The sampled tokens of one model call, all arrays of length T.

    token_ids: int32 (T,)             ids exactly as sampled
    sampler_logprobs: float32 (T,)    log mu(token) under the processed distribution sampled from
    weights_versions: int32 (T,)      policy version of the weights of the forward pass
    kv_versions: int32 (T,)           oldest policy version among the KV entries attended to
    time_offsets: float32 (T,)        seconds from the request's arrival to the token's sampling
    topk_ids / topk_logprobs: (T, K)  optional top-k of the sampler's processed distribution
    """

    token_ids: np.ndarray
    sampler_logprobs: np.ndarray
    weights_versions: np.ndarray
    kv_versions: np.ndarray
    time_offsets: np.ndarray
    topk_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None
    length: int = field(init=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "token_ids", _as(self.token_ids, INT32))
        set_(self, "sampler_logprobs", _as(self.sampler_logprobs, FLOAT32))
        set_(self, "weights_versions", _as(self.weights_versions, INT32))
        set_(self, "kv_versions", _as(self.kv_versions, INT32))
        set_(self, "time_offsets", _as(self.time_offsets, FLOAT32))
        length = len(self.token_ids)
        for name in ("sampler_logprobs", "weights_versions", "kv_versions", "time_offsets"):
            if getattr(self, name).shape != (length,):
                raise ValueError(
                    f"SampledTokens.{name} has shape {getattr(self, name).shape}, "
                    f"expected ({length},) like token_ids"
                )
        if (self.topk_ids is None) != (self.topk_logprobs is None):
            raise ValueError("SampledTokens: topk_ids and topk_logprobs must be given together")
        if self.topk_ids is not None:
            for name, dtype in (("topk_ids", INT32), ("topk_logprobs", FLOAT32)):
                set_(self, name, _rows(_as(getattr(self, name), dtype), length, name))
            if self.topk_ids.shape != self.topk_logprobs.shape:
                raise ValueError(
                    f"SampledTokens: topk_ids {self.topk_ids.shape} and topk_logprobs "
                    f"{self.topk_logprobs.shape} differ in shape"
                )
        set_(self, "length", length)

    @property
    def topk(self) -> int:
        return 0 if self.topk_ids is None else int(self.topk_ids.shape[1])

    def __len__(self) -> int:
        return self.length

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SampledTokens):
            return NotImplemented
        names = ("token_ids", "sampler_logprobs", "weights_versions", "kv_versions",
                 "time_offsets", "topk_ids", "topk_logprobs")
        for name in names:
            a, b = getattr(self, name), getattr(other, name)
            if (a is None) != (b is None):
                return False
            if a is not None and not np.array_equal(a, b):
                return False
        return True

    @classmethod
    def empty(cls, topk: int = 0) -> "SampledTokens":
        kw = {}
        if topk:
            kw = dict(topk_ids=np.zeros((0, topk), INT32), topk_logprobs=np.zeros((0, topk), FLOAT32))
        return cls(np.zeros(0, INT32), np.zeros(0, FLOAT32), np.zeros(0, INT32),
                   np.zeros(0, INT32), np.zeros(0, FLOAT32), **kw)
