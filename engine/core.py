"""The embedded engine: continuous batching with exact per-token provenance.

One thread (the engine thread) owns the model, the KV rows, the session store and every
sequence; other threads talk to it only through commands, answered by futures. Each step:

1. apply commands (new requests, aborts, pause/resume, weight updates, session release);
2. admit waiting requests into free rows (new sequences join between decode steps): restore
   the session's retained KV for the longest common prefix, prefill only the rest; requests
   admitted together with the same uncached prompt (a group's G members) share one prefill:
   the first computes it, the others copy its KV row and its last logits;
3. decode one token for every sequence admitted in an earlier step, in one batched forward;
4. sample every row from its processed distribution and record, per token: id, processed
   log-prob, weights version of the forward, oldest version among the KV entries it attended
   to, seconds since the request arrived, and optionally the top-k of the processed
   distribution;
5. finish sequences (stop id, EOS, max_tokens, context limit, abort), keep their KV for their
   session, and compact the rows.

Several weights versions can be resident at once (`engine.versions`): each has its own model
copy and KV rows, and step 3 runs one batched forward per version that has running sequences.
A request may be pinned to a version (`weights_version`); unpinned requests use the current
(newest) version.

Guarantees: weights change only between two steps. Update modes:

- `inflight`: applies at the next step boundary; running unpinned sequences continue under the
  new weights; with `kv=recompute` their context is re-prefilled under the new weights first,
  with `kv=retain` the old entries stay and the tokens that attend to them carry the older KV
  version. Pinned sequences keep their version.
- `drain`: stops admitting, lets running unpinned sequences finish under their weights, swaps.
- `pin`: the new version becomes current for unpinned requests and for requests pinned to it;
  nothing running changes weights (a running unpinned request finishes on the version it
  started with). Older versions stay resident while a running sequence, a waiting request or a
  live session (pinned by a request, until `release_session`) references them, and are freed
  once nothing does; at most `max_resident_versions` are held (the oldest are evicted: their
  pinned requests fail with `VersionNotResident`, unpinned ones move to the current version
  with their context recomputed). A freed version's memory is kept as one spare for the next
  new version while that stays within the cap, so steady pinning does not copy the model.

`kv` also decides whether an unpinned request may reuse a session cache built by another
version (`retain`: yes, and its tokens record the older KV version; `recompute`: no). A pinned
request reuses a session cache only if every entry was computed by its own version, so a
pinned trajectory's tokens are exactly those of its version. Within a sequence the weights
version never decreases. Every submitted request ends with an output (finish reason `stop`,
`length` or `abort`) or with an exception on its future (`VersionNotResident`, or
`EngineStopped` if the engine stops or fails).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import torch

from config.engine import EngineServerConfig
from core.engine_api import KvPolicy, PauseMode, UpdateMode, UpdateWeightsReply
from core.numerics import DtypeSetting, resolve_dtype
from engine.checkpoint import eos_token_ids, load_model, read_config, read_state_dict
from engine.forward import RowForward
from engine.metrics import EngineMetrics
from engine.requests import (
    EngineOutput,
    EngineStopped,
    RequestError,
    SamplingSpec,
    TokenEvent,
)
from engine.sampling import sample
from engine.sessions import SessionCache, SessionStore, VersionSpans
from engine.versions import (
    VersionNotResident,
    WeightsSlot,
    build_slot,
    not_resident_message,
    plan_residency,
)

log = logging.getLogger("stalewise.engine")

TokenListener = Callable[[TokenEvent], None]
UPDATE_MODES = get_args(UpdateMode)
DEFAULTS = EngineServerConfig()  # the one home of the engine's defaults
MAX_GONE_REASONS = 256  # why recent versions left, for error messages


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    spec: SamplingSpec
    session_id: str | None
    arrival: float
    future: Future
    listener: TokenListener | None
    weights_version: int | None = None   # pinned version; None = the current one


@dataclass(eq=False)
class _Sequence:
    request: _Request
    slot: WeightsSlot
    row: int
    context: list[int]
    n_fed: int
    spans: VersionSpans
    output: EngineOutput
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    finish: str | None = None

    @property
    def pinned(self) -> bool:
        return self.request.weights_version is not None


@dataclass
class _Update:
    state: dict[str, torch.Tensor]
    version: int
    path: str
    mode: UpdateMode
    kv: KvPolicy
    received: float
    future: Future


@dataclass
class _Command:
    kind: str
    future: Future
    args: dict[str, Any] = field(default_factory=dict)


def _copy_outcome(source: Future, target: Future) -> None:
    if source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result())


def _share_prompts(seqs: list[_Sequence]
                   ) -> tuple[list[_Sequence], list[tuple[_Sequence, _Sequence]]]:
    """Split sequences admitted together on one slot into those to prefill and (copy, leader)
    pairs: a sequence with nothing cached whose prompt equals an earlier one's (the members of
    a GRPO group) takes the leader's KV row and last logits instead of computing them again."""
    computed: list[_Sequence] = []
    copies: list[tuple[_Sequence, _Sequence]] = []
    leaders: dict[tuple[int, ...], _Sequence] = {}
    for seq in seqs:
        key = tuple(seq.context) if seq.n_fed == 0 else None
        leader = leaders.get(key) if key is not None else None
        if leader is not None:
            copies.append((seq, leader))
            continue
        computed.append(seq)
        if key is not None:
            leaders[key] = seq
    return computed, copies


class Engine:
    """Continuous-batching engine over one Hugging Face checkpoint (see module docstring)."""

    def __init__(self, model_dir: str | Path, *, version: int = 0,
                 max_batch: int = DEFAULTS.max_batch,
                 session_cache_mb: float = DEFAULTS.session_cache_mb, seed: int = 0,
                 max_prefill_tokens: int = DEFAULTS.max_prefill_tokens,
                 max_model_len: int | None = None, engine_id: str | None = None,
                 max_resident_versions: int = DEFAULTS.max_resident_versions,
                 dtype: DtypeSetting = DEFAULTS.dtype) -> None:
        if max_resident_versions < 1:
            raise ValueError(f"max_resident_versions must be >= 1, got {max_resident_versions}")
        self.model_dir = Path(model_dir)
        config = read_config(self.model_dir)
        self.dtype = resolve_dtype(dtype, hidden_size=int(config.get("hidden_size", 0)))
        model = load_model(self.model_dir, self.dtype)
        self._current = WeightsSlot(version, str(self.model_dir), model,
                                    RowForward(model, rows=max_batch, max_len=max_model_len))
        self._slots: dict[int, WeightsSlot] = {version: self._current}
        self.eos_ids = frozenset(eos_token_ids(self.model_dir, model))
        self.vocab_size = self._current.forward.vocab_size
        self.max_len = self._current.forward.max_len
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.max_resident_versions = max_resident_versions
        self._max_model_len = max_model_len
        self.engine_id = engine_id or f"stalewise-{uuid.uuid4().hex[:8]}"
        self.version = version
        self.resident_versions: tuple[int, ...] = (version,)  # published copy for other threads
        self.metrics = EngineMetrics()
        self.session_cache_mb = session_cache_mb
        self.sessions = SessionStore(int(session_cache_mb * 2**20))
        self._session_pins: dict[str, int] = {}   # live sessions pinned to a version
        self._kv_policy: KvPolicy = "recompute"   # of the last update: reuse of older caches
        self._gone: dict[int, str] = {}           # version -> why it is no longer resident
        self._spare: WeightsSlot | None = None    # a freed slot kept for the next new version
        self._refs_changed = False
        self._generator = torch.Generator().manual_seed(seed)
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._waiting: deque[_Request] = deque()
        self._updates: deque[_Update] = deque()
        self._pause_waiters: list[Future] = []
        self._paused = False
        self._stopping = False
        self._failure: BaseException | None = None
        self._accepted_version = version
        self._accepted_path = str(self.model_dir)
        self._thread: threading.Thread | None = None

    # ---- public, thread-safe -------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        """The current version's model (shapes are the same for every version)."""
        return self._current.model

    @property
    def forward(self) -> RowForward:
        """The current version's batched forward and KV rows."""
        return self._current.forward

    @property
    def weights_path(self) -> str:
        return self._current.path

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="stalewise-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is None:
            return
        self._send("stop")
        self._thread.join(timeout)
        self._thread = None
        # commands that raced the shutdown still get an answer
        self._fail_everything(EngineStopped("engine stopped"))

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def submit(self, prompt_token_ids: list[int], spec: SamplingSpec, *,
               session_id: str | None = None, request_id: str | None = None,
               listener: TokenListener | None = None,
               weights_version: int | None = None) -> Future:
        """Queue a request; the future resolves to an `EngineOutput`. Raises `RequestError`.

        `weights_version` pins the request to that version's weights (and pins its session to
        it until `release_session`); a version that is not resident fails the future with
        `VersionNotResident`."""
        prompt = [int(t) for t in prompt_token_ids]
        self._validate_prompt(prompt, spec)
        if weights_version is not None and (isinstance(weights_version, bool)
                                            or not isinstance(weights_version, int)
                                            or weights_version < 0):
            raise RequestError(f"weights_version must be a version number >= 0 or None, "
                               f"got {weights_version!r}")
        request = _Request(request_id or uuid.uuid4().hex, prompt, spec, session_id,
                           time.monotonic(), Future(), listener, weights_version)
        self._send("submit", request=request, future=request.future)
        return request.future

    def load_weights(self, path: str | Path) -> dict[str, torch.Tensor]:
        """Read and validate a checkpoint (any thread; decoding continues meanwhile)."""
        return read_state_dict(path, self.model)

    def update_weights(self, state: dict[str, torch.Tensor], *, version: int, path: str,
                       mode: UpdateMode = "inflight", kv: KvPolicy = "recompute") -> Future:
        """Queue a weight swap; the future resolves to an `UpdateWeightsReply` once it is applied."""
        if mode not in UPDATE_MODES:
            raise RequestError(f"mode must be 'inflight', 'drain' or 'pin', got {mode!r}")
        if kv not in get_args(KvPolicy):
            raise RequestError(f"kv must be 'retain' or 'recompute', got {kv!r}")
        future: Future = Future()
        update = _Update(state, int(version), str(path), mode, kv, time.monotonic(), future)
        self._send("update", update=update, future=future)
        return future

    def pause(self, mode: PauseMode = "keep") -> Future:
        if mode not in get_args(PauseMode):
            raise RequestError(f"pause mode must be 'keep', 'wait' or 'abort', got {mode!r}")
        return self._send("pause", mode=mode)

    def resume(self) -> Future:
        return self._send("resume")

    def abort(self, request_id: str | None = None) -> Future:
        """Abort one request (or all, with None); resolves to the number aborted."""
        return self._send("abort", request_id=request_id)

    def release_session(self, session_id: str) -> Future:
        """Forget a session's retained KV and its version pin; resolves to the tokens released."""
        return self._send("release", session_id=session_id)

    def reset_cache(self, reset_running: bool = False) -> Future:
        """Drop retained session caches; with `reset_running`, re-prefill running sequences."""
        return self._send("reset", reset_running=reset_running)

    def snapshot(self) -> dict[str, float]:
        slots = list(self._slots.values())
        return self.metrics.snapshot(
            running=sum(len(s.active) for s in slots), waiting=len(self._waiting),
            paused=self._paused, version=self.version, sessions=len(self.sessions),
            session_tokens=self.sessions.tokens, session_evicted=self.sessions.evicted,
            resident_versions=len(self.resident_versions),
            pinned_sessions=len(self._session_pins))

    # ---- validation ------------------------------------------------------------------------
    def _validate_prompt(self, prompt: list[int], spec: SamplingSpec) -> None:
        if not prompt:
            raise RequestError("prompt_token_ids is empty; send at least one token id")
        if len(prompt) >= self.max_len:
            raise RequestError(f"prompt has {len(prompt)} tokens; the model's context is "
                               f"{self.max_len}, so at most {self.max_len - 1} fit with one "
                               f"sampled token")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary "
                               f"[0, {self.vocab_size})")
        bad = [t for t in spec.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"stop token id {bad[0]} is outside the vocabulary "
                               f"[0, {self.vocab_size})")
        if spec.logprobs_topk > self.vocab_size:
            raise RequestError(f"asked for the top {spec.logprobs_topk} log-probs "
                               "(logprobs_topk; logprobs on /v1/completions), more than the "
                               f"vocabulary's {self.vocab_size} ids; ask for at most "
                               f"{self.vocab_size}")

    def _send(self, kind: str, future: Future | None = None, **args: Any) -> Future:
        future = future or Future()
        if self._failure is not None:
            future.set_exception(EngineStopped(f"engine failed: {self._failure!r}"))
            return future
        if self._thread is None and kind != "stop":
            future.set_exception(EngineStopped("engine is not running; call start() first"))
            return future
        self._commands.put(_Command(kind, future, args))
        return future

    # ---- engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)  # per thread: nothing the engine computes needs autograd
        try:
            while not self._stopping:
                self._take_commands(block=not self._has_work())
                if self._stopping:
                    break
                self._apply_ready_updates()
                if self._refs_changed:  # a release or an abort: free versions before the step
                    self._settle_versions()
                self._settle_pause_waiters()
                if self._has_work():
                    self._step()
                if self._refs_changed:  # sequences of old versions finished
                    self._settle_versions()
        except BaseException as exc:  # a broken forward must not leave callers waiting forever
            log.exception("engine thread failed")
            self._failure = exc
        finally:
            self._fail_everything(EngineStopped(
                "engine stopped" if self._failure is None else f"engine failed: {self._failure!r}"))

    def _running(self) -> Iterator[_Sequence]:
        for slot in list(self._slots.values()):
            yield from list(slot.active)

    def _n_running(self) -> int:
        return sum(len(slot.active) for slot in self._slots.values())

    def _admission_blocked(self) -> bool:
        return self._paused or bool(self._pause_waiters) or any(
            u.mode == "drain" for u in self._updates)

    def _has_work(self) -> bool:
        if self._paused:
            return False
        return self._n_running() > 0 or (bool(self._waiting) and not self._admission_blocked())

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, command: _Command) -> None:
        kind, future, args = command.kind, command.future, command.args
        if kind == "submit":
            self._accept_request(args["request"])
        elif kind == "stop":
            self._stopping = True
            future.set_result(None)
        elif kind == "update":
            self._accept_update(args["update"])
        elif kind == "pause":
            self._start_pause(args["mode"], future)
        elif kind == "resume":  # also settles a pause(wait) still waiting: paused, then resumed
            self._paused = False
            for waiter in self._pause_waiters:
                waiter.set_result(None)
            self._pause_waiters.clear()
            future.set_result(None)
        elif kind == "abort":
            future.set_result(self._abort(args["request_id"]))
        elif kind == "release":
            cache = self.sessions.pop(args["session_id"])
            if self._session_pins.pop(args["session_id"], None) is not None:
                self._refs_changed = True
            future.set_result(0 if cache is None else len(cache.token_ids))
        elif kind == "reset":
            future.set_result(self._reset(args["reset_running"]))
        else:  # pragma: no cover - programming error
            future.set_exception(ValueError(f"unknown engine command {kind!r}"))

    def _accept_request(self, request: _Request) -> None:
        pinned, session = request.weights_version, request.session_id
        if pinned is not None and pinned not in self._slots:
            request.future.set_exception(self._not_resident(pinned))
            return
        if session is not None:
            before = self._session_pins.pop(session, None)  # an unpinned turn unpins it
            if pinned is not None:
                self._session_pins[session] = pinned
            if before is not None and before != pinned:
                self._refs_changed = True
        self._waiting.append(request)

    def _not_resident(self, version: int) -> VersionNotResident:
        return VersionNotResident(not_resident_message(
            version, resident=tuple(sorted(self._slots)), current=self.version,
            gone=self._gone.get(version)))

    # ---- pause / abort / reset -------------------------------------------------------------
    def _start_pause(self, mode: PauseMode, future: Future) -> None:
        if mode == "abort":
            self._abort(None)
        if mode == "wait" and self._n_running():
            self._pause_waiters.append(future)
            return
        self._paused = True
        future.set_result(None)

    def _settle_pause_waiters(self) -> None:
        if self._pause_waiters and not self._n_running():
            self._paused = True
            for future in self._pause_waiters:
                future.set_result(None)
            self._pause_waiters.clear()

    def _abort(self, request_id: str | None) -> int:
        count = 0
        for request in list(self._waiting):
            if request_id is None or request.request_id == request_id:
                self._waiting.remove(request)
                output = EngineOutput(request.request_id, len(request.prompt), 0,
                                      request.spec.logprobs_topk, finish_reason="abort")
                request.future.set_result(output)
                count += 1
        for seq in self._running():
            if request_id is None or seq.request.request_id == request_id:
                seq.finish = "abort"
                count += 1
        self._retire_finished()
        self.metrics.aborted += count
        self._refs_changed = self._refs_changed or count > 0
        return count

    def _reset(self, reset_running: bool) -> dict[str, int]:
        dropped = self.sessions.clear()
        recomputed = self._recompute(list(self._running())) if reset_running else 0
        return {"sessions_dropped": dropped, "recomputed_tokens": recomputed}

    def _recompute(self, seqs: list[_Sequence]) -> int:
        """Re-prefill the fed context of `seqs` under their slot's weights (exact KV)."""
        start = time.perf_counter()
        total = 0
        for seq in seqs:
            if seq.n_fed:
                seq.slot.forward.prefill(seq.row, seq.context[: seq.n_fed], 0)
                seq.spans.reset(seq.n_fed, seq.slot.version)
                total += seq.n_fed
        self.metrics.add_prefill(time.perf_counter() - start, total)
        self.metrics.recomputed_tokens += total
        return total

    # ---- rows of a slot ----------------------------------------------------------------------
    def _detach(self, seq: _Sequence) -> None:
        """Take `seq` out of its slot's rows; the slot's last row moves into its place."""
        active = seq.slot.active
        index = active.index(seq)
        last = active.pop()
        if last is not seq:
            seq.slot.forward.copy_row(last.row, seq.row, last.n_fed)
            last.row = seq.row
            active[index] = last

    def _move(self, seq: _Sequence, target: WeightsSlot, *, copy_kv: bool) -> None:
        """Move a running sequence to `target`'s rows, with its KV entries (`copy_kv`) or
        without (the caller recomputes them)."""
        kv = seq.slot.forward.read_row(seq.row, seq.n_fed) if copy_kv and seq.n_fed else None
        self._detach(seq)
        seq.slot, seq.row = target, len(target.active)
        target.active.append(seq)
        if kv is not None:
            target.forward.write_row(seq.row, kv, seq.n_fed)

    # ---- weight updates and resident versions ------------------------------------------------
    def _accept_update(self, update: _Update) -> None:
        if update.version == self._accepted_version and update.path == self._accepted_path:
            pending = next((u for u in self._updates if u.version == update.version), None)
            if pending is not None:  # a retry of an update still waiting (drain): same outcome
                pending.future.add_done_callback(lambda done: _copy_outcome(done, update.future))
            else:
                update.future.set_result(UpdateWeightsReply(
                    version=update.version, previous_version=update.version, path=update.path,
                    mode=update.mode, kv=update.kv, wait_s=0.0, pause_s=0.0,
                    in_flight_sequences=0, recomputed_tokens=0, invalidated_sessions=0,
                    already_applied=True, resident_versions=self.resident_versions))
            return
        if update.version <= self._accepted_version:
            update.future.set_exception(RequestError(
                f"weights version {update.version} is not newer than version "
                f"{self._accepted_version} already accepted; publish versions in increasing order"))
            return
        self._accepted_version = update.version
        self._accepted_path = update.path
        self._updates.append(update)

    def _apply_ready_updates(self) -> None:
        while self._updates:
            update = self._updates[0]
            if update.mode == "drain" and any(not s.pinned for s in self._running()):
                return
            self._updates.popleft()
            self._apply_update(update)

    def _referenced(self, slot: WeightsSlot, ignore: frozenset[int] = frozenset()) -> bool:
        """Does anything still need `slot`'s weights (sequences in `ignore` aside, by id)?"""
        version = slot.version
        return (any(id(s) not in ignore for s in slot.active)
                or version in self._session_pins.values()
                or any(r.weights_version == version for r in self._waiting))

    def _apply_update(self, update: _Update) -> None:
        start = time.perf_counter()
        previous, previous_version = self._current, self.version
        # inflight (and drain, where none is left running): unpinned sequences follow the update
        movers = [] if update.mode == "pin" else [s for s in self._running() if not s.pinned]
        if not self._referenced(previous, ignore=frozenset(id(s) for s in movers)):
            del self._slots[previous.version]   # nothing else needs these weights: overwrite
            previous.overwrite(update.state, update.version, update.path)
            slot = previous
        elif self._spare is not None:  # reuse a freed slot's memory: no copy, no allocation
            slot, self._spare = self._spare, None
            slot.overwrite(update.state, update.version, update.path)
        else:
            slot = build_slot(previous.model, update.state, version=update.version,
                              path=update.path, rows=self.max_batch, max_len=self._max_model_len)
        self._slots[update.version] = slot
        self._current = slot
        self.version = update.version
        for seq in movers:
            if seq.slot is not slot:
                self._move(seq, slot, copy_kv=update.kv == "retain")
        recomputed = invalidated = 0
        if update.kv == "recompute":
            invalidated = self._drop_unpinned_sessions()
            recomputed = self._recompute(movers)
        self._kv_policy = update.kv
        evicted = self._settle_versions()
        pause = time.perf_counter() - start
        self.metrics.add_update(pause)
        update.future.set_result(UpdateWeightsReply(
            version=update.version, previous_version=previous_version, path=update.path,
            mode=update.mode,
            kv=update.kv, wait_s=time.monotonic() - update.received - pause, pause_s=pause,
            in_flight_sequences=len(movers), recomputed_tokens=recomputed,
            invalidated_sessions=invalidated, resident_versions=self.resident_versions,
            evicted_versions=evicted))

    def _drop_unpinned_sessions(self) -> int:
        """kv=recompute: retained caches of unpinned sessions cannot be reused any more."""
        dropped = [sid for sid in self.sessions.session_ids() if sid not in self._session_pins]
        for sid in dropped:
            self.sessions.pop(sid)
        return len(dropped)

    def _settle_versions(self) -> tuple[int, ...]:
        """Free unreferenced old versions; evict the oldest beyond the cap. Returns evicted."""
        self._refs_changed = False
        referenced = {v for v, slot in self._slots.items() if self._referenced(slot)}
        plan = plan_residency(list(self._slots), current=self.version, referenced=referenced,
                              max_resident=self.max_resident_versions)
        for version in plan.freed:
            self._keep_spare(self._slots.pop(version))
            self._remember_gone(version, "freed when no running request or pinned session "
                                         "used it any more")
            self.metrics.versions_freed += 1
        for version in plan.evicted:
            self._keep_spare(self._evict(self._slots.pop(version)))
        self.resident_versions = tuple(sorted(self._slots))
        return plan.evicted

    def _keep_spare(self, slot: WeightsSlot) -> None:
        """Keep one dropped slot for the next version, while that stays within the cap on
        model copies (resident versions plus the spare)."""
        if self._spare is None and len(self._slots) < self.max_resident_versions:
            slot.active.clear()
            self._spare = slot

    def _evict(self, slot: WeightsSlot) -> WeightsSlot:
        reason = (f"evicted to keep at most max_resident_versions="
                  f"{self.max_resident_versions} versions resident")
        self._remember_gone(slot.version, reason)
        self.metrics.versions_evicted += 1
        error = VersionNotResident(
            f"weights version {slot.version} was {reason} while this request needed it; "
            f"current version {self.version}; raise --max-resident-versions or release "
            f"finished sessions sooner")
        moved = []
        for seq in list(slot.active):
            if seq.pinned:
                seq.request.future.set_exception(error)
                self.metrics.aborted += 1
            else:  # an unpinned request finishes on the current version, context recomputed
                self._move(seq, self._current, copy_kv=False)
                moved.append(seq)
        slot.active.clear()
        self._recompute(moved)
        for request in [r for r in self._waiting if r.weights_version == slot.version]:
            self._waiting.remove(request)
            request.future.set_exception(error)
            self.metrics.aborted += 1
        for session in [s for s, v in self._session_pins.items() if v == slot.version]:
            del self._session_pins[session]
        return slot

    def _remember_gone(self, version: int, reason: str) -> None:
        self._gone[version] = reason
        while len(self._gone) > MAX_GONE_REASONS:
            del self._gone[next(iter(self._gone))]

    # ---- one step ------------------------------------------------------------------------------
    def _step(self) -> None:
        decoding = [(slot, len(slot.active)) for slot in self._slots.values() if slot.active]
        admitted: list[tuple[_Sequence, torch.Tensor]] = []
        if not self._admission_blocked():
            admitted = self._admit()
        seqs: list[_Sequence] = []
        logits_parts: list[torch.Tensor] = []
        for slot, n_old in decoding:  # one batched forward per resident version in use
            start = time.perf_counter()
            old = slot.active[:n_old]
            ids_B = torch.tensor([s.context[s.n_fed] for s in old])
            positions_B = torch.tensor([s.n_fed for s in old])
            logits_parts.append(slot.forward.decode(ids_B, positions_B))
            for seq in old:
                seq.n_fed += 1
                seq.spans.append(1, slot.version)
            seqs.extend(old)
            self.metrics.add_decode(time.perf_counter() - start, n_old)
        if admitted:
            seqs.extend(seq for seq, _ in admitted)
            logits_parts.append(torch.stack([logits for _, logits in admitted]))
        if logits_parts:
            self._sample(seqs, torch.cat(logits_parts) if len(logits_parts) > 1 else logits_parts[0])
        self._retire_finished()

    def _admit(self) -> list[tuple[_Sequence, torch.Tensor]]:
        """Place waiting requests in free rows (up to the prefill token budget), then prefill
        them together: one forward per weights version among them."""
        placed: list[_Sequence] = []
        budget = self.max_prefill_tokens
        start = time.perf_counter()
        prefilled = 0
        while self._waiting and self._n_running() < self.max_batch:
            request = self._waiting[0]
            if placed and len(request.prompt) > budget:
                break
            self._waiting.popleft()
            seq, count = self._place(request)
            placed.append(seq)
            budget -= count
            prefilled += count
        logits: dict[int, torch.Tensor] = {}
        for slot in {id(seq.slot): seq.slot for seq in placed}.values():
            computed, copies = _share_prompts([seq for seq in placed if seq.slot is slot])
            rows_logits = slot.forward.prefill_many(
                [(seq.row, seq.context[seq.n_fed:], seq.n_fed) for seq in computed])
            for seq, row_logits in zip(computed, rows_logits):
                logits[id(seq)] = row_logits
            for seq, leader in copies:  # a group's G members: one prefill, G - 1 row copies
                slot.forward.copy_row(leader.row, seq.row, len(seq.context))
                logits[id(seq)] = logits[id(leader)]
                prefilled -= len(seq.context)
                self.metrics.shared_prompt_tokens += len(seq.context)
            for seq in computed + [seq for seq, _ in copies]:
                seq.spans.append(len(seq.context) - seq.n_fed, seq.slot.version)
                seq.n_fed = len(seq.context)
        if placed:
            self.metrics.add_prefill(time.perf_counter() - start, prefilled)
        return [(seq, logits[id(seq)]) for seq in placed]

    def _place(self, request: _Request) -> tuple[_Sequence, int]:
        """Put a request into the next free row of its version, restoring its session's KV."""
        spec = request.spec
        slot = self._current if request.weights_version is None else \
            self._slots[request.weights_version]  # evicting a version fails its waiting requests
        stop_ids = frozenset(spec.stop_token_ids) | (frozenset() if spec.ignore_eos else self.eos_ids)
        generator = None if spec.seed is None else torch.Generator().manual_seed(spec.seed)
        output = EngineOutput(request.request_id, len(request.prompt), 0, spec.logprobs_topk)
        seq = _Sequence(request, slot, len(slot.active), list(request.prompt), 0, VersionSpans(),
                        output, stop_ids, generator)
        slot.active.append(seq)  # from here on a failure resolves its future
        cache = self.sessions.pop(request.session_id) if request.session_id else None
        if cache is not None and not self._reusable(cache, seq):
            self.metrics.session_version_misses += 1
            cache = None
        if cache is not None:
            cached = min(cache.common_prefix(request.prompt), len(request.prompt) - 1)
            if cached > 0:
                slot.forward.write_row(seq.row, cache.kv, cached)
                seq.spans = cache.spans.copy()
                seq.spans.truncate(cached)
                seq.n_fed = output.cached_prompt_tokens = cached
        self.metrics.add_prompt(len(request.prompt), seq.n_fed,
                                session=request.session_id is not None)
        return seq, len(request.prompt) - seq.n_fed

    def _reusable(self, cache: SessionCache, seq: _Sequence) -> bool:
        """A cache built entirely by the sequence's version is always reusable; a cache from
        other versions only by an unpinned request after a `kv=retain` update."""
        if cache.spans.versions() <= {seq.slot.version}:
            return True
        return not seq.pinned and self._kv_policy == "retain"

    def _sample(self, seqs: list[_Sequence], logits_B_V: torch.Tensor) -> None:
        start = time.perf_counter()
        batch = len(seqs)
        specs = [s.request.spec for s in seqs]
        suppress = None
        for i, seq in enumerate(seqs):
            # min_tokens: stop ids get no mass yet (unless that would leave no token at all)
            if (len(seq.output.token_ids) < seq.request.spec.min_tokens
                    and 0 < len(seq.stop_ids) < self.vocab_size):
                if suppress is None:
                    suppress = torch.zeros(batch, self.vocab_size, dtype=torch.bool)
                suppress[i, list(seq.stop_ids)] = True
        uniforms_B = torch.rand(batch, generator=self._generator, dtype=torch.float64)
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                uniforms_B[i] = torch.rand((), generator=seq.generator, dtype=torch.float64)
        topk = max(s.logprobs_topk for s in specs)
        out = sample(logits_B_V,
                     torch.tensor([s.temperature for s in specs], dtype=torch.float32),
                     torch.tensor([s.top_k for s in specs]),
                     torch.tensor([s.top_p for s in specs], dtype=torch.float32),
                     uniforms_B, topk=topk, suppress_B_V=suppress)
        token_ids = out.token_ids_B.tolist()
        logprobs = out.logprobs_B.tolist()
        topk_ids = out.topk_ids_B_K.tolist() if topk else None
        topk_lps = out.topk_logprobs_B_K.tolist() if topk else None
        now = time.monotonic()
        for i, seq in enumerate(seqs):
            self._record(seq, token_ids[i], logprobs[i], now,
                         topk_ids[i] if topk_ids else None, topk_lps[i] if topk_lps else None)
        self.metrics.add_sample(time.perf_counter() - start, batch)

    def _record(self, seq: _Sequence, token: int, logprob: float, now: float,
                topk_ids: list[int] | None, topk_lps: list[float] | None) -> None:
        out, spec = seq.output, seq.request.spec
        weights_version = seq.slot.version
        kv_version = seq.spans.oldest()
        kv_version = weights_version if kv_version is None else kv_version
        offset = now - seq.request.arrival
        out.token_ids.append(token)
        out.sampler_logprobs.append(logprob)
        out.weights_versions.append(weights_version)
        out.kv_versions.append(kv_version)
        out.time_offsets.append(offset)
        k = spec.logprobs_topk
        event_topk_ids = event_topk_lps = None
        if k:
            event_topk_ids, event_topk_lps = topk_ids[:k], topk_lps[:k]
            out.topk_ids.append(event_topk_ids)
            out.topk_logprobs.append(event_topk_lps)
        seq.context.append(token)
        if token in seq.stop_ids:
            seq.finish = "stop"
        elif len(out.token_ids) >= spec.max_tokens or len(seq.context) >= self.max_len:
            seq.finish = "length"
        if seq.request.listener is not None:
            event = TokenEvent(len(out.token_ids) - 1, token, logprob, weights_version,
                               kv_version, offset, event_topk_ids, event_topk_lps)
            try:
                seq.request.listener(event)
            except Exception:  # a broken listener loses its stream, not the engine
                log.exception("token listener of request %s failed", seq.request.request_id)
                seq.request.listener = None

    def _retire_finished(self) -> None:
        """Finish sequences marked done: keep their session KV, free and compact their rows."""
        for slot in list(self._slots.values()):
            active = slot.active
            index = len(active) - 1
            while index >= 0:
                seq = active[index]
                if seq.finish is not None:
                    self._finish(seq)
                    last = active.pop()  # the last row fills the freed one
                    if last is not seq:
                        slot.forward.copy_row(last.row, seq.row, last.n_fed)
                        last.row = seq.row
                        active[index] = last
                    if slot is not self._current:
                        self._refs_changed = True
                index -= 1

    def _finish(self, seq: _Sequence) -> None:
        request = seq.request
        if request.session_id is not None and seq.n_fed > 0:
            kv = seq.slot.forward.read_row(seq.row, seq.n_fed)
            spans = seq.spans.copy()
            spans.truncate(seq.n_fed)
            nbytes = seq.n_fed * seq.slot.forward.bytes_per_token()
            self.sessions.put(request.session_id,
                              SessionCache(seq.context[: seq.n_fed], kv, spans, nbytes))
        seq.output.finish_reason = seq.finish  # type: ignore[assignment]
        self.metrics.finished += 1
        request.future.set_result(seq.output)

    def _fail_everything(self, error: BaseException) -> None:
        for slot in list(self._slots.values()):
            for seq in slot.active:
                if not seq.request.future.done():
                    seq.request.future.set_exception(error)
            slot.active.clear()
        for request in self._waiting:
            if not request.future.done():
                request.future.set_exception(error)
        self._waiting.clear()
        for update in self._updates:
            update.future.set_exception(error)
        self._updates.clear()
        for future in self._pause_waiters:
            future.set_exception(error)
        self._pause_waiters.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if not command.future.done():
                command.future.set_exception(error)
