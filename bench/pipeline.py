"""Throughput study: sync vs async vs inflight (KV retain / recompute) on `longhaul`.

Every mode runs the real pipeline (agent loops, admission, the SQLite store, the learner
stream) on the same workload and the same compute: the `longhaul` suite (k sequential tool
calls, each with a heavy-tailed lognormal latency), trajectories replayed by the scripted
engine behind a finite-capacity engine model (slots, per-token decode and prefill cost, the
real cost of each weight-update mode), and a learner that takes a fixed time per step. Each mode
trains the same number of learner steps on the same batch size.

Printed per mode: wall time, admitted trajectories per second, learner and engine busy
fractions, mean / max token lag, the selection-skew figures, and the ideal bound: the admitted
rate if the concurrency slots were always busy and the learner never waited,
min(slots / mean trajectory duration * admitted share, batch / learner step time).

    .venv/bin/python bench/pipeline.py [--steps 6] [--batch 16] [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this folder is first on sys.path, where bench/engine.py and bench/learner.py
# would shadow the packages of the same names: drop it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import tempfile
import time
from pathlib import Path
from statistics import fmean

import anyio

from orchestrator.pipeline import Pipeline
from orchestrator.report import store_ledger
from orchestrator.scripted_engine import ScriptedEngine
from orchestrator.testing import CapacityEngine, DemoScript, FakeLearner
from orchestrator.writer import StoreWriter
from stalewise.config import parse_config
from stalewise.store.store import Store
from stalewise.tiny_tokenizer import build_tiny_tokenizer
from tasks.chat import make_chat_format
from tasks.suites import longhaul
from tasks.testing import FakeSandbox

MODES = [("sync", "recompute"), ("async", "recompute"), ("inflight", "retain"),
         ("inflight", "recompute")]


async def no_sandbox(spec, trajectory_id):
    yield FakeSandbox()


def run_mode(mode: str, kv: str, args, directory: Path) -> dict:
    from contextlib import asynccontextmanager

    cfg = parse_config({
        "rollout": {"group_size": args.group, "max_concurrent": args.slots},
        "admission": {"max_lag": args.max_lag, "stale": "drop", "zero_variance": "drop"},
        "learner": {"batch_size": args.batch},
        "pipeline": {"mode": mode, "kv": kv, "steps": args.steps, "max_queue": 4 * args.batch},
    })
    store = Store.open(f"sqlite:///{directory / f'{mode}-{kv}.db'}", create=True)
    run_id = f"{mode}-{kv}"
    store.create_run(run_id, name=run_id, config=cfg.model_dump(mode="json"), pipeline_mode=mode)
    family = longhaul.family(min_k=1, max_k=args.max_k, latency_median_s=args.latency,
                             latency_sigma=1.0, latency_max_s=args.latency_max)
    chat = make_chat_format(build_tiny_tokenizer(), "hermes", tool_listing="none")
    running: dict[str, Pipeline] = {}
    script = DemoScript(lambda tid: running["pipeline"].task_of(tid), family, chat,
                        correct_fraction=0.6)
    engine = CapacityEngine(ScriptedEngine(script, keep_requests=False), slots=args.engine_slots,
                            decode_s=args.decode_ms / 1000, prefill_s=args.prefill_ms / 1000)
    learner = FakeLearner(store, run_id, batch_size=args.batch, max_steps=args.steps,
                          step_s=args.learner_s)

    async def main() -> Pipeline:
        writer = StoreWriter(store)
        async with anyio.create_task_group() as tg:
            await tg.start(writer.run)
            await tg.start(learner.run)
            pipeline = Pipeline(run_id=run_id, cfg=cfg, store=store, writer=writer,
                                engine=engine, weights=engine, family=family, chat_format=chat,
                                acquire=asynccontextmanager(no_sandbox), poll_s=0.02)
            running["pipeline"] = pipeline
            await pipeline.run()
            tg.cancel_scope.cancel()
        return pipeline

    started = time.monotonic()
    anyio.run(main)
    wall = time.monotonic() - started
    ledger, skew = store_ledger(store, run_id)
    steps = store.learner_steps(run_id)
    with store.engine.connect() as c:
        from sqlalchemy import text

        durations = [d for (d,) in c.execute(text(
            "SELECT finished_at - started_at FROM trajectories WHERE run_id = :r AND status "
            "NOT IN ('queued','running','aborted')"), {"r": run_id})]
    consumed = args.steps * args.batch
    admitted_share = skew.admitted / max(skew.generated, 1)
    ideal = min(args.slots / fmean(durations) * admitted_share, args.batch / args.learner_s)
    store.close()
    return dict(mode=f"{mode}/{kv}" if mode == "inflight" else mode, wall_s=wall,
                admitted_per_s=consumed / wall, learner_busy=learner.busy_s / wall,
                engine_busy=engine.busy_s / wall,
                mean_lag=fmean([r.mean_lag for r in steps if r.mean_lag is not None] or [0.0]),
                max_lag=max((r.max_lag or 0) for r in steps), difficulty_tv=skew.difficulty_tv,
                duration_tv=skew.duration_tv, ideal_per_s=ideal,
                of_ideal=consumed / wall / ideal, update_pause_s=engine.update_pause_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16, help="learner steps per mode")
    parser.add_argument("--batch", type=int, default=16, help="trajectories per learner step")
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--slots", type=int, default=64, help="trajectories in flight at most")
    parser.add_argument("--engine-slots", type=int, default=32, help="engine batch size")
    parser.add_argument("--decode-ms", type=float, default=0.5, help="per sampled token")
    parser.add_argument("--prefill-ms", type=float, default=0.05, help="per prompt token")
    parser.add_argument("--learner-s", type=float, default=1.0, help="seconds per step")
    parser.add_argument("--max-lag", type=int, default=2)
    parser.add_argument("--max-k", type=int, default=12, help="longest chain")
    parser.add_argument("--latency", type=float, default=0.1, help="median tool latency (s)")
    parser.add_argument("--latency-max", type=float, default=3.0)
    parser.add_argument("--quick", action="store_true", help="3 steps of 8 (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.batch = 3, 8
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for mode, kv in MODES:
            rows.append(run_mode(mode, kv, args, Path(directory)))
            print(f"  {rows[-1]['mode']} done in {rows[-1]['wall_s']:.1f} s", flush=True)
    sync = rows[0]["admitted_per_s"]
    print(f"\nlonghaul: {args.steps} learner steps x {args.batch} trajectories per mode, "
          f"{args.slots} in flight, max_lag {args.max_lag}, tool latency lognormal(median "
          f"{args.latency} s, sigma 1), k = 1..{args.max_k}")
    header = ("mode", "wall s", "adm/s", "x sync", "ideal/s", "of ideal", "learner busy",
              "engine busy", "lag mean", "lag max", "difficulty TV", "duration TV",
              "update pause s")
    print("  ".join(f"{h:>13}" for h in header))
    for r in rows:
        values = (r["mode"], f"{r['wall_s']:.1f}", f"{r['admitted_per_s']:.2f}",
                  f"{r['admitted_per_s'] / sync:.2f}", f"{r['ideal_per_s']:.2f}",
                  f"{100 * r['of_ideal']:.0f}%", f"{100 * r['learner_busy']:.0f}%",
                  f"{100 * r['engine_busy']:.0f}%", f"{r['mean_lag']:.2f}", str(r["max_lag"]),
                  f"{r['difficulty_tv']:.3f}", f"{r['duration_tv']:.3f}",
                  f"{r['update_pause_s']:.2f}")
        print("  ".join(f"{v:>13}" for v in values))
    best = max(rows, key=lambda r: r["of_ideal"])
    print(f"\nbest mode: {best['mode']} at {100 * best['of_ideal']:.0f}% of its ideal bound "
          f"(target >= 80%); async vs sync: "
          f"{rows[1]['admitted_per_s'] / sync:.2f}x (target >= 2x, mean lag "
          f"{rows[1]['mean_lag']:.2f} <= max_lag {args.max_lag})")


if __name__ == "__main__":
    main()
