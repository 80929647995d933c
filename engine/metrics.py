"""Engine counters and rates, written by the engine thread and read by the HTTP server.

Counters only grow. Rates (tokens/s, mean batch size) cover the last `window_s` seconds of
steps. Keys are namespaced (`tokens/...`, `time/...`) and stable: the client, the bench and the
docs read them by name.
"""

from __future__ import annotations

import threading
import time
from collections import deque


class EngineMetrics:
    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        self._steps: deque[tuple[float, int]] = deque()   # (time, tokens sampled in the step)
        self.started = time.monotonic()
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.prefilled_tokens = 0
        self.cached_prompt_tokens = 0
        self.shared_prompt_tokens = 0   # prompt tokens copied from a group member's prefill
        self.recomputed_tokens = 0
        self.session_hits = 0
        self.session_misses = 0
        self.finished = 0
        self.aborted = 0
        self.steps = 0
        self.prefill_s = 0.0
        self.decode_s = 0.0
        self.sample_s = 0.0
        self.updates = 0
        self.update_pause_s = 0.0
        self.last_update_pause_s = 0.0
        self.decode_batch_total = 0
        self.decode_steps = 0
        self.versions_freed = 0
        self.versions_evicted = 0
        self.session_version_misses = 0

    def add_prefill(self, seconds: float, tokens: int) -> None:
        self.prefill_s += seconds
        self.prefilled_tokens += tokens

    def add_decode(self, seconds: float, batch: int) -> None:
        self.decode_s += seconds
        self.decode_steps += 1
        self.decode_batch_total += batch

    def add_sample(self, seconds: float, batch: int) -> None:
        self.sample_s += seconds
        self.generated_tokens += batch
        self.steps += 1
        now = time.monotonic()
        with self._lock:
            self._steps.append((now, batch))
            while self._steps and self._steps[0][0] < now - self.window_s:
                self._steps.popleft()

    def add_prompt(self, tokens: int, cached: int, *, session: bool) -> None:
        self.prompt_tokens += tokens
        self.cached_prompt_tokens += cached
        if session:
            if cached:
                self.session_hits += 1
            else:
                self.session_misses += 1

    def add_update(self, pause_s: float) -> None:
        self.updates += 1
        self.update_pause_s += pause_s
        self.last_update_pause_s = pause_s

    def snapshot(self, **state: float | bool) -> dict[str, float]:
        now = time.monotonic()
        with self._lock:
            recent = [(t, n) for t, n in self._steps if t >= now - self.window_s]
        if len(recent) >= 2:
            span = max(recent[-1][0] - recent[0][0], 1e-9)
            rate = sum(n for _, n in recent[1:]) / span
            batch = sum(n for _, n in recent) / len(recent)
        else:
            rate, batch = 0.0, float(recent[0][1]) if recent else 0.0
        snap: dict[str, float] = {
            "engine/weights_version": state.get("version", 0),
            "engine/running": state.get("running", 0),
            "engine/waiting": state.get("waiting", 0),
            "engine/paused": float(bool(state.get("paused", False))),
            "engine/uptime_s": now - self.started,
            "rate/tokens_per_s": rate,
            "batch/mean_size_recent": batch,
            "batch/mean_decode_size": self.decode_batch_total / max(self.decode_steps, 1),
            "tokens/generated_total": self.generated_tokens,
            "tokens/prompt_total": self.prompt_tokens,
            "tokens/prefilled_total": self.prefilled_tokens,
            "tokens/cache_hit_total": self.cached_prompt_tokens,
            "tokens/shared_prompt_total": self.shared_prompt_tokens,
            "tokens/recomputed_total": self.recomputed_tokens,
            "sessions/hits_total": self.session_hits,
            "sessions/misses_total": self.session_misses,
            "sessions/retained": state.get("sessions", 0),
            "sessions/retained_tokens": state.get("session_tokens", 0),
            "sessions/evicted_total": state.get("session_evicted", 0),
            "sessions/pinned": state.get("pinned_sessions", 0),
            "sessions/version_misses_total": self.session_version_misses,
            "versions/resident": state.get("resident_versions", 1),
            "versions/freed_total": self.versions_freed,
            "versions/evicted_total": self.versions_evicted,
            "requests/finished_total": self.finished,
            "requests/aborted_total": self.aborted,
            "steps/total": self.steps,
            "steps/decode_forwards_total": self.decode_steps,
            "time/prefill_s": self.prefill_s,
            "time/decode_s": self.decode_s,
            "time/sample_s": self.sample_s,
            "updates/total": self.updates,
            "updates/pause_s_total": self.update_pause_s,
            "updates/pause_s_last": self.last_update_pause_s,
        }
        return {k: float(v) for k, v in snap.items()}
