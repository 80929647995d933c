"""`stalewise sandbox ...` commands (heavy imports happen inside commands)."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True)


def _fail(message: str) -> "typer.Exit":
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=1)


@app.command("build-base")
def build_base_command(
    force: bool = typer.Option(False, "--force", help="rebuild even when the image exists"),
    tag: str = typer.Option("stalewise-base:latest", help="image tag to build"),
    suite: str = typer.Option("", help="Debian suite (default: this host's codename)"),
    mirror: str = typer.Option("http://deb.debian.org/debian", help="Debian mirror URL"),
) -> None:
    """Build the sandbox base image from Debian (debootstrap + docker import); cached."""
    from core.sandbox import SandboxError
    from sandboxes.image import build_base

    try:
        result = build_base(tag=tag, force=force, suite=suite or None, mirror=mirror,
                            log=lambda line: typer.echo(line, err=True))
    except SandboxError as exc:
        raise _fail(str(exc)) from None
    state = "built" if result.built else "already present"
    typer.echo(f"{result.image} {state} ({result.image_id[:19]})")


def _memory_mb(text: str) -> int:
    """'512' and '512m' are MiB, '2g' is GiB."""
    value = text.strip().lower()
    scale = 1
    if value.endswith("g"):
        value, scale = value[:-1], 1024
    elif value.endswith("m"):
        value = value[:-1]
    try:
        return int(float(value) * scale)
    except ValueError:
        raise typer.BadParameter(f"--memory {text!r}: give MiB (512, 512m) or GiB (2g)") from None


@app.command("run", context_settings={"allow_interspersed_args": False})
def run_command(
    cmd: list[str] = typer.Argument(..., help="the command and its arguments, after --"),
    image: str = typer.Option("stalewise-base:latest", help="image to run"),
    timeout: float = typer.Option(60.0, help="seconds before the command is killed"),
    memory: str | None = typer.Option(None, help="memory limit, MiB or with m/g suffix "
                                      "(default 512m)"),
    cpus: float | None = typer.Option(None, help="CPU quota in cores (default 1)"),
    pids: int | None = typer.Option(None, help="process limit (default 128)"),
    network: bool = typer.Option(False, "--network", help="allow network access"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    backend: str = typer.Option("docker", help="docker, local (NOT isolation) or auto"),
) -> None:
    """Run one command in a fresh sandbox with the default hardening and print the result.

    Exit status: the command's own, 124 when it timed out, 125 when the sandbox failed.
    """
    import dataclasses
    import json

    import anyio
    from pydantic import ValidationError

    from core.sandbox import SandboxError, SandboxLimits, SandboxSpec
    from sandboxes.backends import make_sandbox

    if backend not in ("docker", "local", "auto"):
        raise typer.BadParameter(f"--backend {backend!r}: choose docker, local or auto")
    overrides: dict[str, object] = {"exec_timeout_s": timeout, "network": network,
                                    "ttl_s": max(3600.0, timeout + 60.0)}
    if memory is not None:
        overrides["memory_mb"] = _memory_mb(memory)
    if cpus is not None:
        overrides["cpus"] = cpus
    if pids is not None:
        overrides["pids"] = pids
    try:
        spec = SandboxSpec(image=image, limits=SandboxLimits(**overrides))  # type: ignore[arg-type]
    except ValidationError as exc:  # one line, in the flags' names
        flags = {"exec_timeout_s": "--timeout", "memory_mb": "--memory", "cpus": "--cpus",
                 "pids": "--pids"}
        raise _fail("; ".join(
            f"{flags.get(str(err['loc'][0]), err['loc'][0])} {err.get('input')!r}: "
            f"{err['msg'][0].lower()}{err['msg'][1:]}" for err in exc.errors())) from None

    async def go() -> object:
        async with make_sandbox(spec, backend=backend, run_id="cli-run") as sandbox:  # type: ignore[arg-type,attr-defined]
            return await sandbox.exec(list(cmd), timeout=timeout)

    try:
        result = anyio.run(go)
    except SandboxError as exc:
        raise _fail(str(exc)) from None
    fields = dataclasses.asdict(result)  # type: ignore[call-overload]
    if as_json:
        typer.echo(json.dumps(fields))
    else:
        typer.echo(result.stdout, nl=False)  # type: ignore[attr-defined]
        typer.echo(result.stderr, nl=False, err=True)  # type: ignore[attr-defined]
        notes = [k for k in ("timed_out", "oom_killed", "truncated") if fields[k]]
        if notes or fields["error_type"]:
            typer.echo(f"[sandbox: {', '.join(notes) or fields['error_type']}; "
                       f"{fields['error_message']}]", err=True)
    if fields["timed_out"]:
        raise typer.Exit(124)
    if fields["exit_code"] is None:
        raise typer.Exit(125)
    raise typer.Exit(int(fields["exit_code"]))


@app.command("cleanup")
def cleanup_command(
    run: str = typer.Option("", "--run", help="remove every container of this run"),
    remove_all: bool = typer.Option(False, "--all", help="remove every stalewise container of "
                                    "this installation, in use or not"),
) -> None:
    """Remove orphaned sandbox containers (owner gone or TTL passed); or a run's; or all."""
    from core.sandbox import SandboxError
    from sandboxes.cleanup import remove_all as remove_all_fn
    from sandboxes.cleanup import remove_orphans

    if run and remove_all:
        raise typer.BadParameter("give --run R or --all, not both")
    try:
        if remove_all or run:
            removed = remove_all_fn(run_id=run or None)
        else:
            removed = remove_orphans()
    except SandboxError as exc:
        raise _fail(str(exc)) from None
    for r in removed:
        status = f"FAILED: {r.error}" if r.error else "removed"
        typer.echo(f"{status} {r.name} ({r.container_id[:12]}, run {r.run_id}): {r.reason}")
    typer.echo(f"{sum(not r.error for r in removed)} container(s) removed")
    if any(r.error for r in removed):
        raise typer.Exit(1)


@app.command("doctor")
def doctor_command(
    image: str = typer.Option("stalewise-base:latest", help="image to check"),
) -> None:
    """Check the engine, the image, the runtimes, and that every limit is enforced."""
    import anyio

    from core.sandbox import SandboxSpec
    from sandboxes.doctor import run_doctor

    checks = anyio.run(run_doctor, SandboxSpec(image=image))
    for check in checks:
        typer.echo(f"{check.status.upper():4} {check.name}: {check.detail}")
    if any(check.status == "fail" for check in checks):
        raise typer.Exit(1)
