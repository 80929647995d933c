"""Throughput study: sync vs async vs inflight (KV retain / recompute) on `longhaul`.

Every mode runs the real pipeline (agent loops, admission, the SQLite store, the learner
stream) on the same workload and the same compute: the `longhaul` suite (k sequential tool
calls, each with a heavy-tailed lognormal latency), trajectories replayed by the scripted
engine behind a finite-capacity engine model (slots, per-token decode and prefill cost, the
real cost of each weight-update mode), and a learner whose step costs a fixed time per
trajectory (`--learner-s` per `--batch` trajectories). Every mode consumes the same number of
trajectories.

The `sync` baseline is given its best shot: its batch is the whole concurrency budget
(`--slots` trajectories per learner step, so one round fills every slot; the learner step
costs proportionally more), and a group dropped by admission is replaced at once, not after
the round. `sync b=BATCH` (the async modes' batch, most slots idle) is printed for reference.

The ideal bound is computed from the workload alone, never from a mode's measurements: the
instances the run dispatches, the demonstration the scripted policy replays for each of their
trajectories (correct or wrong, drawn from the trajectory's id: `replays_correct`), those
demonstrations' tool latencies and sampled tokens, the share of these groups dynamic sampling
keeps (those with both a correct and a wrong member: 78% of the first hundred groups, where
1 - p^G - (1-p)^G = 84% is the long-run share), and the learner's time per trajectory:

    ideal = min(slots / E[duration] * kept, engine_slots / E[decode time] * kept,
                batch / learner_s)

where a trajectory's duration is its tool latencies plus its decode time with no queueing
(prefill and store costs are left out, so the bound is optimistic). The async modes keep the
work dispatched and not yet consumed within (max_lag + 1) batches (the staleness bound), so
the "lag ideal" puts min(slots, (max_lag + 1) * batch) in place of slots: what an async mode
could reach with that bound and no other loss (`--reserve expected` counts work in flight as
the share admitted so far instead, so more of it runs, and the bound is then looser than the
lag ideal's; `--reserve 0.8` counts it as that share but never less than 0.8, and `--reserves`
adds an async row per value; `--cancel-stale` stops work in flight that could only be
dropped). The "staleness-feasible" bound caps what any schedule admits with max_lag enforced
on admission, whatever its dispatch rule, and the share of its dispatched trajectories it must
stop as stale to get there (`staleness_feasible`): where the learner is fast, it can only be
approached by dropping the long tail. A finite run also loses its ramp-up and drain, which the
ideal leaves out: the "run ideal" (`run_ideal`) is what a schedule with no overhead and no
staleness bound admits over this run's length, and "of run ideal" holds each mode to it. The
steady-state table reads the middle half of each run (between its 25th and 75th percentile
admission, no ramp-up or drain) and gives Little's law's factors: admitted rate = mean in
flight / mean duration x admitted share. After the table, the seconds each async mode's
dispatch waited, by what held it first (concurrency, queue, staleness, pacing). `--orders`
adds async rows under other `[admission] order`s (the order decided groups enter the learner
stream): their throughput and ledger skew. "learner busy" is the share of wall time the
learner spent in steps; "engine active" the share with at least one request in progress (not
how full its slots were).

Then a sweep over the learner step time prints the speed-up curve of async over sync: the
gain depends on the ratio of generation time to learner time.

With `--reweight propensity` every mode admits with selection-bias weights (`core.selection`)
and the table adds the TVs of the admitted mix weighted by them: the mix the learner's loss
sees, against the generated one; and `beyond weights`, the share of generated work in buckets
no weight within the clip can restore (`core.selection.beyond_weights_share`): where it is
large, the weighted TVs cannot come down. `--pacing TV` holds dispatch while the admitted mix of the
latest decisions is further than TV from the generated one; compare its rows' adm/s and TVs
with a run without it.

    .venv/bin/python bench/pipeline.py [--steps 16] [--batch 16] [--quick] [--sweep 0.1,0.4,1.6]
                                       [--reweight propensity] [--pacing 0.05]
                                       [--orders in_order,weight_fifo]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this folder is first on sys.path, where bench/engine.py and bench/learner.py
# would shadow the packages of the same names: drop it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import heapq
import math
import tempfile
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from statistics import fmean

import anyio

from config.job import parse_config
from core.store.store import Store
from core.tiny_tokenizer import build_tiny_tokenizer
from orchestrator.engines.scripted import ScriptedEngine
from orchestrator.pipeline import Pipeline
from orchestrator.report import store_ledger
from orchestrator.testing import CapacityEngine, DemoScript, FakeLearner, replays_correct
from orchestrator.writer import running_writer
from tasks.chat import make_chat_format
from tasks.suites import longhaul
from tasks.testing import FakeSandbox

CORRECT_SHARE = 0.6  # the scripted policy's share of correct demonstrations
MODES = [("sync", "recompute", "slots"), ("sync", "recompute", "batch"),
         ("async", "recompute", "batch"), ("inflight", "retain", "batch"),
         ("inflight", "recompute", "batch")]


@dataclass(frozen=True)
class Bound:
    """The ideal admitted rate of a workload and the limit that sets it."""

    per_s: float
    generation_per_s: float
    engine_per_s: float
    learner_per_s: float
    mean_duration_s: float
    kept: float
    lag_bounded_per_s: float = 0.0  # the same bound with at most (max_lag + 1) batches in flight
    lag_in_flight: int = 0  # that many: min(slots, (max_lag + 1) * batch)
    stale_feasible_per_s: float = 0.0  # the most any schedule admits with max_lag enforced
    stale_stopped: float = 0.0  # the share of dispatched trajectories stale at that rate
    run_per_s: float = 0.0  # the ideal of this run's length: ramp-up and drain included

    @property
    def limit(self) -> str:
        rates = {"generation": self.generation_per_s, "engine": self.engine_per_s,
                 "learner": self.learner_per_s}
        return min(rates, key=rates.get)


def make_family(args) -> object:
    return longhaul.family(min_k=1, max_k=args.max_k, latency_median_s=args.latency,
                           latency_sigma=1.0, latency_max_s=args.latency_max)


def task_durations(args, count: int) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    """The first `count` train instances, in dispatch order: (seconds, of which decoding) of
    their correct and of their wrong demonstration, unqueued."""
    family, chat = make_family(args), make_chat_format(build_tiny_tokenizer(), "hermes",
                                                       tool_listing="none")
    out = []
    for task in family.instances("train", count=count):
        pair = []
        for correct in (True, False):
            demo = family.demonstration(task, correct)
            tokens = sum(len(chat.encode_assistant(text)) for text in demo.assistant_texts)
            calls = sum(len(turn.observations) for turn in demo.turns)
            tools = sum(longhaul.step_latency(task.key, j, args.latency, 1.0, args.latency_max)
                        for j in range(calls))
            decode_s = tokens * args.decode_ms / 1000
            pair.append((tools + decode_s, decode_s))
        out.append(tuple(pair))
    return out


def dispatched_groups(args, count: int) -> list[tuple[list[tuple[float, float]], bool]]:
    """The first `count` groups a run dispatches, in order: each member's (seconds, of which
    decoding), unqueued, as the scripted policy replays it, and whether the group has reward
    variance (dynamic sampling keeps it). The policy replays the correct demonstration where
    `replays_correct` says so for the member's trajectory id, and a fresh store numbers the
    members of group k from k * group + 1, in every mode."""
    groups = []
    for k, (correct, wrong) in enumerate(task_durations(args, count)):
        draws = [replays_correct(str(k * args.group + j + 1), CORRECT_SHARE)
                 for j in range(args.group)]
        groups.append(([correct if c else wrong for c in draws], len(set(draws)) == 2))
    return groups


def ideal_bound(args, *, learner_s: float) -> Bound:
    """The admitted rate no mode can beat on this workload (see the module docstring)."""
    groups = math.ceil(args.steps * args.batch / args.group * 1.5)  # dispatched, with drops
    run_groups = dispatched_groups(args, groups + math.ceil(2 * args.slots / args.group))
    members = [member for group, _ in run_groups[:groups] for member in group]
    mean_duration = fmean(seconds for seconds, _ in members)
    mean_decode = fmean(decode_s for _, decode_s in members)
    kept = sum(kept for _, kept in run_groups[:groups]) / groups
    generation = args.slots / mean_duration * kept
    engine = args.engine_slots / mean_decode * kept
    learner = args.batch / learner_s
    # the async modes' staleness bound keeps dispatched-but-unconsumed work within
    # (max_lag + 1) batches, so at most that many trajectories generate at once
    in_flight = min(args.slots, (args.max_lag + 1) * args.batch)
    lag_bounded = min(in_flight / mean_duration * kept, engine, learner)
    ideal = min(generation, engine, learner)
    feasible, stopped = staleness_feasible([(1.0, seconds) for seconds, _ in members], ideal,
                                           slots=args.slots, kept=kept, batch=args.batch,
                                           max_lag=args.max_lag)
    run = run_ideal([([seconds for seconds, _ in group], kept) for group, kept in run_groups],
                    slots=args.slots, batch=args.batch, steps=args.steps, learner_s=learner_s)
    return Bound(ideal, generation, engine, learner, mean_duration, kept, lag_bounded,
                 in_flight, feasible, stopped, run)


def run_ideal(groups: list[tuple[list[float], bool]], *, slots: int, batch: int, steps: int,
              learner_s: float) -> float:
    """The admitted rate of this run's length with nothing lost but its ramp-up and drain:
    the `groups` (each member's seconds, and whether the group is kept), in dispatch order,
    each member started the moment a slot frees, with no staleness bound, no engine queueing
    and no overhead; a kept group's members are admitted when its last member ends, and the
    learner takes a step of `learner_s` once a batch is admitted and the previous step is
    done. `steps * batch` over the end of the last step."""
    free = [0.0] * slots  # when each slot frees (a heap)
    decided = []
    for members, kept in groups:
        last = 0.0
        for seconds in members:
            end = heapq.heappop(free) + seconds
            heapq.heappush(free, end)
            last = max(last, end)
        if kept:
            decided.append((last, len(members)))
    decided.sort()
    admitted, ready_at, done, next_group = 0, 0.0, 0.0, 0
    for step in range(1, steps + 1):
        while admitted < step * batch:
            if next_group == len(decided):
                raise ValueError(f"run_ideal: {len(groups)} groups cannot fill {steps} steps")
            ready_at, size = decided[next_group]
            admitted, next_group = admitted + size, next_group + 1
        done = max(done, ready_at) + learner_s
    return steps * batch / done


def staleness_feasible(durations: list[tuple[float, float]], ideal: float, *, slots: int,
                       kept: float, batch: int, max_lag: int) -> tuple[float, float]:
    """An upper bound on the admitted rate of any schedule that admits nothing more than
    `max_lag` versions stale, and the share of dispatched trajectories it must stop as stale.

    At admitted rate r the learner bumps the version every batch / r seconds. A trajectory that
    runs d seconds sees at least floor(d r / batch) bumps, however well its start is timed: it
    can be admitted only if d < (max_lag + 1) batch / r, and otherwise it is stopped at that
    point at the earliest (what `cancel_stale` does). With every slot busy, no queueing, and a
    group's wait for its last member left out, Little's law caps r at
    slots * kept * P(admissible) / E[slot time]; the bound is the largest r <= `ideal` (on a
    grid of 1,000) that this cap does not fall below. Instances go out in the workload's mix:
    a scheduler that skipped the long ones would admit faster, which is selection bias, not
    throughput."""
    total = sum(w for w, _ in durations)
    best, stopped = 0.0, 0.0
    for i in range(1, 1001):
        rate = ideal * i / 1000
        window_s = (max_lag + 1) * batch / rate
        admissible = sum(w for w, d in durations if d < window_s)
        occupancy = sum(w * min(d, window_s) for w, d in durations)
        if slots * kept * admissible / occupancy >= rate:
            best, stopped = rate, 1 - admissible / total
    return best, stopped


async def no_sandbox(spec, trajectory_id):
    yield FakeSandbox()


def run_mode(mode: str, kv: str, batch_kind: str, args, directory: Path, *,
             learner_s: float, order: str = "ready_first", tag: str = "") -> dict:
    """One run of the real pipeline; every mode consumes steps * batch trajectories. `tag`
    tells apart the stores of runs that share mode, learner time and order."""
    batch = args.slots if batch_kind == "slots" else args.batch
    total = args.steps * args.batch
    steps = max(1, round(total / batch))
    step_s = learner_s * batch / args.batch  # the same learner cost per trajectory
    cfg = parse_config({
        "rollout": {"group_size": args.group, "max_concurrent": args.slots},
        "admission": {"max_lag": args.max_lag, "stale": "drop", "zero_variance": "drop",
                      "reweight": args.reweight, "pacing_tv": args.pacing,
                      "order": order, "cancel_stale": getattr(args, "cancel_stale", False)},
        "learner": {"batch_size": batch},
        "pipeline": {"mode": mode, "kv": kv, "steps": steps, "max_queue": 4 * batch,
                     "reserve": getattr(args, "reserve", "every")},
    })
    name = f"{mode}-{kv}-{batch}-{learner_s}-{order}{tag}"
    store = Store.open(f"sqlite:///{directory / f'{name}.db'}", create=True)
    store.create_run(name, name=name, config=cfg.model_dump(mode="json"), pipeline_mode=mode)
    family = make_family(args)
    chat = make_chat_format(build_tiny_tokenizer(), "hermes", tool_listing="none")
    running: dict[str, Pipeline] = {}
    script = DemoScript(lambda tid: running["pipeline"].task_of(tid), family, chat,
                        correct_fraction=CORRECT_SHARE)
    engine = CapacityEngine(ScriptedEngine(script, keep_requests=False), slots=args.engine_slots,
                            decode_s=args.decode_ms / 1000, prefill_s=args.prefill_ms / 1000)
    learner = FakeLearner(store, name, batch_size=batch, max_steps=steps, step_s=step_s)

    async def main() -> Pipeline:
        async with running_writer(store) as writer, anyio.create_task_group() as tg:
            await tg.start(learner.run)
            pipeline = Pipeline(run_id=name, cfg=cfg, store=store, writer=writer,
                                engine=engine, family=family, chat_format=chat,
                                acquire=asynccontextmanager(no_sandbox), poll_s=0.02)
            running["pipeline"] = pipeline
            await pipeline.run()
            tg.cancel_scope.cancel()
        return pipeline

    started = time.monotonic()
    pipeline = anyio.run(main)
    wall = time.monotonic() - started
    _, skew = store_ledger(store, name)
    learner_steps = store.learner_steps(name)
    steady = steady_state(store, name)
    store.close()
    label = {"sync": f"sync b={batch}", "async": "async"}.get(mode, f"inflight/{kv}")
    return dict(mode=label, wall_s=wall, admitted_per_s=steps * batch / wall,
                learner_busy=learner.busy_s / wall, engine_busy=engine.busy_s / wall,
                mean_lag=fmean([r.mean_lag for r in learner_steps if r.mean_lag is not None]
                               or [0.0]),
                max_lag=max((r.max_lag or 0) for r in learner_steps),
                difficulty_tv=skew.difficulty_tv, duration_tv=skew.duration_tv,
                weighted_difficulty_tv=skew.weighted_difficulty_tv,
                weighted_duration_tv=skew.weighted_duration_tv,
                beyond_weights=skew.beyond_weights_share,
                update_pause_s=engine.update_pause_s, generated=pipeline.stats.dispatched,
                held_s=dict(pipeline.stats.held_s), steady=steady)


@dataclass(frozen=True)
class Steady:
    """The middle half of a run (between its 25th and 75th percentile admission), where ramp-up
    and drain are left out, read back from the store: by Little's law the admitted rate is
    in_flight / duration_s * admitted_share."""

    admitted_per_s: float
    in_flight: float  # mean trajectories started and not finished
    duration_s: float  # mean start-to-finish time of the trajectories finished in the window
    admitted_share: float  # of the trajectories finished in the window
    window_s: float


def steady_state(store: Store, run_id: str) -> Steady:
    from sqlalchemy import select

    from core.store import schema as s

    with store.engine.connect() as c:
        stamps = sorted(c.execute(select(s.StreamEntry.admitted_at).where(
            s.StreamEntry.run_id == run_id)).scalars())
        spans = c.execute(select(s.Trajectory.id, s.Trajectory.started_at,
                                 s.Trajectory.finished_at).where(
            s.Trajectory.run_id == run_id, s.Trajectory.started_at.is_not(None),
            s.Trajectory.finished_at.is_not(None))).all()
        admitted = set(c.execute(select(s.StreamEntry.trajectory_id).where(
            s.StreamEntry.run_id == run_id)).scalars())
    lo, hi = stamps[len(stamps) // 4], stamps[3 * len(stamps) // 4]
    window = max(hi - lo, 1e-9)
    inside = [x for x in stamps if lo <= x < hi]
    busy = sum(max(0.0, min(f, hi) - max(b, lo)) for _, b, f in spans)
    ended = [(i, f - b) for i, b, f in spans if lo <= f < hi]
    return Steady(admitted_per_s=len(inside) / window, in_flight=busy / window,
                  duration_s=fmean([d for _, d in ended]) if ended else 0.0,
                  admitted_share=sum(i in admitted for i, _ in ended) / max(1, len(ended)),
                  window_s=window)


WEIGHTED_HEADER = ("weighted diff TV", "weighted dur TV", "beyond weights")
SKEW_HEADER = ("lag mean", "difficulty TV", "duration TV")


def weighted_values(r: dict) -> tuple[str, ...]:
    """The --reweight columns of a row: the weighted TVs and the share beyond the weights."""
    return (f"{r['weighted_difficulty_tv']:.3f}", f"{r['weighted_duration_tv']:.3f}",
            f"{r['beyond_weights']:.3f}")


def skew_values(r: dict, weighted: bool) -> tuple[str, ...]:
    """The closing columns of an extra async row (--orders, --reserves): SKEW_HEADER's, then
    WEIGHTED_HEADER's with --reweight."""
    values = (f"{r['mean_lag']:.2f}", f"{r['difficulty_tv']:.3f}", f"{r['duration_tv']:.3f}")
    return values + (weighted_values(r) if weighted else ())


def print_table(rows: list[dict], bound: Bound, weighted: bool = False) -> None:
    """One line per mode; with `weighted` (--reweight propensity) the TVs of the admitted mix
    weighted by its selection weights, what the learner's loss sees, follow the plain ones, and
    then the share of generated work beyond the weights."""
    sync = rows[0]["admitted_per_s"]
    header = ("mode", "wall s", "adm/s", "x sync", "of ideal", "of run ideal", "of lag ideal",
              "learner busy", "engine active", "lag mean", "lag max", "difficulty TV",
              "duration TV", "update pause s", "generated") + (WEIGHTED_HEADER if weighted else ())
    print("  ".join(f"{h:>13}" for h in header))
    for r in rows:
        values = (r["mode"], f"{r['wall_s']:.1f}", f"{r['admitted_per_s']:.2f}",
                  f"{r['admitted_per_s'] / sync:.2f}",
                  f"{100 * r['admitted_per_s'] / bound.per_s:.0f}%",
                  f"{100 * r['admitted_per_s'] / bound.run_per_s:.0f}%",
                  f"{100 * r['admitted_per_s'] / bound.lag_bounded_per_s:.0f}%"
                  if r["mode"].startswith(("async", "inflight")) else "-",
                  f"{100 * r['learner_busy']:.0f}%", f"{100 * r['engine_busy']:.0f}%",
                  f"{r['mean_lag']:.2f}", str(r["max_lag"]), f"{r['difficulty_tv']:.3f}",
                  f"{r['duration_tv']:.3f}", f"{r['update_pause_s']:.2f}", str(r["generated"]))
        if weighted:
            values += weighted_values(r)
        print("  ".join(f"{v:>13}" for v in values))


def print_steady(rows: list[dict], bound: Bound) -> None:
    """The middle half of each run: its admitted rate against the ideals, and Little's law's
    three factors beside the lag ideal's (in flight, duration, admitted share)."""
    print(f"steady state, the middle half of each run's admissions (the lag ideal assumes "
          f"{bound.lag_in_flight} in flight, {bound.mean_duration_s:.2f} s per trajectory, "
          f"{100 * bound.kept:.0f}% admitted):")
    print("  ".join(f"{h:>13}" for h in ("mode", "window s", "adm/s", "of ideal", "of lag ideal",
                                          "in flight", "duration s", "admitted")))
    for r in rows:
        st = r["steady"]
        print("  ".join(f"{v:>13}" for v in (
            r["mode"], f"{st.window_s:.1f}", f"{st.admitted_per_s:.2f}",
            f"{100 * st.admitted_per_s / bound.per_s:.0f}%",
            f"{100 * st.admitted_per_s / bound.lag_bounded_per_s:.0f}%"
            if r["mode"].startswith(("async", "inflight")) else "-",
            f"{st.in_flight:.1f}", f"{st.duration_s:.2f}", f"{100 * st.admitted_share:.0f}%")))


def print_reserve_curve(values: list[str | float], args, directory: Path, bound: Bound) -> None:
    """Async under each `[pipeline] reserve` value: what it admits against the ideal and the
    staleness-feasible bound, and the skew it costs (with --reweight, what the weights leave)."""
    weighted = args.reweight != "none"
    print(f"\nthe staleness bound's reservation, async{' with cancel_stale' * args.cancel_stale}: "
          f"each trajectory in flight counts as the share admitted so far, but never less than "
          f"`reserve` (every = 1, expected = 0)")
    print("  ".join(f"{h:>13}" for h in ("reserve", "adm/s", "of ideal", "of feasible")
                    + SKEW_HEADER + (WEIGHTED_HEADER if weighted else ())))
    for value in values:
        r = run_mode("async", "recompute", "batch", argparse.Namespace(**{**vars(args),
                     "reserve": value}), directory, learner_s=args.learner_s, tag=f"-{value}")
        cells = (str(value), f"{r['admitted_per_s']:.2f}",
                 f"{100 * r['admitted_per_s'] / bound.per_s:.0f}%",
                 f"{100 * r['admitted_per_s'] / bound.stale_feasible_per_s:.0f}%")
        print("  ".join(f"{v:>13}" for v in cells + skew_values(r, weighted)), flush=True)


def print_holds(rows: list[dict]) -> None:
    """Where each async mode's dispatch waited: seconds by what held it (the first reason)."""
    print("dispatch held, seconds of wall time by what held it (async modes):")
    for r in rows:
        if r["held_s"]:
            held = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["held_s"].items(),
                                                             key=lambda kv: -kv[1]))
            print(f"  {r['mode']:>18}: {held} (of {r['wall_s']:.1f} s)")


def describe_bound(bound: Bound, learner_s: float, group: int) -> str:
    p, g = CORRECT_SHARE, group
    return (f"ideal {bound.per_s:.2f} adm/s, set by the {bound.limit} (generation "
            f"{bound.generation_per_s:.2f}, engine {bound.engine_per_s:.2f}, learner "
            f"{bound.learner_per_s:.2f} at {learner_s} s per step; mean trajectory "
            f"{bound.mean_duration_s:.2f} s unqueued, {100 * bound.kept:.0f}% of groups kept: "
            f"the scripted policy's draws for these trajectory ids, "
            f"{100 * (1 - p ** g - (1 - p) ** g):.0f}% expected over many); "
            f"lag ideal {bound.lag_bounded_per_s:.2f} adm/s (the same with at most "
            f"(max_lag + 1) batches in flight, the async modes' staleness bound)\n"
            f"run ideal {bound.run_per_s:.2f} adm/s: the ideal over this run's length, its "
            f"ramp-up and drain included (a zero-overhead schedule without the staleness "
            f"bound, `run_ideal`)\n"
            f"staleness-feasible {bound.stale_feasible_per_s:.2f} adm/s "
            f"({100 * bound.stale_feasible_per_s / bound.per_s:.1f}% of the ideal): at most what "
            f"any schedule admits with max_lag enforced on this mix, and then only by stopping "
            f"{100 * bound.stale_stopped:.0f}% of the trajectories it dispatches as stale, the "
            f"longest ones")


def reserve_value(text: str) -> str | float:
    """--reserve's value: `every`, `expected` or a number (pipeline.reserve checks its range)."""
    return text if text in ("every", "expected") else float(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16, help="learner steps at --batch")
    parser.add_argument("--batch", type=int, default=16, help="trajectories per learner step")
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--slots", type=int, default=64, help="trajectories in flight at most")
    parser.add_argument("--engine-slots", type=int, default=32, help="engine batch size")
    parser.add_argument("--decode-ms", type=float, default=0.5, help="per sampled token")
    parser.add_argument("--prefill-ms", type=float, default=0.05, help="per prompt token")
    parser.add_argument("--learner-s", type=float, default=1.0, help="seconds per step of "
                        "--batch trajectories")
    parser.add_argument("--max-lag", type=int, default=2)
    parser.add_argument("--max-k", type=int, default=12, help="longest chain")
    parser.add_argument("--latency", type=float, default=0.1, help="median tool latency (s)")
    parser.add_argument("--latency-max", type=float, default=3.0)
    parser.add_argument("--sweep", default="0.05,0.2,0.8,3.2",
                        help="learner step times (s) for the speed-up curve; '' skips it")
    parser.add_argument("--quick", action="store_true", help="4 steps of 8 (a smoke run)")
    parser.add_argument("--reweight", choices=("none", "propensity"), default="none",
                        help="[admission] reweight; propensity adds the weighted mix's TVs")
    parser.add_argument("--orders", default="",
                        help="also run async under these [admission] orders, e.g. "
                             "in_order,weight_fifo (ready_first is the default row)")
    parser.add_argument("--reserve", type=reserve_value, default="every",
                        help="[pipeline] reserve: how the staleness bound counts work in "
                             "flight (every: one admission each; expected: the admitted share; "
                             "a number from 0 to 1: the admitted share, never below it)")
    parser.add_argument("--reserves", default="",
                        help="also run async under each of these [pipeline] reserve values, "
                             "e.g. 1,0.9,0.8,0.7,expected: the throughput-skew trade-off")
    parser.add_argument("--cancel-stale", action="store_true",
                        help="[admission] cancel_stale: stop work in flight once it could only "
                             "be dropped as stale")
    parser.add_argument("--pacing", type=float, default=None, metavar="TV",
                        help="[admission] pacing_tv: hold dispatch while the admitted mix is "
                             "further than TV from the generated one")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.batch, args.slots = 4, 8, 16
    sweep = [float(x) for x in args.sweep.split(",") if x.strip()]
    with tempfile.TemporaryDirectory() as directory:
        rows = []
        for mode, kv, batch_kind in MODES:
            rows.append(run_mode(mode, kv, batch_kind, args, Path(directory),
                                 learner_s=args.learner_s))
            print(f"  {rows[-1]['mode']} done in {rows[-1]['wall_s']:.1f} s", flush=True)
        bound = ideal_bound(args, learner_s=args.learner_s)
        print(f"\nlonghaul: {args.steps * args.batch} trajectories consumed per mode, "
              f"{args.slots} in flight, {args.engine_slots} engine slots, max_lag "
              f"{args.max_lag}, tool latency lognormal(median {args.latency} s, sigma 1), "
              f"k = 1..{args.max_k}")
        print(describe_bound(bound, args.learner_s, args.group))
        print_table(rows, bound, weighted=args.reweight != "none")
        print_steady(rows, bound)
        print_holds(rows)
        orders = [o for o in args.orders.split(",") if o.strip()]
        if orders:
            print(f"\nadmission orders, async: the order decided groups enter the learner "
                  f"stream (ready_first is the async row above)")
            weighted = args.reweight != "none"
            print("  ".join(f"{h:>13}" for h in ("order", "adm/s", "of lag ideal")
                            + SKEW_HEADER + (WEIGHTED_HEADER if weighted else ())))
            for order in orders:
                r = run_mode("async", "recompute", "batch", args, Path(directory),
                             learner_s=args.learner_s, order=order.strip())
                values = (order, f"{r['admitted_per_s']:.2f}",
                          f"{100 * r['admitted_per_s'] / bound.lag_bounded_per_s:.0f}%")
                print("  ".join(f"{v:>13}" for v in values + skew_values(r, weighted)),
                      flush=True)
        reserves = [reserve_value(v.strip()) for v in args.reserves.split(",") if v.strip()]
        if reserves:
            print_reserve_curve(reserves, args, Path(directory), bound)
        curve = []
        for learner_s in sweep:
            sync = run_mode("sync", "recompute", "slots", args, Path(directory),
                            learner_s=learner_s)
            fast = run_mode("async", "recompute", "batch", args, Path(directory),
                            learner_s=learner_s)
            curve.append((learner_s, ideal_bound(args, learner_s=learner_s), sync, fast))
            print(f"  sweep: learner {learner_s} s done", flush=True)
    if curve:
        print(f"\nspeed-up curve (async vs sync b={args.slots}, same trajectories and learner "
              f"cost per trajectory)")
        print("  ".join(f"{h:>12}" for h in ("learner s", "gen/learner", "ideal/s", "limit",
                                              "sync adm/s", "async adm/s", "async/sync",
                                              "sync of ideal", "async of ideal")))
        for learner_s, b, sync, fast in curve:
            ratio = b.mean_duration_s * args.batch / args.slots / learner_s
            values = (f"{learner_s}", f"{ratio:.2f}", f"{b.per_s:.2f}", b.limit,
                      f"{sync['admitted_per_s']:.2f}", f"{fast['admitted_per_s']:.2f}",
                      f"{fast['admitted_per_s'] / sync['admitted_per_s']:.2f}",
                      f"{100 * sync['admitted_per_s'] / b.per_s:.0f}%",
                      f"{100 * fast['admitted_per_s'] / b.per_s:.0f}%")
            print("  ".join(f"{v:>12}" for v in values))
        print("gen/learner: time to generate one batch with every slot busy over one learner "
              "step; async gains most near 1, where sync leaves both sides idle half the time.")


if __name__ == "__main__":
    main()
