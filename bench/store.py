"""Store write throughput: a synthetic run recorded through the real `Store` API.

Writes N trajectories of `turns` model calls with `tokens` sampled tokens each (top-k recorded)
the way the orchestrator's writer does (batched transactions of model calls + trajectory rows)
and prints tokens recorded per second, rows per second, and bytes per token on disk (SQLite).

With a PostgreSQL `--url`, the benchmark writes to a new database of its own on that server
(`bench_store_<hex>`, dropped afterwards unless `--keep`), never to the URL's own database.

    .venv/bin/python bench/store.py [--trajectories 2000] [--turns 10] [--tokens 200] [--topk 8]
                                    [--url sqlite:///var/bench/store.db] [--keep]
    .venv/bin/python bench/store.py --url postgresql+psycopg://postgres@127.0.0.1:54329/postgres
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this folder is first on sys.path, where bench/engine.py and bench/learner.py
# would shadow the packages of the same names: drop it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import os
import time
import uuid
from pathlib import Path

import numpy as np

from core.records import SampledTokens
from core.store.db import normalize_url
from core.store.store import Store, model_call_row


def synthetic_calls(rng: np.random.Generator, trajectory_id: int, turns: int, tokens: int,
                    topk: int, t0: float) -> list[dict]:
    rows = []
    for turn in range(turns):
        ids = rng.integers(0, 32000, size=tokens, dtype=np.int32)
        logprobs = -rng.exponential(1.0, size=tokens).astype(np.float32)
        versions = np.full(tokens, turn // 3, dtype=np.int32)
        kw = {}
        if topk:
            kw = dict(topk_ids=rng.integers(0, 32000, size=(tokens, topk), dtype=np.int32),
                      topk_logprobs=-rng.exponential(2.0, size=(tokens, topk)).astype(np.float32))
        sampled = SampledTokens(ids, logprobs, versions, np.maximum(versions - (turn % 2), 0),
                                np.linspace(0, 1, tokens, dtype=np.float32), **kw)
        rows.append(model_call_row(
            trajectory_id=trajectory_id, turn=turn, segment=0, context_len=turn * (tokens + 40),
            prompt_token_ids=rng.integers(0, 32000, size=40, dtype=np.int32), tokens=sampled,
            sampling={"temperature": 1.0, "top_k": 0, "top_p": 1.0, "logprobs_topk": topk},
            engine_id="bench", finish_reason="stop", cached_prompt_tokens=turn * 40,
            started_at=t0 + turn, finished_at=t0 + turn + 0.5))
    return rows


def trajectory_row(run_id: str, trajectory_id: int, turns: int, tokens: int, t0: float) -> dict:
    return dict(id=trajectory_id, run_id=run_id, group_id=None, task_instance_id=None,
                sample_index=trajectory_id % 8, attempt=0, purpose="train", status="completed",
                stop_reason="answered", reward=float(trajectory_id % 2),
                reward_breakdown={"correct": float(trajectory_id % 2)}, error=None,
                queued_at=t0, started_at=t0, finished_at=t0 + turns, engine_s=turns * 0.5,
                tools_s=turns * 0.4, waiting_s=0.1, dispatch_version=0, min_version=0,
                max_version=turns // 3, min_kv_version=0, num_turns=turns,
                num_model_calls=turns, num_tool_calls=turns - 1, num_malformed=0,
                num_sampled_tokens=turns * tokens, num_segments=1)


def database_bytes(url: str) -> int | None:
    if not url.startswith("sqlite:///"):
        return None
    path = url[len("sqlite:///"):]
    return sum(os.path.getsize(p) for p in (path, path + "-wal") if os.path.exists(p))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--batch", type=int, default=50, help="trajectories per transaction")
    parser.add_argument("--url", default="sqlite:///var/bench/store.db")
    parser.add_argument("--keep", action="store_true", help="keep the database (for audit)")
    args = parser.parse_args()

    url = normalize_url(args.url)
    files = sqlite_files(url)
    if files and files[0].exists():
        sys.exit(f"{files[0]} exists: bench/store.py writes a database of its own and removes it "
                 f"afterwards; pass another --url, or remove that file if it is an old benchmark's")
    if files:
        files[0].parent.mkdir(parents=True, exist_ok=True)
    server = url if url.startswith("postgresql") else None
    if server:
        url = postgres_database(server, f"bench_store_{uuid.uuid4().hex[:12]}", create=True)
    store = Store.open(url, create=True)
    run_id = f"bench-{int(time.time())}"
    store.create_run(run_id, name="bench/store.py", config={"bench": vars(args)},
                     pipeline_mode="async")
    rng = np.random.default_rng(0)
    t0 = time.time()

    # Build the payload first: the figure is the store's write rate, not numpy's.
    batches = []
    for start in range(1, args.trajectories + 1, args.batch):
        ids = range(start, min(start + args.batch, args.trajectories + 1))
        batches.append(([trajectory_row(run_id, i, args.turns, args.tokens, t0) for i in ids],
                        [row for i in ids for row in synthetic_calls(rng, i, args.turns,
                                                                     args.tokens, args.topk, t0)]))

    start = time.perf_counter()
    for trajectories, calls in batches:
        store.insert_trajectories(trajectories)
        store.insert_model_calls(calls)
    elapsed = time.perf_counter() - start

    total_tokens = args.trajectories * args.turns * args.tokens
    size = database_bytes(url)
    print(f"store benchmark ({store.engine.dialect.name}, {url})")
    print(f"  trajectories        {args.trajectories}")
    print(f"  model calls         {args.trajectories * args.turns}")
    print(f"  tokens recorded     {total_tokens}  (top-k {args.topk})")
    print(f"  write time          {elapsed:.2f} s")
    print(f"  tokens/s            {total_tokens / elapsed:,.0f}   (target >= 1,000,000 on SQLite)")
    print(f"  rows/s              {args.trajectories * (args.turns + 1) / elapsed:,.0f}   "
          f"(model calls and trajectories)")
    if size is not None:
        print(f"  bytes on disk       {size:,}")
        print(f"  bytes per token     {size / total_tokens:.1f}")
    print(f"  run id              {run_id}   (try: stalewise audit show 1 --url {url})")
    store.close()
    if server and not args.keep:
        postgres_database(server, url.rsplit("/", 1)[1], create=False)
    if not args.keep:
        for path in files:  # only the files this run created, never the folder around them
            path.unlink(missing_ok=True)


def postgres_database(server: str, name: str, *, create: bool) -> str:
    """Create (or drop) the database `name` on the PostgreSQL server of `server`; its URL."""
    from sqlalchemy import create_engine, text

    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as c:
            c.execute(text(f"CREATE DATABASE {name}" if create
                           else f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
    finally:
        admin.dispose()
    return server.rsplit("/", 1)[0] + "/" + name


def sqlite_files(url: str) -> list[Path]:
    """The database file of a SQLite URL and its journal files; nothing for other databases."""
    if not url.startswith("sqlite:///"):
        return []
    db = Path(url[len("sqlite:///"):])
    return [db] + [db.with_name(db.name + suffix) for suffix in ("-wal", "-shm", "-journal")]


if __name__ == "__main__":
    main()
