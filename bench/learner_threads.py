"""Learner step time by torch thread count, on an idle CPU and beside busy processes.

In a job on a small machine the learner shares the cores with the engine, the sandboxes and the
orchestrator. torch's default (one thread per core) then makes every parallel region wait for a
thread that the scheduler has given to someone else. This benchmark times one full RL step of
the tiny model (`Learner.rl_step`, batch and length like the demo's) with 1 thread and with
torch's default, first on an idle machine and then beside N processes that each spin one core
(N = 1 .. cores), alternating the thread settings round by round so both see the same load.
It prints the median step seconds and the ratio default / 1 thread. `[learner] threads` sets
the learner's threads in a job.

    .venv/bin/python bench/learner_threads.py [--batch 64] [--length 170] [--repeats 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # bench/learner_threads.py must not shadow the learner package

import torch


def _bench_learner():
    """bench/learner.py (its samples), loaded under another name than the learner package."""
    path = Path(__file__).resolve().parent / "learner.py"
    spec = importlib.util.spec_from_file_location("bench_learner", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def _step_seconds(learner, samples, threads: int) -> float:
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    learner.rl_step(samples)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=170)
    parser.add_argument("--prompt", type=int, default=110)
    parser.add_argument("--micro", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from transformers.utils import logging

    logging.disable_progress_bar()
    from config.learner import LearnerConfig
    from engine.tiny import init_tiny
    from learner.trainer import Learner

    default = torch.get_num_threads()
    cores = os.cpu_count() or 1
    print(f"tiny model, RL step on {args.batch} samples x {args.length} tokens, "
          f"micro-batch {args.micro}; torch default threads = {default}, cores = {cores}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_tiny(Path(tmp) / "tiny")
        samples = _bench_learner().build_samples(model_dir, args.batch, args.length,
                                                 args.prompt, 8, seed=0)
        cfg = LearnerConfig(batch_size=args.batch, micro_batch_size=args.micro,
                            optimizer=dict(lr=1e-6))
        learner = Learner(model_dir, cfg)
        _step_seconds(learner, samples, default)  # warm-up
        print(f"{'busy processes':>15} {'1 thread s':>11} {f'{default} threads s':>12} "
              f"{'default / 1':>12}")
        for busy in range(0, cores + 1):
            stop = multiprocessing.Event()
            spinners = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True)
                        for _ in range(busy)]
            for process in spinners:
                process.start()
            times: dict[int, list[float]] = {1: [], default: []}
            try:
                for repeat in range(args.repeats):
                    order = (1, default) if repeat % 2 == 0 else (default, 1)
                    for threads in order:
                        times[threads].append(_step_seconds(learner, samples, threads))
            finally:
                stop.set()
                for process in spinners:
                    process.join()
            one, many = statistics.median(times[1]), statistics.median(times[default])
            print(f"{busy:>15} {one:>11.2f} {many:>12.2f} {many / one:>12.2f}")


if __name__ == "__main__":
    main()
