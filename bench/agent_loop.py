"""Agent-loop overhead: CPU milliseconds per turn and turns per second of `run_trajectory`.

Runs the built-in suites' demonstrations through the real agent loop with the scripted engine
(simulated prefill/decode latency with jitter) and an in-memory fake sandbox whose every exec
takes a simulated time (longhaul's `step` tool sleeps its own heavy-tailed latency), recording
into a `MemoryRecorder`. For every chat format x suite x concurrency it keeps N trajectories in
flight on one event loop (one core) until `--trajectories` have finished, and prints

    ms CPU/turn  = process CPU time (time.process_time) / turns, setup excluded
    turns/s      = turns / wall time of the same span
    fakes ms     = the same engine calls and tool calls driven without the agent loop (the fake
                   engine, the fake sandbox and their simulated latency cost this much)
    loop ms      = ms CPU/turn - fakes ms: what the agent loop itself adds per turn

Each cell runs in a fresh subprocess. `--against DIR` runs every cell a second time, side by side,
with the packages imported from DIR (another checkout, e.g. the previous commit) to measure a
change in one run on a noisy machine. `--group-size G` runs G trajectories per task instance, as
GRPO-style groups do (default 1: every trajectory a new instance, the costliest case);
`--longhaul-k MIN,MAX` sets the chain lengths (turns per trajectory) of longhaul.

    .venv/bin/python bench/agent_loop.py [--formats hermes,template] [--suites arith,longhaul]
        [--concurrency 100,1000] [--trajectories 1000] [--repeat 1] [--against DIR]
        [--group-size 1] [--longhaul-k 1,30] [--json FILE]
        [--profile FILE.prof --formats F --suites S --concurrency N]   (one cell, cProfile)
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

ENGINE_LATENCY = {"fixed_s": 0.010, "prefill_s_per_token": 0.00001,
                  "decode_s_per_token": 0.0002, "jitter_sigma": 0.5}
SANDBOX_EXEC_S = 0.010  # every fake exec (arith's python tool) takes this long
LONGHAUL = {"latency_median_s": 0.010, "latency_sigma": 1.0, "latency_max_s": 0.5}


@dataclass
class Setup:
    """Everything built before the clock starts: format, tasks, scripts, fakes' inputs."""

    chat_format: Any
    tasks: dict[str, Any]  # trajectory id -> task instance
    demos: dict[str, Any]  # trajectory id -> its demonstration
    engine_kwargs: dict[str, Any]
    sandbox_type: type
    handler: Callable[[list[str], bytes | None], str]


def prepare(fmt_kind: str, suite: str, trajectories: int, group_size: int,
            longhaul_k: tuple[int, int]) -> Setup:
    import anyio

    from core.tiny_tokenizer import build_tiny_tokenizer
    from orchestrator.engines.scripted import LatencyModel, ScriptedEngine, turns_from_texts
    from tasks.chat import make_chat_format
    from tasks.suites import arith, longhaul
    from tasks.testing import FakeSandbox

    chat_format = make_chat_format(build_tiny_tokenizer(), fmt_kind)
    family = arith.family() if suite == "arith" else longhaul.family(
        min_k=longhaul_k[0], max_k=longhaul_k[1], **LONGHAUL)
    instances = family.demonstrations(-(-trajectories // group_size))
    # keyed by trajectory id (from 1), which names the engine session the script is found by
    demos = {str(i + 1): instances[i // group_size] for i in range(trajectories)}
    scripts = {key: turns_from_texts(chat_format.encode_assistant, demo.assistant_texts)
               for key, demo in demos.items()}
    quiet = ({"keep_requests": False}  # older checkouts (--against) keep every request
             if "keep_requests" in inspect.signature(ScriptedEngine).parameters else {})

    class SlowFakeSandbox(FakeSandbox):
        async def exec(self, cmd: Any, **kwargs: Any) -> Any:
            await anyio.sleep(SANDBOX_EXEC_S)
            return await super().exec(cmd, **kwargs)

    return Setup(chat_format, {key: demo.task for key, demo in demos.items()}, demos,
                 {"script": scripts, "latency": LatencyModel(**ENGINE_LATENCY), **quiet},
                 SlowFakeSandbox, _arith_handler(arith.evaluate))


def measure_loop(setup: Setup, concurrency: int) -> tuple[float, float, int]:
    """(cpu_s, wall_s, turns) of running every trajectory through `run_trajectory`."""
    from core.engine_api import SamplingParams
    from orchestrator.engines.scripted import ScriptedEngine
    from orchestrator.rollout import run_trajectory, use_sandbox
    from orchestrator.rollout_types import MemoryRecorder

    engine = ScriptedEngine(**setup.engine_kwargs)
    recorder, params = MemoryRecorder(), SamplingParams(max_tokens=256)
    counts = {"turns": 0, "answered": 0}

    async def one(key: str) -> None:
        outcome = await run_trajectory(
            task=setup.tasks[key], engine=engine, chat_format=setup.chat_format,
            acquire_sandbox=use_sandbox(setup.sandbox_type(handler=setup.handler)),
            params=params, recorder=recorder, trajectory_id=int(key))
        counts["turns"] += outcome.turns
        counts["answered"] += outcome.reward == 1.0

    cpu, wall = _timed(list(setup.tasks), concurrency, one)
    if counts["answered"] != len(setup.tasks):
        raise SystemExit(f"only {counts['answered']} of {len(setup.tasks)} trajectories earned "
                         "reward 1; the bench is not measuring the normal path")
    return cpu, wall, counts["turns"]


def measure_fakes(setup: Setup, concurrency: int) -> tuple[float, int]:
    """(cpu_s, turns) of the same engine and tool calls, on prompts that grow the same way,
    driven by a bare loop: the cost of the fakes and their simulated latency."""
    from core.engine_api import GenerateRequest, SamplingParams
    from orchestrator.engines.scripted import ScriptedEngine
    from tasks.tools import ToolContext

    fmt = setup.chat_format
    engine = ScriptedEngine(**setup.engine_kwargs)
    params = SamplingParams(max_tokens=256, stop_token_ids=tuple(fmt.stop_token_ids))
    plans = {key: _plan(fmt, demo) for key, demo in setup.demos.items()}  # untimed
    counts = {"turns": 0}

    async def one(key: str) -> None:
        prompt, steps = plans[key]
        prompt, session = list(prompt), f"{key}/0"
        sandbox = setup.sandbox_type(handler=setup.handler)
        for index, (calls, grow) in enumerate(steps):
            result = await engine.generate(GenerateRequest(list(prompt), params, session))
            prompt += result.tokens.token_ids.tolist()
            for tool, arguments in calls:
                ctx = ToolContext(sandbox=sandbox, task=setup.tasks[key], trajectory_id=int(key),
                                  turn=index, timeout_s=60.0)
                await tool.fn(**{**arguments, tool.context_param: ctx})
            prompt += grow
            counts["turns"] += 1
        await engine.release_session(session)

    cpu, _ = _timed(list(setup.tasks), concurrency, one)
    return cpu, counts["turns"]


def _plan(fmt: Any, demo: Any) -> tuple[list[int], list[tuple[list[Any], list[int]]]]:
    """A demonstration as the fakes see it: the prompt ids, then per turn the tool calls
    (tool, arguments) and the ids the conversation grows by after the sampled turn."""
    from tasks.chat.conversation import Conversation
    from tasks.messages import ChatMessage

    conversation = Conversation(fmt, demo.task.prompt, demo.task.tools)
    prompt, steps = list(conversation.token_ids), []
    for turn in demo.turns:
        conversation.take_prompt()
        parsed = conversation.add_sampled(fmt.encode_assistant(turn.assistant))
        before = len(conversation.token_ids)
        if turn.observations:
            conversation.add_messages([ChatMessage("tool", text, name=call.name or "")
                                       for call, text in zip(parsed.calls, turn.observations)])
        calls = [(demo.task.tool(call.name), dict(call.arguments or {}))
                 for call in parsed.calls]
        steps.append((calls, conversation.token_ids[before:]))
    return prompt, steps


def _timed(keys: list[str], concurrency: int,
           one: Callable[[str], Awaitable[None]]) -> tuple[float, float]:
    """Process CPU and wall seconds of running `one(key)` for every key, `concurrency` at once."""
    import anyio

    async def worker() -> None:
        while keys:
            await one(keys.pop())

    async def main() -> None:
        async with anyio.create_task_group() as group:
            for _ in range(concurrency):
                group.start_soon(worker)

    cpu0, wall0 = time.process_time(), time.perf_counter()
    anyio.run(main)
    return time.process_time() - cpu0, time.perf_counter() - wall0


def run_cell(fmt_kind: str, suite: str, concurrency: int, trajectories: int,
             profile: str | None, group_size: int = 1,
             longhaul_k: tuple[int, int] = (1, 30)) -> dict[str, Any]:
    """One measurement, in this process: the loop, then the fakes alone (unless profiling)."""
    setup = prepare(fmt_kind, suite, trajectories, group_size, longhaul_k)
    if profile:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
        cpu, wall, turns = measure_loop(setup, concurrency)
        profiler.disable()
        profiler.dump_stats(profile)
        fakes_cpu = float("nan")
    else:
        cpu, wall, turns = measure_loop(setup, concurrency)
        fakes_cpu, fake_turns = measure_fakes(setup, concurrency)
        assert fake_turns == turns, (fake_turns, turns)
    return {"format": fmt_kind, "suite": suite, "concurrency": concurrency,
            "trajectories": trajectories, "group_size": group_size, "turns": turns, "cpu_s": cpu,
            "wall_s": wall, "ms_per_turn": 1000 * cpu / turns, "turns_per_s": turns / wall,
            "fakes_ms_per_turn": 1000 * fakes_cpu / turns,
            "loop_ms_per_turn": 1000 * (cpu - fakes_cpu) / turns}


def _arith_handler(evaluate: Callable[[str], int]) -> Callable[[list[str], bytes | None], str]:
    def handler(argv: list[str], stdin: bytes | None) -> str:
        code = (stdin or b"").decode().strip()
        if argv[0] != "python3" or not (code.startswith("print(") and code.endswith(")")):
            raise ValueError(f"the bench's fake sandbox runs print(expression) only: {code!r}")
        return f"{evaluate(code[6:-1])}\n"
    return handler


def spawn(cell: tuple[str, str, int], trajectories: int, src: Path,
          options: list[str]) -> dict[str, Any]:
    fmt_kind, suite, concurrency = cell
    command = [sys.executable, __file__, "--cell", "--src", str(src), "--formats", fmt_kind,
               "--suites", suite, "--concurrency", str(concurrency),
               "--trajectories", str(trajectories), *options]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"cell {cell} with {src} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--formats", default="hermes,template")
    parser.add_argument("--suites", default="arith,longhaul")
    parser.add_argument("--concurrency", default="100,1000")
    parser.add_argument("--trajectories", type=int, default=1000,
                        help="per cell (at least the concurrency)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per cell; the best is shown")
    parser.add_argument("--against", type=Path, help="also run every cell with this checkout")
    parser.add_argument("--src", type=Path, default=ROOT, help=argparse.SUPPRESS)
    parser.add_argument("--cell", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile", help="cProfile one cell in-process into this file")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--group-size", type=int, default=1,
                        help="trajectories per task instance")
    parser.add_argument("--longhaul-k", default="1,30", help="MIN,MAX chain length")
    args = parser.parse_args()
    longhaul_k = tuple(int(k) for k in args.longhaul_k.split(","))
    if len(longhaul_k) != 2 or args.group_size < 1:
        parser.error("--longhaul-k takes MIN,MAX and --group-size at least 1")
    options = ["--group-size", str(args.group_size), "--longhaul-k", args.longhaul_k]
    cells = [(f, s, int(n)) for f in args.formats.split(",") for s in args.suites.split(",")
             for n in args.concurrency.split(",")]
    if args.cell or args.profile:
        sys.path.insert(0, str(args.src.resolve()))
        fmt_kind, suite, concurrency = cells[0]
        row = run_cell(fmt_kind, suite, concurrency, max(args.trajectories, concurrency),
                       args.profile, args.group_size, (longhaul_k[0], longhaul_k[1]))
        print(json.dumps(row))
        return
    sources = [("this", ROOT)] + ([("against", args.against.resolve())] if args.against else [])
    print(f"agent loop, one core: scripted engine {ENGINE_LATENCY}, fake sandbox exec "
          f"{SANDBOX_EXEC_S}s, longhaul k={args.longhaul_k} {LONGHAUL}, group size "
          f"{args.group_size}; sources: " + ", ".join(f"{n}={p}" for n, p in sources))
    print(f"{'format':9s} {'suite':9s} {'N':>5s} {'source':8s} {'turns':>7s} "
          f"{'ms CPU/turn':>12s} {'turns/s':>9s} {'wall s':>7s} {'fakes ms':>9s} {'loop ms':>8s}")
    rows = []
    for cell in cells:
        for name, src in sources:
            best = None
            for _ in range(args.repeat):
                row = spawn(cell, max(args.trajectories, cell[2]), src, options)
                if best is None or row["ms_per_turn"] < best["ms_per_turn"]:
                    best = row
            assert best is not None
            best["source"] = name
            rows.append(best)
            print(f"{best['format']:9s} {best['suite']:9s} {best['concurrency']:5d} {name:8s} "
                  f"{best['turns']:7d} {best['ms_per_turn']:12.3f} {best['turns_per_s']:9.0f} "
                  f"{best['wall_s']:7.2f} {best['fakes_ms_per_turn']:9.3f} "
                  f"{best['loop_ms_per_turn']:8.3f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
