"""Fault-injection soak: a real job under N faults at seeded random moments, then its invariants.

The job is real: `stalewise run` of the tiny model on `arith` in inflight mode, its engine and
learner processes, Docker sandboxes on a Docker engine of the soak's own
(scripts/second_dockerd.sh, so restarting it touches nothing else on the machine), and a store
on SQLite (in a small tmpfs of its own, so the disk can be filled) or PostgreSQL (`--db
postgres`: a fresh database on the server scripts/ensure_postgres.sh starts).

Faults, one at a time, each at a seeded random moment once the job has made progress since the
previous one (a learner step, then a random delay):

    engine        SIGKILL of the inference engine
    learner       SIGKILL of the learner
    orchestrator  SIGKILL of `stalewise run` itself (its children die with it)
    container     `docker kill` of one of the job's live sandboxes
    dockerd       the job's Docker engine killed and started again
    disk_full     the store's disk filled for a few seconds (SQLite)
    postgres      the PostgreSQL server restarted (--db postgres)

What recovers: the job itself where it can (a dead learner is restarted, a lost sandbox is an
infrastructure error of its trajectory); otherwise the job stops, and the soak does what an
operator does, `stalewise run --resume RUN CONFIG`, until the run finishes.

Then it checks from the store (and Docker, and /proc): the run finished; the learner stream is
contiguous and holds each trajectory once; the learner steps consumed it in order, each
sequence number once, none trained twice; every trajectory has a terminal status and a reason;
every admitted trajectory's calls are stored; the bias ledger's counts equal the trajectories
and decisions tables; policy versions are monotone and every published checkpoint loads; no
container and no process of the job is left. The last line says
`faults N survived, invariants K/K held` (or which broke); the exit code is 0 only then.

    .venv/bin/python bench/soak.py --faults 3 --seed 0 [--db sqlite|postgres]
        [--kinds engine,learner,...] [--keep DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this folder is first on sys.path, where bench/engine.py and bench/learner.py
# would shadow the packages of the same names: drop it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Callable  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SECOND_DOCKERD = ROOT / "scripts" / "second_dockerd.sh"
KINDS = ("engine", "learner", "orchestrator", "container", "dockerd", "disk_full", "postgres")
STORE_TMPFS_MB = 256
HANG_S = 420.0  # no learner step for this long: the soak calls the job hung
TERMINAL = {"completed", "truncated", "failed", "infra_error", "aborted"}


class SoakFailed(RuntimeError):
    """The job could not be brought to its end (hung, or resumed too often)."""


@dataclass
class Fault:
    kind: str
    step: int  # the learner's step count when it was injected
    at_s: float  # seconds since the job first started
    detail: str = ""


@dataclass
class Job:
    """The job's processes and files; `proc` is the current `stalewise run`."""

    work: Path
    config: Path
    db_url: str
    docker_dir: Path
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    run_id: str | None = None
    resumes: int = 0
    started: float = field(default_factory=time.monotonic)

    def start(self) -> None:
        argv = [sys.executable, "-m", "stalewise", "run", str(self.config)]
        if self.run_id is not None:
            argv[4:4] = ["--resume", self.run_id]
        out = open(self.work / f"job-{self.resumes}.log", "w")
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True)
        out.close()

    def since(self) -> float:
        return time.monotonic() - self.started

    def say(self, line: str) -> None:
        print(f"  {self.since():7.1f}s  {line}", flush=True)


# ---------------------------------------------------------------------------- the store

def open_store(url: str):
    from core.store.store import Store

    return Store.open(url)


def read_store(job: Job, read: Callable, default=None):
    """`read(store)`, or `default` while the store cannot answer (disk full, server restarting,
    not created yet)."""
    try:
        store = open_store(job.db_url)
    except Exception:
        return default
    try:
        return read(store)
    except Exception:
        return default
    finally:
        store.close()


def learner_steps(job: Job) -> int:
    def steps(store) -> int:
        if job.run_id is None:
            runs = store.runs()
            if not runs:
                return 0
            job.run_id = runs[0].id
        return len(store.learner_steps(job.run_id))
    return read_store(job, steps, default=-1)


def run_error(job: Job) -> str:
    """The first line of the error the run recorded when it stopped."""
    error = read_store(job, lambda store: store.run(job.run_id).error, default=None)
    return (error or "no error recorded").strip().splitlines()[0][:240]


def run_status(job: Job) -> str | None:
    return read_store(job, lambda store: store.run(job.run_id).status if job.run_id else None)


# ---------------------------------------------------------------------------- keeping it going

def keep_going(job: Job, until: Callable[[], bool], max_resumes: int) -> None:
    """Wait for `until()`; resume the job whenever it stops without finishing; `SoakFailed`
    when it hangs (no learner step for HANG_S) or needs more than `max_resumes` resumes."""
    last_steps, last_progress = learner_steps(job), time.monotonic()
    while not until():
        code = job.proc.poll()
        if code is not None and run_status(job) == "finished":
            return
        if code is not None:
            if job.run_id is None:
                raise SoakFailed(f"the job exited ({code}) before it created its run; see "
                                 f"{job.work}/job-{job.resumes}.log")
            if job.resumes >= max_resumes:
                raise SoakFailed(f"the job stopped {job.resumes + 1} times; the last time with "
                                 f"code {code} (see {job.work}/job-{job.resumes}.log)")
            job.resumes += 1
            why = "" if code == -signal.SIGKILL else f": {run_error(job)}"
            job.say(f"job exited ({code}){why}; stalewise run --resume {job.run_id}")
            job.start()
        steps = learner_steps(job)
        if steps > last_steps:
            last_steps, last_progress = steps, time.monotonic()
        elif time.monotonic() - last_progress > HANG_S:
            raise SoakFailed(f"no learner step for {HANG_S:.0f} s (at step {last_steps}); see "
                             f"{job.work}/job-{job.resumes}.log")
        time.sleep(0.5)


# ---------------------------------------------------------------------------- processes

def children(pid: int) -> list[tuple[int, list[str]]]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append((int(entry.name), argv))
    return found


def child_serving(job: Job, role: str) -> int | None:
    """The pid of the job's `python -m <role> serve` child (rank 0 for the learner)."""
    for pid, argv in children(job.proc.pid):
        if role in argv and "serve" in argv:
            return pid
    return None


def job_processes(job: Job) -> list[str]:
    """Processes left that belong to the job: their command line names its config or its run
    folders (the orchestrator, the engine, the learner and its ranks, SFT)."""
    marks = (str(job.config), str(job.work / "runs"))
    left = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if any(mark in argv for mark in marks) and state != "Z":
            left.append(f"{entry.name}: {argv.replace(chr(0), ' ')[:160]}")
    return left


# ---------------------------------------------------------------------------- Docker

def docker_engine(directory: Path, action: str) -> str:
    done = subprocess.run(["bash", str(SECOND_DOCKERD), action, str(directory)],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SoakFailed(f"second_dockerd.sh {action} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def docker_client(job: Job):
    import docker

    return docker.DockerClient(base_url=job.env["DOCKER_HOST"], timeout=60)


def containers_of(job: Job, *, running_only: bool) -> list[dict]:
    from sandboxes.labels import RUN_ID

    client = docker_client(job)
    try:
        return client.api.containers(all=not running_only,
                                     filters={"label": f"{RUN_ID}={job.run_id}"})
    finally:
        client.close()


def import_base_image(job: Job) -> None:
    from sandboxes.engine import connect
    from sandboxes.hosts import copy_image
    from sandboxes.image import BASE_IMAGE, build_base, image_exists

    build_base(log=lambda line: None)
    source, target = connect(), docker_client(job)
    try:
        if image_exists(target, BASE_IMAGE) is None:
            copy_image(source, target, BASE_IMAGE)
    finally:
        source.close()
        target.close()


# ---------------------------------------------------------------------------- the faults

def inject(kind: str, job: Job, rng: random.Random, store_dir: Path | None) -> str:
    """Do fault `kind` now; returns what was done."""
    if kind in ("engine", "learner"):
        pid = child_serving(job, kind)
        if pid is None:
            return f"no {kind} process to kill (the job was between processes)"
        os.kill(pid, signal.SIGKILL)
        return f"SIGKILL {kind} pid {pid}"
    if kind == "orchestrator":
        pid = job.proc.pid
        os.kill(pid, signal.SIGKILL)
        job.proc.wait()
        return f"SIGKILL orchestrator pid {pid}"
    if kind == "container":
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            live = containers_of(job, running_only=True)
            if live:
                victim = rng.choice(live)
                client = docker_client(job)
                try:
                    client.api.kill(victim["Id"])
                    return f"docker kill {victim['Names'][0].lstrip('/')}"
                except Exception:  # it ended meanwhile: another one
                    pass
                finally:
                    client.close()
            time.sleep(0.2)
        return "no live container within 30 s"
    if kind == "dockerd":
        docker_engine(job.docker_dir, "kill")
        down = rng.uniform(1.0, 4.0)
        time.sleep(down)
        docker_engine(job.docker_dir, "start")
        return f"Docker engine killed, started again after {down:.1f} s"
    if kind == "disk_full":
        assert store_dir is not None
        hold = rng.uniform(2.0, 6.0)
        filler = store_dir / "filler"
        with open(filler, "wb", buffering=0) as out:
            try:
                while True:
                    out.write(b"\0" * (1 << 20))
                    out.flush()
            except OSError:
                pass
        time.sleep(hold)
        filler.unlink()
        return f"store disk full for {hold:.1f} s"
    if kind == "postgres":
        data = os.environ.get("STALEWISE_PG_DATA", "/var/tmp/stalewise-pg")
        binary = sorted(Path("/usr/lib/postgresql").glob("*/bin"))[-1]
        # -l: the restarted server writes its log there, not to our pipes (it outlives pg_ctl)
        subprocess.run(["su", "postgres", "-s", "/bin/sh", "-c",
                        f"{binary}/pg_ctl -D '{data}' -l '{data}/server.log' -w -t 60 -m fast "
                        "restart"], check=True, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
        return "PostgreSQL restarted (fast shutdown)"
    raise ValueError(kind)


def fault_plan(rng: random.Random, count: int, kinds: list[str]) -> list[str]:
    """`count` kinds: seeded shuffles of `kinds`, one after another (every kind once per round)."""
    plan: list[str] = []
    while len(plan) < count:
        round_ = list(kinds)
        rng.shuffle(round_)
        plan += round_
    return plan[:count]


# ---------------------------------------------------------------------------- invariants

@dataclass
class Check:
    name: str
    held: bool
    detail: str = ""


def invariants(job: Job, steps: int) -> list[Check]:
    from sqlalchemy import func, select

    from core.store import schema as s
    from core.store.rollouts import UNFINISHED

    store = open_store(job.db_url)
    checks: list[Check] = []
    run_id = job.run_id
    try:
        run = store.run(run_id)
        done = store.learner_steps(run_id)
        checks.append(Check("the run finished with its learner steps",
                            run.status == "finished" and len(done) == steps,
                            f"status {run.status}, {len(done)} of {steps} steps"))
        with store.engine.connect() as c:
            stream = list(c.execute(select(s.StreamEntry.seq, s.StreamEntry.trajectory_id)
                                    .where(s.StreamEntry.run_id == run_id)
                                    .order_by(s.StreamEntry.seq)))
            trajectories = list(c.execute(select(s.Trajectory).where(
                s.Trajectory.run_id == run_id)))
            called = set(c.execute(select(s.ModelCall.trajectory_id).join(
                s.Trajectory, s.Trajectory.id == s.ModelCall.trajectory_id).where(
                s.Trajectory.run_id == run_id).distinct()).scalars())
            decisions = list(c.execute(select(s.AdmissionDecision.trajectory_id,
                                              s.AdmissionDecision.decision)
                                       .where(s.AdmissionDecision.run_id == run_id)
                                       .order_by(s.AdmissionDecision.id)))
            ledger_at = c.execute(select(func.max(s.BiasLedgerRow.computed_at)).where(
                s.BiasLedgerRow.run_id == run_id)).scalar()
            ledger = list(c.execute(select(s.BiasLedgerRow).where(
                s.BiasLedgerRow.run_id == run_id, s.BiasLedgerRow.computed_at == ledger_at,
                s.BiasLedgerRow.duration_quantile.is_(None))))
            versions = list(c.execute(select(s.PolicyVersion).where(
                s.PolicyVersion.run_id == run_id).order_by(s.PolicyVersion.version)))
    finally:
        store.close()

    seqs = [e.seq for e in stream]
    checks.append(Check("the learner stream is contiguous and holds each trajectory once",
                        seqs == list(range(1, len(seqs) + 1))
                        and len({e.trajectory_id for e in stream}) == len(stream),
                        f"{len(stream)} entries"))
    consumed = [(r.first_seq, r.last_seq) for r in done]
    expected_first = [1] + [last + 1 for _, last in consumed[:-1]]
    in_order = [first for first, _ in consumed] == expected_first and all(
        last >= first for first, last in consumed)
    last_trained = consumed[-1][1] if consumed else 0
    checks.append(Check("the learner consumed the stream in order, each entry once",
                        in_order and last_trained <= len(stream),
                        f"steps {[r.step for r in done][:3]}..., sequence 1..{last_trained}; "
                        f"{len(stream) - last_trained} admitted after the last step (never "
                        "trained: the run ended)"))
    by_id = {t.id: t for t in trajectories}
    open_ = [t.id for t in trajectories if t.status not in TERMINAL]
    no_reason = [t.id for t in trajectories if not (t.stop_reason or t.error)]
    checks.append(Check("every trajectory has a terminal status and a reason",
                        not open_ and not no_reason,
                        f"{len(trajectories)} trajectories; not ended: {open_[:5]}; without a "
                        f"reason: {no_reason[:5]}"))
    admitted_bad = [e.trajectory_id for e in stream
                    if e.trajectory_id not in called or by_id[e.trajectory_id].status == "aborted"]
    checks.append(Check("every admitted trajectory finished and its calls are stored",
                        not admitted_bad, f"bad: {admitted_bad[:5]}"))
    final = {}
    for trajectory_id, decision in decisions:
        final[trajectory_id] = decision
    generated = sum(1 for t in trajectories
                    if t.purpose == "train" and t.status not in UNFINISHED)
    ledger_generated = sum(r.generated for r in ledger)
    ledger_admitted = sum(r.admitted for r in ledger)
    admitted_finished = sum(1 for tid, d in final.items() if d == "admit"
                            and by_id[tid].status not in UNFINISHED)
    checks.append(Check("the bias ledger's counts equal the trajectories and decisions",
                        ledger_at is not None and ledger_generated == generated
                        and ledger_admitted == admitted_finished,
                        f"generated {ledger_generated} vs {generated} trajectories; admitted "
                        f"{ledger_admitted} vs {admitted_finished} decisions"))
    numbers = [v.version for v in versions]
    monotone = numbers == list(range(1, len(numbers) + 1)) and all(
        a.learner_step < b.learner_step and a.last_seq <= b.last_seq
        and a.created_at <= b.created_at for a, b in zip(versions, versions[1:]))
    checks.append(Check("policy versions are monotone", monotone and len(numbers) == steps,
                        f"{len(numbers)} versions"))
    unloadable = [v.version for v in versions if not loads(Path(v.path))]
    checks.append(Check("every published checkpoint loads", not unloadable,
                        f"{len(versions) - len(unloadable)} of {len(versions)} load"))
    deadline = time.monotonic() + 60
    while (left := containers_of(job, running_only=False)) and time.monotonic() < deadline:
        time.sleep(0.5)
    checks.append(Check("no container of the job is left", not left,
                        ", ".join(c["Names"][0] for c in left)))
    deadline = time.monotonic() + 30
    while (procs := job_processes(job)) and time.monotonic() < deadline:
        time.sleep(0.5)
    checks.append(Check("no process of the job is left", not procs, "; ".join(procs[:3])))
    return checks


def loads(directory: Path) -> bool:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        AutoModelForCausalLM.from_pretrained(directory)
    except Exception:
        return False
    return True


# ---------------------------------------------------------------------------- set-up

def job_config(work: Path, model: Path, db_url: str, steps: int) -> Path:
    """configs/soak.toml with this soak's store, folders, model and steps."""
    config = work / "soak.toml"
    config.write_text(f"""extends = "{ROOT / 'configs' / 'soak.toml'}"

[run]
db_url = "{db_url}"
output_dir = "{work}/runs"

[model]
path = "{model}"
create_tiny = false

[pipeline]
steps = {steps}
""")
    return config


PG_ADMIN_URL = os.environ.get("STALEWISE_TEST_PG_URL",
                              "postgresql+psycopg://postgres@127.0.0.1:54329/stalewise_test")


def postgres(statement: str) -> None:
    from sqlalchemy import create_engine, text

    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as c:
            c.execute(text(statement))
    finally:
        admin.dispose()


def store_url(args, work: Path) -> tuple[str, Path | None]:
    if args.db == "postgres":
        name = f"soak_{args.seed}_{uuid.uuid4().hex[:8]}"
        postgres(f"CREATE DATABASE {name}")
        return PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name, None
    store_dir = work / "store"
    store_dir.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={STORE_TMPFS_MB}m", "tmpfs",
                    str(store_dir)], check=True)
    return f"sqlite:///{store_dir}/store.db", store_dir


def soak(args) -> int:
    rng = random.Random(args.seed)
    kinds = args.kinds.split(",") if args.kinds else [
        k for k in KINDS if k != ("postgres" if args.db == "sqlite" else "disk_full")]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise SystemExit(f"soak: unknown fault kinds {sorted(unknown)}; choose from {KINDS}")
    plan = fault_plan(rng, args.faults, kinds)
    steps = 6 * args.faults + 20  # a fault every one to three steps and its recovery, a tail
    work = Path(args.keep or tempfile.mkdtemp(prefix="soak-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    docker_dir = Path(tempfile.mkdtemp(prefix="swk-", dir="/tmp"))
    store_dir = None
    job: Job | None = None
    checks: list[Check] = []
    faults: list[Fault] = []
    failure = None
    try:
        from engine.tiny import init_tiny

        model = init_tiny(work / "tiny")
        db_url, store_dir = store_url(args, work)
        env = {**os.environ, "DOCKER_HOST": docker_engine(docker_dir, "start"),
               "STALEWISE_INSTALLATION_ID": f"soak-{uuid.uuid4().hex[:8]}"}
        job = Job(work, job_config(work, model, db_url, steps), db_url, docker_dir, env)
        import_base_image(job)
        print(f"soak: {args.faults} faults ({', '.join(plan)}), seed {args.seed}, {args.db}, "
              f"{steps} learner steps; work in {work}", flush=True)
        job.start()
        for kind in plan:
            at_least = max(learner_steps(job), 0) + rng.randint(1, 3)
            keep_going(job, lambda: learner_steps(job) >= at_least, args.faults + 10)
            if run_status(job) == "finished":
                break
            time.sleep(rng.uniform(0.0, 3.0))
            if kind in ("engine", "learner"):  # a job between processes gets its new ones first
                keep_going(job, lambda: child_serving(job, kind) is not None, args.faults + 10)
            fault = Fault(kind, learner_steps(job), job.since())
            fault.detail = inject(kind, job, rng, store_dir)
            faults.append(fault)
            job.say(f"step {fault.step:3d}  {kind:12s} {fault.detail}")
        keep_going(job, lambda: False, args.faults + 10)
        job.proc.wait()
        checks = invariants(job, steps)
    except SoakFailed as exc:
        failure = str(exc)
    except (OSError, subprocess.SubprocessError) as exc:  # a fault that could not be done
        failure = f"{type(exc).__name__}: {exc}"
    finally:
        if job is not None and job.proc is not None and job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)
        docker_engine(docker_dir, "stop")
        if store_dir is not None:
            subprocess.run(["umount", "-l", str(store_dir)], check=False)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
            if job is not None and args.db == "postgres":
                postgres(f"DROP DATABASE IF EXISTS {job.db_url.rsplit('/', 1)[1]} WITH (FORCE)")
    for check in checks:
        print(f"  [{'ok' if check.held else 'BROKEN'}] {check.name}: {check.detail}")
    survived = len(faults) == args.faults and failure is None and checks and checks[0].held
    held = sum(c.held for c in checks)
    broken = "; ".join(c.name for c in checks if not c.held) or failure or ""
    resumes = job.resumes if job is not None else 0
    print(f"soak: {len(faults)} faults injected, {resumes} resumes, "
          f"{job.since() if job else 0:.0f} s" + (f"; {failure}" if failure else ""))
    print(f"faults {len(faults)} {'survived' if survived else 'NOT survived'}, invariants "
          f"{held}/{len(checks)} held" + (f" (broken: {broken})" if broken else ""))
    return 0 if survived and checks and held == len(checks) else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--db", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--kinds", default="", help=f"comma-separated subset of {KINDS}")
    parser.add_argument("--keep", default="", help="work folder to keep (logs, runs, store)")
    raise SystemExit(soak(parser.parse_args()))


if __name__ == "__main__":
    main()
