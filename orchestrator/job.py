"""`stalewise run`: one job, from config to report, owned by one anyio task group.

Order of a run: open (or migrate) the store and create the run row; make sure the model exists
(and warm-start it by SFT when configured); start the engine and the learner processes; then,
in one task group, the store writer, the sandbox pools, the process watchers, the progress
display and the pipeline; evaluation before and after RL; the bias ledger and the report.

Guarantees: a failure anywhere (an exception in any task, a child process dying) cancels the
rest, records the run as `failed` with the error, and the `finally` blocks stop the child
processes and remove every container of the run. `--resume RUN` marks what was in flight as
aborted, removes the run's containers, restarts the learner from its last published version
and sequence number, and continues with new groups until the learner reaches its steps.
"""

from __future__ import annotations

import json
import secrets
import shutil
import signal
import time
import traceback
from contextlib import AsyncExitStack
from dataclasses import asdict
from pathlib import Path

import anyio
from pydantic import BaseModel

from config.job import JobConfig
from config.learner import WarmStartJob
from core.children import Child, python_command
from core.evaluation import (
    Evaluation,
    failure_changes,
    gain_figures,
    latest_by_label,
)
from core.log import bind_run, configure_logging, get_logger
from core.numerics import cpu_facts, model_width, resolve_dtype
from core.open_files import raise_open_files
from core.store import audit
from core.store.outage import Outage, first_line
from core.store.store import Store
from core.tiny import tiny_seed
from core.tokenizer import load_tokenizer
from orchestrator.cluster.roles import RayLearners
from orchestrator.engines.fleet import EngineFleet
from orchestrator.evaluate import evaluate, paired_gain
from orchestrator.pipeline import Pipeline, tune_gc_for_concurrency
from orchestrator.pools import PoolSet
from orchestrator.processes import Supervised, run_to_end
from orchestrator.progress import show_progress, snapshot
from orchestrator.report import beyond_weights_note, rollout_dynamics, store_ledger, write_report
from orchestrator.resume import recover_run
from orchestrator.writer import running_writer
from tasks.api import TaskFamily
from tasks.chat import make_chat_format
from tasks.loading import load_family

log = get_logger("stalewise.job")


def new_run_id(name: str) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return f"{name}-{stamp}-{secrets.token_hex(2)}"


async def ensure_model(job: JobConfig) -> Path:
    """The checkpoint the job starts from: `model.path`, or with `model.create_tiny` the tiny
    model of the run's seed. A tiny model at `model.path` made with another seed (an earlier
    run of another seed in this checkout) is left alone: this run makes and uses its own beside
    it (`PATH-seedN`), so `--set run.seed=N` gives the same weights as in a fresh clone, whatever
    ran before. A new tiny model is written to a temporary folder and renamed into place, so a
    job started beside another never reads a half-written one."""
    path = Path(job.model.path)
    seed = job.run.seed
    if (path / "config.json").exists():
        made_with = tiny_seed(path)
        if not job.model.create_tiny or made_with is None or made_with == seed:
            return path
        log.info("the tiny model there was made with another seed; using this seed's",
                 path=str(path), its_seed=made_with, seed=seed)
        path = path.with_name(f"{path.name}-seed{seed}")
        if (path / "config.json").exists():
            return path
    elif (missing := job.model.missing_checkpoint()) is not None:
        raise FileNotFoundError(f"model.path = {missing}")
    log.info("creating the tiny default model", path=str(path), seed=seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    output = path.with_name(f"init-{scratch.name[1:]}.log")  # this creation's own output
    try:
        await run_to_end(Child.start("model", python_command(
            "-m", "stalewise", "model", "init-tiny", str(scratch), "--seed", str(seed)),
            output))
        if not (scratch / "config.json").exists():
            raise RuntimeError(f"could not create the tiny model in {path}; see {output}")
        output.unlink(missing_ok=True)  # kept only where the creation failed
        try:
            scratch.rename(path)  # replaces nothing but an empty folder
        except OSError:
            if not (path / "config.json").exists():
                raise RuntimeError(f"{path} exists but holds no checkpoint (config.json "
                                   f"missing), so the tiny model cannot be made there; remove "
                                   f"it, or point model.path elsewhere") from None
            # a job beside this one made it first: the same seed, the same weights
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return path


def write_child_config(run_dir: Path, name: str, section: BaseModel) -> Path:
    """A config section as the JSON file a child process reads with `--config`."""
    path = run_dir / f"{name}.json"
    path.write_text(section.model_dump_json(indent=2))
    return path


async def warm_start(job: JobConfig, model_dir: Path, run_dir: Path) -> Path:
    """SFT on the family's synthetic demonstrations, in a child process; returns the new dir."""
    sft = job.learner.sft
    out = run_dir / "sft"
    if (out / "config.json").exists():
        return out
    section = WarmStartJob(learner=job.learner, family=job.tasks.family,
                           options=job.tasks.options, chat_format=job.model.chat_format,
                           tool_listing=job.model.tool_listing)
    argv = ["-m", "learner", "sft", str(model_dir), "--out", str(out),
            "--job", str(write_child_config(run_dir, "sft", section))]
    log.info("supervised warm start", demonstrations=sft.demonstrations, steps=sft.steps)
    child = Child.start("sft", python_command(*argv), run_dir / "sft.log")
    if await run_to_end(child) != 0 or not (out / "config.json").exists():
        raise RuntimeError(f"the SFT warm start failed; last log lines:\n{child.log_tail()}")
    done = json.loads((out / "stalewise.json").read_text())  # what `learner sft` measured
    log.info("warm start done", **{key: round(done[key], 4) for key in
                                   ("loss_after", "validation_demo_probability") if key in done},
             **({"kept_step": done["kept_step"]} if "kept_step" in done else {}),
             **({"tries": len(done["tries"]), "kept_try": done["kept_try"]}
                if "tries" in done else {}))
    return out


def warm_start_facts(sft_dir: Path) -> dict:
    """What `learner sft` measured and the machine it ran on (flat, for the report)."""
    done = json.loads((sft_dir / "stalewise.json").read_text())
    facts = {key: done[key] for key in ("sft_steps", "loss_after", "kept_step", "kept_try",
                                        "validation_demo_probability") if key in done}
    return {**facts, **done.get("numerics", {})}


def run_numerics(job: JobConfig, model_dir: Path) -> dict:
    """The dtypes the engine and the learner resolve on this machine for this model (the
    children resolve them with the same rule, `core.numerics`), and the CPU. An engine this job
    does not start (vLLM, `url`, `urls`) says its own in its logs: recorded as None."""
    hidden = model_width(model_dir)
    started_here = job.engine.kind == "embedded" and job.engine.url is None and not job.engine.urls
    return {"engine_dtype": resolve_dtype(job.engine.dtype, hidden_size=hidden)
            if started_here else None,
            "learner_dtype": resolve_dtype(job.learner.dtype, hidden_size=hidden,
                                           device=job.learner.device),
            **cpu_facts()}


def precision_gaps(store: Store, run_id: str) -> dict:
    """The sampler/trainer log-prob gaps the learner's `gap_probe` measured, over all steps:
    per dtype, the token-weighted mean, the largest step p99 and the largest gap; {} without
    the probe."""
    steps = [r.metrics for r in store.learner_steps(run_id)
             if r.metrics and r.metrics.get("numerics/gap_tokens")]
    if not steps:
        return {}
    tokens = sum(m["numerics/gap_tokens"] for m in steps)
    gaps = {}
    for dtype in ("float32", "bfloat16"):
        key = f"numerics/gap_{dtype}"
        gaps[dtype] = {name: float(f"{value:.4g}") for name, value in (
            ("mean", sum(m[f"{key}_mean"] * m["numerics/gap_tokens"] for m in steps) / tokens),
            ("p99", max(m[f"{key}_p99"] for m in steps)),
            ("max", max(m[f"{key}_max"] for m in steps)))}
    return {"sampler_trainer_gap": {"tokens": int(tokens), **gaps}}


def learner_argv(job: JobConfig, run_id: str, model_dir: Path, run_dir: Path) -> list[str]:
    return ["-m", "learner", "serve", "--db", job.run.db_url, "--run", run_id,
            "--config", str(write_child_config(run_dir, "learner", job.learner)),
            "--model", str(model_dir),
            "--publish-root", str(run_dir / "policy"), "--steps", str(job.pipeline.steps)]


def start_learner(job: JobConfig, run_id: str, model_dir: Path, run_dir: Path) -> Child:
    return Child.start("learner", python_command(*learner_argv(job, run_id, model_dir, run_dir)),
                       run_dir / "learner.log")


def place_learner_on_ray(job: JobConfig, run_id: str, model_dir: Path,
                         run_dir: Path) -> RayLearners:
    """`cluster.backend = "ray"`: the learner workers as Ray actors, each supervising its child
    on its node (docs/scale-out.md); paths are absolute, since every node must see the model
    and run directories at the same place."""
    argv = learner_argv(job, run_id, model_dir.resolve(), run_dir.resolve())
    return RayLearners.place(job, argv, run_dir)


def describe_failure(exc: BaseException) -> str:
    """One line per root cause (exception groups are unwrapped)."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe_failure(e) for e in exc.exceptions)
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def run_job(job: JobConfig, *, resume: str | None = None) -> int:
    configure_logging(job.run.log_format)
    tune_gc_for_concurrency()
    return anyio.run(_run_until_signalled, job, resume)


async def _run_until_signalled(job: JobConfig, resume: str | None) -> int:
    """SIGTERM / SIGINT cancel the job cleanly: the run is recorded as aborted, children stopped."""
    outcome: dict[str, int | str] = {}

    async def main() -> None:
        outcome["code"] = await _run(job, resume, outcome)
        tg.cancel_scope.cancel()

    async def signals() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
            async for number in received:
                outcome["signal"] = signal.Signals(number).name
                tg.cancel_scope.cancel()
                return

    async with anyio.create_task_group() as tg:
        tg.start_soon(signals)
        tg.start_soon(main)
    return int(outcome.get("code", 130 if outcome.get("signal") == "SIGINT" else 143))


def open_files_needed(job: JobConfig) -> int:
    """Files the job may hold open at once, at most: every engine's connections, a tool
    connection per trajectory in flight, and 256 for the store, logs and children."""
    return (job.engine_connections() * job.engine.replica_count + job.rollout.max_concurrent
            + 256)


async def _run(job: JobConfig, resume: str | None, outcome: dict) -> int:
    store = Store.open(job.run.db_url, create=True)
    run_id = resume or new_run_id(job.run.name)
    bind_run(run_id)
    run_dir = Path(job.run.output_dir) / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    if resume:
        await anyio.to_thread.run_sync(recover_run, store, run_id)
    else:
        store.create_run(run_id, name=job.run.name, config=job.model_dump(mode="json"),
                         pipeline_mode=job.pipeline.mode)
    log.info("run started", run_dir=str(run_dir), db=store.url, mode=job.pipeline.mode)
    engines = learner_proc = None
    try:
        if job.sandbox.backend == "docker":  # fail before minutes of SFT, not after
            await anyio.to_thread.run_sync(_check_docker, job)
        # children started from the main thread (the event loop's) die with this process
        model_dir = await ensure_model(job)
        start_model = {"path": str(model_dir), "tiny_seed": tiny_seed(model_dir)}
        log.info("starting model", **start_model)
        if job.learner.sft.enabled and not resume:
            model_dir = await warm_start(job, model_dir, run_dir)
        version, path, _, _ = store.learner_progress(run_id)
        serve_dir = Path(path) if path else model_dir
        files = raise_open_files(open_files_needed(job))
        if not files.enough:
            log.warning("open-file limit too low", advice=files.advice())
        # from the main thread (blocking briefly), so what is started here dies with this process
        engines = EngineFleet.start(job, model_dir=serve_dir, version=version, run_dir=run_dir,
                                    run_id=run_id)
        learner_proc = (place_learner_on_ray(job, run_id, model_dir, run_dir)
                        if job.cluster.backend == "ray" else
                        Supervised("learner", lambda: start_learner(job, run_id, model_dir,
                                                                    run_dir), log=log.warning))
        summary = await _main(job, store, run_id, run_dir, model_dir, engines, learner_proc,
                              version, resume is not None)
        summary["start_model"] = start_model  # model.path, or the seed's tiny model beside it
        if not await _record_status(job, store, run_id, "finished", summary=summary):
            return 1
        log.info("run finished", report=str(run_dir / "report.md"))
        return 0
    except BaseException as exc:  # record the failure, then let cancellation propagate
        with anyio.CancelScope(shield=True):
            if "signal" in outcome:
                await _record_status(job, store, run_id, "aborted", error=(
                    f"terminated by {outcome['signal']}; continue with: stalewise run "
                    f"--resume {run_id} CONFIG"))
                log.error("run aborted", signal=outcome["signal"])
                raise
            message = describe_failure(exc)
            await _record_status(job, store, run_id, "failed",
                                 error=message + "\n" + traceback.format_exc())
            log.error("run failed", error=message,
                      resume=f"stalewise run --resume {run_id} CONFIG")
        if isinstance(exc, Exception):
            return 1
        raise
    finally:
        with anyio.CancelScope(shield=True):
            for proc in (learner_proc, engines):
                if proc is not None:
                    proc.stop()
            await anyio.to_thread.run_sync(_remove_containers, job, run_id)
            store.close()


async def _record_status(job: JobConfig, store: Store, run_id: str, status: str,
                         **values) -> bool:
    """Record the run's status, riding out a store that cannot write for a while
    (`run.store_outage_s`); False, with a log line instead of a traceback, when it never can
    (the status stays `running`, which `--resume` accepts once this process is gone)."""
    outage = Outage(job.run.store_outage_s)
    while True:
        try:
            await anyio.to_thread.run_sync(lambda: store.set_run_status(run_id, status, **values))
            return True
        except Exception as exc:
            try:
                delay = outage.failed(exc)
            except Exception:
                log.error("could not record the run's status in the store", status=status,
                          error=first_line(exc),
                          resume=f"stalewise run --resume {run_id} CONFIG")
                return False
            await anyio.sleep(delay)


async def with_job_tools(family: TaskFamily, job: JobConfig, run_id: str) -> TaskFamily:
    """The family with the job's `[[tools.mcp]]` tools added (listed once, now; servers that are
    not trusted are listed inside a sandbox of the first task's spec)."""
    if not job.tools.mcp:
        return family
    from sandboxes.backends import make_sandbox
    from sandboxes.hosts import HostSet
    from tasks.mcp import discover_tools, with_tools

    spec = family.instance(0, family.splits[0]).sandbox.model_copy(update={"files": {}})
    hosts = HostSet(job.sandbox.hosts) if job.sandbox.hosts else None
    try:
        tools = await discover_tools(job.tools.mcp, spec, lambda s: make_sandbox(
            s, backend=job.sandbox.backend, run_id=run_id, trajectory_id="mcp-list",
            hosts=hosts))
    finally:
        if hosts is not None:
            hosts.close()
    return with_tools(family, tools)


def _check_docker(job: JobConfig) -> None:
    """Every configured Docker engine (or the default one) answers, else the run fails now."""
    from sandboxes.engine import docker_host
    from sandboxes.hosts import connected

    for host in job.sandbox.hosts or [None]:
        with connected(host.url if host else docker_host()):
            pass


def _remove_containers(job: JobConfig, run_id: str) -> None:
    """Remove the run's containers; an unreachable Docker engine (often the reason the run
    failed) is a warning here, so it cannot hide the run's own error."""
    if job.sandbox.backend != "docker":
        return
    from core.sandbox import SandboxError
    from sandboxes.cleanup import remove_all
    from sandboxes.engine import docker_host
    from sandboxes.hosts import connected

    for host in job.sandbox.hosts or [None]:
        try:
            with connected(host.url if host else docker_host()) as client:
                remove_all(client, run_id=run_id)
        except SandboxError as exc:
            log.warning("could not remove the run's containers; `stalewise sandbox cleanup` "
                        "removes them once Docker answers", error=str(exc))


async def _main(job: JobConfig, store: Store, run_id: str, run_dir: Path, model_dir: Path,
                engines: EngineFleet, learner_proc: "Supervised | RayLearners", version: int,
                resumed: bool) -> dict:
    family = await with_job_tools(load_family(job.tasks.family, job.tasks.family_options()),
                                  job, run_id)
    chat_format = make_chat_format(load_tokenizer(model_dir), job.model.chat_format,
                                   tool_listing=job.model.tool_listing)
    started = time.monotonic()
    async with AsyncExitStack() as stack:
        client = await stack.enter_async_context(engines.client())
        await client.wait_ready(job.engine.startup_timeout_s)
        writer = await stack.enter_async_context(  # it outlives the rest
            running_writer(store, outage_s=job.run.store_outage_s))
        pools = PoolSet(job.sandbox, run_id)
        pipeline = Pipeline(run_id=run_id, cfg=job, store=store, writer=writer, engine=client,
                            family=family, chat_format=chat_format, acquire=pools.acquire,
                            engine_version=version, start_index=store.count_groups(run_id))
        if job.engine.kind == "vllm" and job.pipeline.mode == "async":
            log.warning("vLLM cannot keep older weights resident: in async mode a trajectory's "
                        "later turns may use newer weights (drain updates)")

        async with anyio.create_task_group() as tg:
            await tg.start(pools.run)
            await tg.start(engines.supervise, client)
            tg.start_soon(lambda: learner_proc.run(expected_exit=pipeline.done))
            tg.start_soon(lambda: show_progress(pipeline, every_s=job.run.progress_every_s,
                                                header=lambda: run_id))
            eval_args = dict(run_id=run_id, store=store, writer=writer, engine=client,
                             family=family, chat_format=chat_format, acquire=pools.acquire,
                             params=pipeline.params, instances=job.tasks.eval_instances,
                             concurrency=job.rollout.max_concurrent,
                             split=job.tasks.eval_split, seed=job.engine.seed,
                             options=await pipeline.rollout_options())
            if job.tasks.eval_instances and job.tasks.eval_before and not resumed:
                log.info("evaluation", **asdict(await evaluate(label="before", version=version,
                                                               **eval_args)))
            await pipeline.run()
            await writer.flush()
            if job.tasks.eval_instances:
                version = await pipeline.sync_weights()
                log.info("evaluation", **asdict(await evaluate(label="after", version=version,
                                                               **eval_args)))
            tg.cancel_scope.cancel()
    ledger, skew = await anyio.to_thread.run_sync(
        lambda: store_ledger(store, run_id, clip=job.admission.reweight_clip))
    results = await anyio.to_thread.run_sync(store.evaluations, run_id)
    curve = audit.learner_steps(store, run_id)
    lags = [r["mean_lag"] for r in curve if r["mean_lag"] is not None]
    summary = {
        "run_id": run_id, "mode": job.pipeline.mode, "kv": job.pipeline.kv,
        "wall_s": round(time.monotonic() - started, 1),
        "learner_steps": len(curve), "policy_version": pipeline.learner.version,
        "mean_token_lag": round(sum(lags) / len(lags), 3) if lags else None,
        "max_token_lag": max((r["max_lag"] for r in curve if r["max_lag"] is not None),
                             default=None),
        "progress": snapshot(pipeline),
        "admission": dict(pipeline.stats.decisions),
        "selection_skew": asdict(skew),
        "admission_reweight": job.admission.reweight,
        "rollout_dynamics": rollout_dynamics(store, run_id),
        "evaluations": [r.as_dict() for r in results],
        "held_out": family.held_out,
        "numerics": {**run_numerics(job, model_dir), **precision_gaps(store, run_id)},
        "report": str(run_dir / "report.md"), "db": store.url,
    }
    if pools.hosts is not None:
        summary["sandbox_hosts"] = pools.hosts.summary()
    if (run_dir / "sft" / "stalewise.json").is_file():
        summary["warm_start"] = warm_start_facts(run_dir / "sft")
    by_label = latest_by_label(results)
    if {"before", "after"} <= set(by_label) and by_label["before"].instances > 0 \
            and by_label["after"].instances > 0:
        summary["held_out_95"] = gain_figures(by_label["before"].counts,
                                              by_label["after"].counts)
        paired = paired_gain(store, (run_id, by_label["before"]), (run_id, by_label["after"]))
        if paired is not None:
            summary["held_out_paired"] = paired
    write_report(summary, ledger, run_dir, curve=curve)
    print_summary(summary, results, job)
    return summary


def print_summary(summary: dict, results: list[Evaluation], job: JobConfig) -> None:
    mode = job.pipeline.mode + (f"/{job.pipeline.kv}" if job.pipeline.mode == "inflight" else "")
    skew = summary["selection_skew"]
    lines = [f"stalewise run {summary['run_id']} finished in {summary['wall_s']:.0f} s "
             f"({summary['learner_steps']} learner steps, {mode}, mean token lag "
             f"{summary['mean_token_lag']})"]
    by_label = latest_by_label(results)
    held = "held-out" if summary["held_out"] else "(not held out: the family's splits share tasks)"
    if "before" in by_label and "after" in by_label:
        before, after = by_label["before"], by_label["after"]
        lines.append(f"  success rate on {after.instances} {held} {job.tasks.family} "
                     f"{after.split} instances ({after.distinct} distinct): before RL "
                     f"{100 * before.success_rate:.1f}% -> after RL "
                     f"{100 * after.success_rate:.1f}%")
        lines.append(f"  infrastructure errors and aborted trajectories in the evaluations "
                     f"(counted as failures): before {before.infra_errors} + {before.aborted}, "
                     f"after {after.infra_errors} + {after.aborted}")
        if "held_out_95" in summary:
            lines.append(f"  95% intervals: gain {summary['held_out_95']['gain']} "
                         f"(before {summary['held_out_95']['before']}, after "
                         f"{summary['held_out_95']['after']})")
        paired = summary.get("held_out_paired")
        if paired:
            lines.append(f"  per {after.split} instance, with the same sampling seeds before and "
                         f"after RL: solved by both {paired['both']}, only after RL "
                         f"{paired['only_after']}, only before {paired['only_before']}, by "
                         f"neither {paired['neither']}; paired 95% interval of the gain "
                         f"{paired['gain']}")
        changes = failure_changes(before, after)
        if changes:
            lines.append(f"  what RL changed: unsolved {after.split} trajectories by failure "
                         "mode, before -> after RL: " + "; ".join(
                             f"{mode} {n_before} -> {n_after}"
                             for mode, n_before, n_after in changes))
    elif "after" in by_label:
        after = by_label["after"]
        lines.append(f"  success rate on {after.instances} {held} {job.tasks.family} "
                     f"{after.split} instances ({after.distinct} distinct): after RL "
                     f"{100 * after.success_rate:.1f}% (no evaluation before RL in this run: "
                     f"tasks.eval_before = false)")
        lines.append(f"  infrastructure errors and aborted trajectories in the evaluation "
                     f"(counted as failures): {after.infra_errors} + {after.aborted}")
    if "warm_start" in summary:
        warm = summary["warm_start"]
        check = warm.get("validation_demo_probability")
        lines.append(f"  warm start: {warm.get('sft_steps')} SFT steps"
                     + (f", kept step {warm['kept_step']}" if "kept_step" in warm else "")
                     + (f", validation check {100 * check:.1f}%" if check is not None else "")
                     + f"; torch {warm.get('torch', '?')}, {warm.get('cpu_kernels', '?')} "
                     f"kernels, {warm.get('torch_threads', '?')} threads (the SFT path depends "
                     "on them)")
    numerics = summary["numerics"]
    lines.append(f"  numerics: engine {numerics['engine_dtype'] or 'its own dtype'}, learner "
                 f"{numerics['learner_dtype']} products (float32 weights); CPU "
                 f"{numerics['cpu']}, bfloat16 instructions: "
                 f"{', '.join(numerics['cpu_bf16']) or 'none'}")
    if "sampler_trainer_gap" in numerics:
        gap = numerics["sampler_trainer_gap"]
        lines.append(f"  sampler/trainer log-prob gap per token, {gap['tokens']} lag-0 tokens "
                     f"(engine {numerics['engine_dtype'] or '?'}): "
                     + "; ".join(f"{dtype} trainer mean {gap[dtype]['mean']:.2g}, p99 "
                                 f"{gap[dtype]['p99']:.2g}, max {gap[dtype]['max']:.2g}"
                                 for dtype in ("float32", "bfloat16")))
    dynamics = summary["rollout_dynamics"]
    lines.append(f"  rollouts: {dynamics['multi_version_fraction']} of trajectories span >1 "
                 f"weights version, KV lag mean {dynamics['mean_kv_lag']} max "
                 f"{dynamics['max_kv_lag']}, {dynamics['timeouts']} timeouts "
                 f"{dynamics['timeout_decisions']}")
    weighted = ""
    if summary.get("admission_reweight", "none") != "none":
        weighted = (f" (weighted by the selection weights: {skew['weighted_difficulty_tv']:.3f} "
                    f"and {skew['weighted_duration_tv']:.3f}; generated work beyond the "
                    f"weights {skew['beyond_weights_share']:.3f})")
    lines.append(f"  selection skew: difficulty TV {skew['difficulty_tv']:.3f}, duration TV "
                 f"{skew['duration_tv']:.3f}{weighted}, excluded token share "
                 f"{skew['excluded_token_share']:.3f}")
    if weighted:
        note = beyond_weights_note(skew["beyond_weights_share"], job.admission.reweight_clip)
        lines += [note] if note else []
    lines += [f"  report:   {summary['report']}",
              f"  database: {summary['db']}   (stalewise audit runs --url {summary['db']})"]
    print("\n".join(lines), flush=True)
