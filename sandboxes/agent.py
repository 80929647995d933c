"""The in-sandbox agent: one process that runs commands for the orchestrator.

It is sent to the sandbox at start (read from stdin by a two-line bootstrap, see `BOOTSTRAP`), so
any image with python3 (3.8 or newer) works and no file of ours has to be baked into an image.
It uses the standard library only and must stay importable on its own.

Wire protocol on stdin/stdout: frames of a 4-byte big-endian length and a UTF-8 JSON object.
Requests carry an integer `id` and an `op`; every request gets exactly one reply with the same
`id` and `ok`. Binary payloads (stdin, file data, output) are base64 strings.

Guarantees of `exec`:
- the command runs in a new session and process group, with the environment it was given and
  nothing else, with `oom_score_adj` 1000 so the kernel's OOM killer picks it before the agent;
- stdout and stderr are read as they are produced and capped here, at the source: the reply
  holds the first and last bytes up to the cap with a cut marker between them, plus the original
  byte count and the sha256 of the full stream, so a huge output never crosses the wire;
- on timeout the agent SIGKILLs the process group, the session, every descendant, and every
  process carrying the exec's marker variable (the agent is a child subreaper, so orphans come
  back to it), then reports `timed_out`;
- like `subprocess.run`, the exec ends when the command has exited and its stdout and stderr are
  closed: a background job that keeps them open holds the exec (to its timeout, when everything
  is killed); one started with its output redirected (`server >log 2>&1 &`) outlives the exec.
When stdin reaches EOF (the orchestrator went away) the agent kills what it started and exits,
which stops the container.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import resource
import select
import selectors
import shutil
import signal
import struct
import sys
import tarfile
import time

MAX_FRAME = 256 * 1024 * 1024
KILL_WAIT_S = 0.5
MARKER = "STALEWISE_EXEC"
CUT_MARKER = b"\n[... stalewise: %d bytes cut ...]\n"
SEED_DIR = "/opt/stalewise/seed"  # in a task image: copied into the fresh work dir at start/reset
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36

BOOTSTRAP = (
    "import os\n"
    "def r(n):\n"
    " b=b''\n"
    " while len(b)<n:\n"
    "  c=os.read(0,n-len(b))\n"
    "  if not c: raise SystemExit(3)\n"
    "  b+=c\n"
    " return b\n"
    "exec(compile(r(int(r(10))),'stalewise-agent','exec'))\n"
)


def _prctl(option: int, value: int) -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except Exception:  # not Linux, or no ctypes: the agent still works, with less protection
        pass


class Capture:
    """Keeps the head and tail of a byte stream, its total size and its sha256."""

    def __init__(self, cap: int) -> None:
        self.head_cap = cap // 2
        self.tail_cap = cap - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0
        self.sha = hashlib.sha256()

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        self.sha.update(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.tail_cap:
                del self.tail[: len(self.tail) - self.tail_cap]

    def result(self) -> dict:
        kept = len(self.head) + min(len(self.tail), self.tail_cap)
        if kept >= self.total:
            body = bytes(self.head + self.tail)
        else:
            tail = self.tail[len(self.tail) - self.tail_cap:] if self.tail_cap else b""
            body = bytes(self.head) + CUT_MARKER % (self.total - kept) + bytes(tail)
        return {"data": base64.b64encode(body).decode(), "bytes": self.total,
                "sha256": self.sha.hexdigest(), "truncated": kept < self.total}


def _read_stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, pgrp, session) of a process, or None when it is gone."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()
    return int(fields[1]), int(fields[2]), int(fields[3])


def _has_marker(pid: int, marker: bytes) -> bool:
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            return marker in f.read().split(b"\0")
    except OSError:
        return False


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _ancestors(pid: int) -> set[int]:
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        stat = _read_stat(pid)
        if stat is None:
            break
        pid = stat[0]
    seen.add(1)
    return seen


def _oom_kills() -> int | None:
    """The container cgroup's OOM-kill counter (v1 or v2), or None outside a container."""
    for path in ("/sys/fs/cgroup/memory/memory.oom_control", "/sys/fs/cgroup/memory.events"):
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


class Exec:
    """One running command: its pipes, captures, deadline and exit status."""

    def __init__(self, req_id: int, pid: int, deadline: float, cap: int, marker: bytes) -> None:
        self.req_id = req_id
        self.pid = pid
        self.started = time.monotonic()
        self.deadline = deadline
        self.marker = marker
        self.captures = {"stdout": Capture(cap), "stderr": Capture(cap)}
        self.open_fds: dict[int, str] = {}
        self.stdin_fd: int | None = None
        self.stdin_data = memoryview(b"")
        self.stdin_sent = 0
        self.status: int | None = None
        self.timed_out = False
        self.oom_before: int | None = None


class Agent:
    def __init__(self) -> None:
        self.sel = selectors.DefaultSelector()
        self.inbuf = bytearray()
        self.execs: dict[int, Exec] = {}  # by pid
        self.next_marker = 0
        self.marker_prefix = ("%s=%d-" % (MARKER, os.getpid())).encode()
        self.workdir = os.getcwd()
        self.container = False
        self.expires_at: float | None = None
        self.own = _ancestors(os.getpid())

    # ---- framing -------------------------------------------------------------------------
    def reply(self, req_id: int, ok: bool = True, **fields: object) -> None:
        fields["id"] = req_id
        fields["ok"] = ok
        body = json.dumps(fields, separators=(",", ":")).encode()
        frame = struct.pack(">I", len(body)) + body
        view = memoryview(frame)
        while view:
            try:
                n = os.write(1, view)
            except BlockingIOError:
                select.select([], [1], [])
                continue
            view = view[n:]

    def fail(self, req_id: int, message: str, kind: str = "bad_request") -> None:
        self.reply(req_id, False, error=message, kind=kind)

    def on_input(self) -> bool:
        try:
            chunk = os.read(0, 1 << 20)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        self.inbuf += chunk
        while len(self.inbuf) >= 4:
            (size,) = struct.unpack(">I", self.inbuf[:4])
            if size > MAX_FRAME:
                sys.stderr.write("stalewise-agent: frame of %d bytes refused\n" % size)
                return False
            if len(self.inbuf) < 4 + size:
                break
            body = bytes(self.inbuf[4:4 + size])
            del self.inbuf[:4 + size]
            try:
                req = json.loads(body)
            except ValueError as exc:
                sys.stderr.write("stalewise-agent: malformed request ignored: %s\n" % exc)
                continue
            self.dispatch(req)
        return True

    def dispatch(self, req: dict) -> None:
        req_id = int(req.get("id", -1))
        op = req.get("op")
        handler = getattr(self, "op_" + str(op), None)
        if handler is None:
            self.fail(req_id, "unknown op %r" % op)
            return
        try:
            handler(req_id, req)
        except (OSError, ValueError, KeyError, TypeError, tarfile.TarError) as exc:
            self.fail(req_id, "%s: %s" % (type(exc).__name__, exc), kind="os_error")
        except Exception as exc:  # a bug here must fail one request, not the whole sandbox
            self.fail(req_id, "agent error %s: %s" % (type(exc).__name__, exc), kind="agent_error")

    # ---- simple operations ---------------------------------------------------------------
    def resolve(self, path: str) -> str:
        return path if os.path.isabs(path) else os.path.join(self.workdir, path)

    def op_hello(self, req_id: int, req: dict) -> None:
        self.workdir = req.get("workdir") or self.workdir
        self.container = bool(req.get("container"))
        if req.get("ttl_s"):
            self.expires_at = time.monotonic() + float(req["ttl_s"])
        os.makedirs(self.workdir, exist_ok=True)
        seeded = self.seed()
        self.reply(req_id, pid=os.getpid(), uid=os.getuid(), gid=os.getgid(),
                   python=sys.version.split()[0], oom_counter=_oom_kills() is not None,
                   seeded=seeded)

    def seed(self) -> bool:
        """Copy the image's seed directory (if any) into the work dir: the clean snapshot."""
        if not self.container or not os.path.isdir(SEED_DIR):
            return False
        shutil.copytree(SEED_DIR, self.workdir, symlinks=True, dirs_exist_ok=True)
        return True

    def op_read_file(self, req_id: int, req: dict) -> None:
        path = self.resolve(req["path"])
        limit = int(req.get("max_bytes", MAX_FRAME // 2))
        size = os.path.getsize(path)
        if size > limit:
            self.fail(req_id, "%s is %d bytes, more than the %d-byte read limit" % (
                path, size, limit), kind="too_large")
            return
        with open(path, "rb") as f:
            self.reply(req_id, data=base64.b64encode(f.read()).decode())

    def op_write_file(self, req_id: int, req: dict) -> None:
        path = self.resolve(req["path"])
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(req["data"]))
        if req.get("mode") is not None:
            os.chmod(path, int(req["mode"]))
        self.reply(req_id)

    def op_put_tar(self, req_id: int, req: dict) -> None:
        dest = self.resolve(req["dest"])
        os.makedirs(dest, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(base64.b64decode(req["data"]))) as tar:
            members = tar.getmembers()
            for m in members:
                parts = m.name.split("/")
                if m.name.startswith("/") or ".." in parts:
                    raise ValueError("archive member %r leaves the destination" % m.name)
                if not (m.isfile() or m.isdir() or m.issym()):
                    raise ValueError("archive member %r is not a file, dir or symlink" % m.name)
            if hasattr(tarfile, "data_filter"):
                tar.extractall(dest, members=members, filter="data")
            else:
                tar.extractall(dest, members=members)
        self.reply(req_id, count=len(members))

    def op_reset(self, req_id: int, req: dict) -> None:
        """Kill every process that is not the agent or its ancestors, then empty `paths`."""
        killed = self.kill_matching(lambda pid, stat: True if self.container else
                                    self.ours(pid, stat))
        for root in req.get("paths", []):
            root = self.resolve(root)
            if not os.path.isdir(root):
                continue
            for name in os.listdir(root):
                full = os.path.join(root, name)
                if os.path.isdir(full) and not os.path.islink(full):
                    shutil.rmtree(full)
                else:
                    os.unlink(full)
        self.seed()
        self.reply(req_id, killed=killed)

    # ---- exec ----------------------------------------------------------------------------
    def op_exec(self, req_id: int, req: dict) -> None:
        argv = [str(a) for a in req["argv"]]
        env = {str(k): str(v) for k, v in (req.get("env") or {}).items()}
        self.next_marker += 1
        marker_value = "%d-%d" % (os.getpid(), self.next_marker)
        env[MARKER] = marker_value
        cwd = self.resolve(req.get("cwd") or self.workdir)
        stdin_data = base64.b64decode(req["stdin"]) if req.get("stdin") else b""
        timeout = float(req["timeout"])
        rlimits = req.get("rlimits") or {}
        oom_before = _oom_kills()
        try:
            pid, fds = self.spawn(argv, env, cwd, rlimits)
        except BlockingIOError as exc:
            self.fail(req_id, "cannot start a process (%s): the sandbox is at its process "
                      "limit" % exc, kind="exec_failed")
            return
        except OSError as exc:
            self.fail(req_id, "cannot start %r: %s" % (argv[0], exc), kind="exec_failed")
            return
        ex = Exec(req_id, pid, time.monotonic() + timeout, int(req.get("cap", 65536)),
                  ("%s=%s" % (MARKER, marker_value)).encode())
        ex.oom_before = oom_before
        stdin_w, out_r, err_r = fds
        for fd, name in ((out_r, "stdout"), (err_r, "stderr")):
            os.set_blocking(fd, False)
            ex.open_fds[fd] = name
            self.sel.register(fd, selectors.EVENT_READ, ("out", ex))
        if stdin_data:
            os.set_blocking(stdin_w, False)
            ex.stdin_fd, ex.stdin_data = stdin_w, memoryview(stdin_data)
            self.sel.register(stdin_w, selectors.EVENT_WRITE, ("in", ex))
        else:
            os.close(stdin_w)
        self.execs[pid] = ex

    def spawn(self, argv: list, env: dict, cwd: str, rlimits: dict) -> tuple[int, tuple]:
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        errpipe_r, errpipe_w = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            for fd in (in_r, in_w, out_r, out_w, err_r, err_w, errpipe_r, errpipe_w):
                os.close(fd)
            raise
        if pid == 0:  # child: only async-signal-safe-ish work, then exec
            try:
                os.setsid()
                os.dup2(in_r, 0)
                os.dup2(out_w, 1)
                os.dup2(err_w, 2)
                for sig in (signal.SIGPIPE, signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
                    signal.signal(sig, signal.SIG_DFL)
                signal.set_wakeup_fd(-1)
                try:
                    with open("/proc/self/oom_score_adj", "w") as f:
                        f.write("1000")
                except OSError:
                    pass
                for name, value in rlimits.items():
                    limit = getattr(resource, "RLIMIT_" + name)
                    resource.setrlimit(limit, (int(value), int(value)))
                os.chdir(cwd)
                os.execvpe(argv[0], argv, env)
            except BaseException as exc:  # report why exec failed, then die
                try:
                    os.write(errpipe_w, ("%s: %s" % (type(exc).__name__, exc)).encode())
                finally:
                    os._exit(127)
        for fd in (in_r, out_w, err_w, errpipe_w):
            os.close(fd)
        with os.fdopen(errpipe_r, "rb") as errpipe:
            failure = errpipe.read()
        if failure:
            os.waitpid(pid, 0)
            for fd in (in_w, out_r, err_r):
                os.close(fd)
            raise OSError(failure.decode(errors="replace"))
        return pid, (in_w, out_r, err_r)

    def on_output(self, fd: int, ex: Exec) -> None:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            ex.captures[ex.open_fds[fd]].feed(data)
            return
        self.sel.unregister(fd)
        os.close(fd)
        del ex.open_fds[fd]

    def on_stdin(self, fd: int, ex: Exec) -> None:
        try:
            ex.stdin_sent += os.write(fd, ex.stdin_data[ex.stdin_sent:ex.stdin_sent + (1 << 16)])
        except BlockingIOError:
            return
        except OSError:  # the command closed its stdin early (EPIPE): not an error
            ex.stdin_sent = len(ex.stdin_data)
        if ex.stdin_sent >= len(ex.stdin_data):
            self.close_stdin(ex)

    def close_stdin(self, ex: Exec) -> None:
        if ex.stdin_fd is not None:
            self.sel.unregister(ex.stdin_fd)
            os.close(ex.stdin_fd)
            ex.stdin_fd = None

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            ex = self.execs.get(pid)
            if ex is not None and ex.status is None:
                ex.status = status

    def belongs(self, ex: Exec, pid: int, stat: tuple[int, int, int]) -> bool:
        return pid == ex.pid or stat[1] == ex.pid or stat[2] == ex.pid or \
            _has_marker(pid, ex.marker)

    def ours(self, pid: int, stat: tuple[int, int, int]) -> bool:
        """Started by an exec of this agent: in a running exec's session, or carries our marker."""
        if stat[1] in self.execs or stat[2] in self.execs:
            return True
        try:
            with open("/proc/%d/environ" % pid, "rb") as f:
                return any(e.startswith(self.marker_prefix) for e in f.read().split(b"\0"))
        except OSError:
            return False

    def kill_matching(self, match) -> int:  # type: ignore[no-untyped-def]
        """SIGKILL matching processes and all their descendants until none is left."""
        killed = 0
        for _ in range(50):
            stats = {}
            for pid in _all_pids():
                stat = _read_stat(pid)
                if stat is not None and pid not in self.own:
                    stats[pid] = stat
            doomed = {pid for pid, stat in stats.items() if match(pid, stat)}
            grew = True
            while grew:
                extra = {pid for pid, stat in stats.items() if stat[0] in doomed} - doomed
                doomed |= extra
                grew = bool(extra)
            if not doomed:
                break
            for pid in doomed:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except OSError:
                    pass
            time.sleep(0.005)
            self.reap()
        return killed

    def kill_exec(self, ex: Exec) -> None:
        try:
            os.killpg(ex.pid, signal.SIGKILL)
        except OSError:
            pass
        self.kill_matching(lambda pid, stat: self.belongs(ex, pid, stat))

    def finish(self, ex: Exec) -> None:
        for fd in list(ex.open_fds):
            self.sel.unregister(fd)
            os.close(fd)
        ex.open_fds.clear()
        self.close_stdin(ex)
        del self.execs[ex.pid]
        status = ex.status if ex.status is not None else 0
        signum = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
        exit_code = 128 + signum if signum else os.WEXITSTATUS(status)
        oom_after = _oom_kills()
        killed = signum == signal.SIGKILL or exit_code == 128 + signal.SIGKILL
        oom = bool(not ex.timed_out and killed and ex.oom_before is not None
                   and oom_after is not None and oom_after > ex.oom_before)
        out, err = ex.captures["stdout"].result(), ex.captures["stderr"].result()
        self.reply(ex.req_id, exit_code=None if ex.timed_out else exit_code, signal=signum,
                   timed_out=ex.timed_out, oom_killed=oom,
                   duration_s=time.monotonic() - ex.started,
                   stdout=out["data"], stderr=err["data"],
                   stdout_bytes=out["bytes"], stderr_bytes=err["bytes"],
                   stdout_sha256=out["sha256"], stderr_sha256=err["sha256"],
                   truncated=out["truncated"] or err["truncated"])

    def tick(self) -> float | None:
        """Enforce deadlines, finish what is done; return seconds until the next deadline."""
        now = time.monotonic()
        wait: float | None = None
        if self.expires_at is not None:
            if now >= self.expires_at:
                raise SystemExit("stalewise-agent: time to live reached")
            wait = self.expires_at - now
        for ex in list(self.execs.values()):
            if ex.status is not None and not ex.open_fds:
                self.finish(ex)
                continue
            if now < ex.deadline:
                due = ex.deadline - now
            else:
                if not ex.timed_out:
                    ex.timed_out = True
                    self.kill_exec(ex)
                    self.reap()
                    now = time.monotonic()
                if ex.status is not None and (not ex.open_fds or now >= ex.deadline + KILL_WAIT_S):
                    self.finish(ex)  # a holder we could not attribute keeps a pipe: stop waiting
                    continue
                due = 0.01
            wait = due if wait is None else min(wait, due)
        return None if wait is None else max(wait, 0.0)

    def run(self) -> None:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        _prctl(PR_SET_DUMPABLE, 0)  # other processes of our uid cannot open our fds or ptrace us
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        os.set_blocking(0, False)
        self.sel.register(0, selectors.EVENT_READ, ("ctl", None))
        self.sel.register(wake_r, selectors.EVENT_READ, ("wake", None))
        while True:
            try:
                timeout = self.tick()
            except SystemExit:
                self.shutdown()
                raise
            for key, _mask in self.sel.select(timeout):
                kind, ex = key.data
                if kind == "ctl":
                    if not self.on_input():
                        self.shutdown()
                        return
                elif kind == "wake":
                    try:
                        while os.read(wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                elif kind == "out":
                    self.on_output(key.fd, ex)
                elif kind == "in":
                    self.on_stdin(key.fd, ex)
            self.reap()

    def shutdown(self) -> None:
        """Kill everything our execs started, running or left in the background."""
        for ex in list(self.execs.values()):
            self.kill_exec(ex)
        self.kill_matching(self.ours)


def main() -> None:
    if len(sys.argv) > 1:  # local backend: `python agent.py WORKDIR`
        os.makedirs(sys.argv[1], exist_ok=True)
        os.chdir(sys.argv[1])
    Agent().run()


if __name__ == "__main__":
    main()
