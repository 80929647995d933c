"""KV provenance and per-session KV retention.

`VersionSpans` records which policy version computed each cached position of a sequence, as
runs of equal versions. A token's KV version is the oldest version among the positions it
attended to, which is `oldest(n)` over the n cached positions.

`SessionStore` keeps the KV cache of finished turns, keyed by session id, so the next turn of
the same trajectory prefills only its new tokens. Guarantees: a stored cache is used only for
the longest common prefix of its token ids and the new prompt (never for tokens that differ);
the store never holds more than `budget_bytes` (least recently used sessions are evicted
first, and counted); `pop` hands a cache to exactly one sequence at a time.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass
class VersionSpans:
    """Runs (end_position, version): positions [prev_end, end) were computed by `version`."""

    runs: list[tuple[int, int]] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.runs[-1][0] if self.runs else 0

    def append(self, count: int, version: int) -> None:
        if count <= 0:
            return
        if self.runs and self.runs[-1][1] == version:
            self.runs[-1] = (self.runs[-1][0] + count, version)
        else:
            self.runs.append((self.length + count, version))

    def truncate(self, length: int) -> None:
        kept: list[tuple[int, int]] = []
        for end, version in self.runs:
            if end >= length:
                if length > (kept[-1][0] if kept else 0):
                    kept.append((length, version))
                break
            kept.append((end, version))
        self.runs = kept

    def reset(self, length: int, version: int) -> None:
        self.runs = [(length, version)] if length > 0 else []

    def oldest(self, length: int | None = None) -> int | None:
        """Oldest version among positions [0, length); None when there are none."""
        length = self.length if length is None else length
        oldest: int | None = None
        start = 0
        for end, version in self.runs:
            if start >= length:
                break
            oldest = version if oldest is None else min(oldest, version)
            start = end
        return oldest

    def versions(self) -> set[int]:
        """Every version that computed at least one position."""
        return {version for _, version in self.runs}

    def copy(self) -> VersionSpans:
        return VersionSpans(list(self.runs))


@dataclass
class SessionCache:
    token_ids: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, (kv_heads, len, head_dim) each
    spans: VersionSpans
    nbytes: int

    def common_prefix(self, prompt: list[int]) -> int:
        n = min(len(self.token_ids), len(prompt))
        for i in range(n):
            if self.token_ids[i] != prompt[i]:
                return i
        return n


class SessionStore:
    """LRU store of retained session caches under a byte budget (see module docstring)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._caches: OrderedDict[str, SessionCache] = OrderedDict()
        self.nbytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._caches)

    @property
    def tokens(self) -> int:
        return sum(len(c.token_ids) for c in self._caches.values())

    def session_ids(self) -> list[str]:
        return list(self._caches)

    def pop(self, session_id: str) -> SessionCache | None:
        cache = self._caches.pop(session_id, None)
        if cache is not None:
            self.nbytes -= cache.nbytes
        return cache

    def put(self, session_id: str, cache: SessionCache) -> None:
        self.pop(session_id)
        if cache.nbytes > self.budget_bytes:
            self.evicted += 1
            return
        while self._caches and self.nbytes + cache.nbytes > self.budget_bytes:
            _, old = self._caches.popitem(last=False)
            self.nbytes -= old.nbytes
            self.evicted += 1
        self._caches[session_id] = cache
        self.nbytes += cache.nbytes

    def clear(self) -> int:
        count = len(self._caches)
        self._caches.clear()
        self.nbytes = 0
        return count
