"""Opening a 100,000-token trajectory in `stalewise view`: time to first byte and full page.

Writes one run with one trajectory of `--turns` model calls totalling `--tokens` sampled tokens
(top-k and trainer log-probs recorded, weights versions changing inside turns), starts
`stalewise view` as a child on it, and times HTTP GETs of the trajectory's first page (cold:
the first request, which loads the tokenizer; warm: median of the next five), a middle token
page, the runs list and the dashboard. Target: the trajectory page in under 2 s.

    .venv/bin/python bench/viewer.py [--tokens 100000] [--turns 20] [--topk 5]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this folder is first on sys.path, where bench/engine.py and bench/learner.py
# would shadow the packages of the same names: drop it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import statistics
import subprocess
import tempfile
import time

import httpx
import numpy as np

from core.children import free_port
from core.records import SampledTokens
from core.store.store import Store, model_call_row
from core.tiny_tokenizer import save_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def build(directory: Path, tokens: int, turns: int, topk: int) -> tuple[str, int]:
    tokenizer = save_tiny_tokenizer(directory / "model")
    vocab = len(tokenizer)
    url = f"sqlite:///{directory / 'store.db'}"
    store = Store.open(url, create=True)
    store.create_run("bench", name="bench", config={"model": {"path": str(directory / "model")}},
                     pipeline_mode="inflight")
    task = store.task_instance_id("bench", family="bench", key="long", content_hash="h",
                                  prompt="a long trajectory")
    trajectory = store.create_trajectory("bench", group_id=None, task_instance_id=task)
    rng = np.random.default_rng(0)
    per_turn, now, rows = tokens // turns, time.time(), []
    for turn in range(turns):
        ids = rng.integers(4, vocab, per_turn, dtype=np.int32)
        versions = np.full(per_turn, turn // 2, np.int32)
        versions[per_turn // 2:] += 1  # a weights update in the middle of every turn
        rows.append(model_call_row(
            trajectory_id=trajectory, turn=turn, segment=0, context_len=turn * (per_turn + 20),
            prompt_token_ids=rng.integers(4, vocab, 20, dtype=np.int32),
            tokens=SampledTokens(ids, -rng.exponential(1.0, per_turn), versions,
                                 np.full(per_turn, turn // 2, np.int32),
                                 np.linspace(0.0, 30.0, per_turn),
                                 topk_ids=rng.integers(4, vocab, (per_turn, topk)),
                                 topk_logprobs=-rng.exponential(2.0, (per_turn, topk))),
            sampling={}, engine_id="bench", finish_reason="length", cached_prompt_tokens=0,
            started_at=now, finished_at=now + 30.0))
    store.insert_model_calls(rows)
    calls = store.model_calls(trajectory)
    store.insert_trainer_logprobs("bench", [
        dict(model_call_id=c.id, learner_step=1, policy_version=0, num_tokens=len(c.tokens),
             logprobs=(c.tokens.sampler_logprobs + 0.01).astype("<f4").tobytes())
        for c in calls])
    store.update_trajectory(trajectory, status="completed", stop_reason="length", reward=0.0,
                            num_turns=turns, num_model_calls=turns,
                            num_sampled_tokens=per_turn * turns, started_at=now,
                            finished_at=now + 60, min_version=0, max_version=turns // 2)
    store.close()
    return url, trajectory


def timed_get(client: httpx.Client, url: str) -> tuple[float, int]:
    started = time.perf_counter()
    response = client.get(url)
    response.raise_for_status()
    return time.perf_counter() - started, len(response.content)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--topk", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        url, trajectory = build(Path(tmp), args.tokens, args.turns, args.topk)
        print(f"built a trajectory of {args.tokens} tokens in {args.turns} turns "
              f"({time.perf_counter() - started:.1f} s)")
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "stalewise", "view", "--url", url,
                                 "--port", str(port)], cwd=ROOT, stdout=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        try:
            with httpx.Client(timeout=60) as client:
                for _ in range(300):
                    try:
                        client.get(f"{base}/static/viewer.css")
                        break
                    except httpx.HTTPError:
                        time.sleep(0.1)
                page = f"{base}/trajectories/{trajectory}"
                cold, size = timed_get(client, page)
                warm = statistics.median(timed_get(client, page)[0] for _ in range(5))
                middle, _ = timed_get(client, f"{page}?page=13")
                runs, _ = timed_get(client, f"{base}/")
                dashboard, _ = timed_get(client, f"{base}/runs/bench")
        finally:
            proc.terminate()
            proc.wait(10)
    print(f"trajectory page, first request (loads the tokenizer): {cold:.3f} s, "
          f"{size / 1e6:.2f} MB of HTML")
    print(f"trajectory page, warm (median of 5):                  {warm:.3f} s")
    print(f"trajectory token page 13:                             {middle:.3f} s")
    print(f"runs list: {runs:.3f} s; dashboard: {dashboard:.3f} s")
    print(f"target < 2 s for the trajectory page: {'met' if max(cold, warm) < 2.0 else 'MISSED'}")


if __name__ == "__main__":
    main()
