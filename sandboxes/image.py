"""Building the sandbox base image without a registry: Debian debootstrap, then `docker import`.

Guarantees:
- `build_base()` is idempotent: when the tag exists it returns at once (`built=False`) unless
  `force=True`; concurrent callers on one machine serialise on a lock file, so a second caller
  waits for the first build and then finds the image cached.
- The image has a non-root user `sandbox` (uid/gid 1000, home /work), python3, bash, coreutils
  and procps; it runs as that user by default with /work as the working directory.
- Every failure raises `SandboxError` saying which step failed and what to do.

Task images are built `FROM stalewise-base:latest` with an ordinary Dockerfile (`build_image`).
`ensure_image` builds a spec's image from its `ImageBuild` (a Dockerfile folder) when the
engine lacks it: `FROM` images are substituted by `base_image_map` and must be present locally
(no registry is assumed; a missing one is a one-line `SandboxError` naming the image and the
setting that maps it); builds of one tag in this process are serialised.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from core.sandbox import ImageBuild, SandboxError
from sandboxes.agent import SEED_DIR
from sandboxes.engine import connect

if TYPE_CHECKING:
    import docker

BASE_IMAGE = "stalewise-base:latest"
SANDBOX_UID = 1000
SANDBOX_GID = 1000
SANDBOX_USER = "sandbox"
BASE_PACKAGES = ("python3", "procps", "patch")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
LOCK_PATH = Path(tempfile.gettempdir()) / "stalewise-build-base.lock"
IMAGE_CHANGES = (
    f"USER {SANDBOX_UID}:{SANDBOX_GID}",
    "WORKDIR /work",
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV HOME=/work",
    "ENV LANG=C.UTF-8",
    'CMD ["/bin/bash"]',
)


@dataclass(frozen=True)
class BuildResult:
    image: str
    built: bool  # False when the cached image was returned
    image_id: str


def image_exists(client: "docker.DockerClient", tag: str) -> str | None:
    """The image id of `tag`, or None when the engine does not have it."""
    import docker.errors

    try:
        return str(client.images.get(tag).id)
    except docker.errors.ImageNotFound:
        return None


def host_suite() -> str:
    """The Debian codename of this host (the suite we bootstrap by default), else bookworm."""
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("VERSION_CODENAME=") and line.split("=", 1)[1].strip():
                return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return "bookworm"


def build_base(
    *,
    tag: str = BASE_IMAGE,
    force: bool = False,
    suite: str | None = None,
    mirror: str = DEFAULT_MIRROR,
    packages: tuple[str, ...] = BASE_PACKAGES,
    log: Callable[[str], None] = print,
    client: "docker.DockerClient | None" = None,
) -> BuildResult:
    """Build `tag` from Debian with debootstrap + docker import; cached unless `force`."""
    client = client or connect()
    existing = image_exists(client, tag)
    if existing and not force:
        return BuildResult(tag, False, existing)
    LOCK_PATH.touch(exist_ok=True)
    with open(LOCK_PATH, "r+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        existing = image_exists(client, tag)
        if existing and not force:  # built by a concurrent caller while we waited
            return BuildResult(tag, False, existing)
        _require_root()
        _ensure_debootstrap(log)
        with tempfile.TemporaryDirectory(prefix="stalewise-rootfs-", dir="/var/tmp") as tmp:
            rootfs = Path(tmp) / "rootfs"
            _debootstrap(rootfs, suite or host_suite(), mirror, packages, log)
            _prepare_rootfs(rootfs)
            log(f"importing {rootfs} as {tag}")
            image_id = _import(client, rootfs, tag)
    log(f"built {tag} ({image_id[:19]})")
    return BuildResult(tag, True, image_id)


def _require_root() -> None:
    if os.geteuid() != 0:
        raise SandboxError("building the base image needs root (debootstrap creates device "
                           "nodes and chowns files): run `sudo stalewise sandbox build-base`")


def _ensure_debootstrap(log: Callable[[str], None]) -> None:
    if shutil.which("debootstrap"):
        return
    if not shutil.which("apt-get"):
        raise SandboxError("debootstrap is missing and there is no apt-get to install it: "
                           "install debootstrap by hand")
    log("installing debootstrap with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "debootstrap"]):
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SandboxError(f"`{' '.join(argv)}` failed ({done.returncode}): "
                               f"{done.stderr.strip()[-2000:]}")


def _debootstrap(rootfs: Path, suite: str, mirror: str, packages: tuple[str, ...],
                 log: Callable[[str], None]) -> None:
    argv = ["debootstrap", "--variant=minbase", f"--include={','.join(packages)}",
            suite, str(rootfs), mirror]
    log(f"running {' '.join(argv)} (a few minutes)")
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip()[-3000:]
        raise SandboxError(f"debootstrap failed ({done.returncode}); is {mirror} reachable and "
                           f"is '{suite}' a Debian suite? Output tail:\n{tail}")


def _prepare_rootfs(rootfs: Path) -> None:
    """Add the sandbox user and the /work mount point; drop caches the image does not need."""
    etc = rootfs / "etc"
    with open(etc / "passwd", "a") as f:
        f.write(f"{SANDBOX_USER}:x:{SANDBOX_UID}:{SANDBOX_GID}:stalewise sandbox:/work:/bin/bash\n")
    with open(etc / "group", "a") as f:
        f.write(f"{SANDBOX_USER}:x:{SANDBOX_GID}:\n")
    with open(etc / "shadow", "a") as f:
        f.write(f"{SANDBOX_USER}:!:19000:0:99999:7:::\n")
    (rootfs / "work").mkdir(mode=0o755, exist_ok=True)
    os.chown(rootfs / "work", SANDBOX_UID, SANDBOX_GID)
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man"):
        path = rootfs / junk
        if path.is_dir():
            for child in path.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()


def _tar_chunks(rootfs: Path) -> Iterator[bytes]:
    proc = subprocess.Popen(["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    with proc:
        while chunk := proc.stdout.read(1 << 20):
            yield chunk
        err = proc.stderr.read().decode(errors="replace")
    if proc.returncode != 0:
        raise SandboxError(f"tar of the root filesystem failed ({proc.returncode}): {err[-2000:]}")


def _import(client: "docker.DockerClient", rootfs: Path, tag: str) -> str:
    import docker.errors

    repository, _, version = tag.rpartition(":") if ":" in tag.split("/")[-1] else (tag, "", "")
    try:
        client.api.import_image_from_stream(_tar_chunks(rootfs), repository=repository,
                                            tag=version or "latest", changes=list(IMAGE_CHANGES))
    except docker.errors.APIError as exc:
        raise SandboxError(f"docker import of {tag} failed: {exc}") from exc
    image_id = image_exists(client, tag)
    if image_id is None:
        raise SandboxError(f"docker import reported success but {tag} is not in the engine")
    return image_id


def build_image(context_dir: str | Path, tag: str, *,
                client: "docker.DockerClient | None" = None) -> str:
    """Build a task image from a Dockerfile in `context_dir` (typically `FROM stalewise-base`)."""
    import docker.errors

    client = client or connect()
    if image_exists(client, BASE_IMAGE) is None:
        build_base(client=client)
    try:
        image, _logs = client.images.build(path=str(context_dir), tag=tag, rm=True, forcerm=True)
    except docker.errors.BuildError as exc:
        lines = [str(x.get("stream") or x.get("error") or "") for x in exc.build_log]
        raise SandboxError(f"building {tag} from {context_dir} failed: {exc.msg}\n"
                           + "".join(lines)[-3000:]) from exc
    except docker.errors.APIError as exc:
        raise SandboxError(f"building {tag} from {context_dir} failed: {exc}") from exc
    return str(image.id)


_FROM = re.compile(r"^(\s*FROM\s+)((?:--\S+\s+)*)(\S+)(.*)$", re.IGNORECASE)
_BUILD_LOCKS: dict[str, threading.Lock] = {}
_BUILD_LOCKS_GUARD = threading.Lock()


def from_images(dockerfile: str) -> list[str]:
    """The images a Dockerfile builds `FROM`, in order (stage names and `scratch` left out)."""
    images, stages = [], set()
    for line in dockerfile.splitlines():
        match = _FROM.match(line)
        if match is None:
            continue
        image, rest = match.group(3), match.group(4).split()
        if image.lower() != "scratch" and image not in stages:
            images.append(image)
        if len(rest) >= 2 and rest[0].lower() == "as":
            stages.add(rest[1])
    return images


def map_from_images(dockerfile: str, base_image_map: "dict[str, str] | None") -> str:
    """The Dockerfile with every `FROM` image found in `base_image_map` replaced."""
    mapping = dict(base_image_map or {})
    if not mapping:
        return dockerfile

    def replace(line: str) -> str:
        match = _FROM.match(line)
        if match is None or match.group(3) not in mapping:
            return line
        return match.group(1) + match.group(2) + mapping[match.group(3)] + match.group(4)
    return "\n".join(replace(line) for line in dockerfile.splitlines()) + "\n"


def _missing_base(dockerfile: Path, base: str, named: str, build: ImageBuild) -> str:
    if base.split(":")[0] == BASE_IMAGE.split(":")[0]:
        return (f"{dockerfile}: FROM image {base!r} is not built yet; run "
                "`stalewise sandbox build-base` (scripts/sandbox_setup.sh does it)")
    via = f" (mapped from {named!r})" if named != base else ""
    return (f"{dockerfile}: FROM image {base!r}{via} is not in the local Docker engine and no "
            f"registry is assumed; map it to a local image with {build.map_setting} = "
            f"{{ \"{named}\" = \"stalewise-base\" }} (or `docker load` it)")


def _seed_step(seed_from: str) -> str:
    return (f"\nUSER root\nRUN mkdir -p {SEED_DIR} && if [ -d '{seed_from}' ]; then "
            f"cp -a '{seed_from}'/. {SEED_DIR}/; fi && chmod -R a+rX {SEED_DIR}\n")


def ensure_image(image: str, build: ImageBuild, *,
                 client: "docker.DockerClient | None" = None) -> bool:
    """Build `image` from `build` unless the engine has it; True when it was built now."""
    client = client or connect()
    if image_exists(client, image) is not None:
        return False
    with _BUILD_LOCKS_GUARD:
        lock = _BUILD_LOCKS.setdefault(image, threading.Lock())
    with lock:
        if image_exists(client, image) is not None:
            return False
        _build_from_folder(client, image, build)
    return True


def _build_from_folder(client: "docker.DockerClient", image: str, build: ImageBuild) -> None:
    import docker.errors

    context = Path(build.context)
    dockerfile = context / "Dockerfile"
    if not dockerfile.is_file():
        raise SandboxError(f"{context}: no Dockerfile to build {image} from")
    original = dockerfile.read_text()
    text = map_from_images(original, dict(build.base_image_map))
    mapped_from = {build.base_image_map.get(image, image): image for image in from_images(original)}
    for base in from_images(text):
        if image_exists(client, base) is None:
            raise SandboxError(_missing_base(dockerfile, base, mapped_from.get(base, base), build))
    if build.seed_from:
        text += _seed_step(build.seed_from)
    with tempfile.TemporaryDirectory(prefix="stalewise-build-") as tmp:
        shutil.copytree(context, tmp, dirs_exist_ok=True)
        (Path(tmp) / "Dockerfile").write_text(text)
        try:
            client.images.build(path=tmp, tag=image, rm=True, forcerm=True, pull=False,
                                timeout=int(build.timeout_s))
        except docker.errors.BuildError as exc:
            raise SandboxError(f"building {image} from {dockerfile} failed"
                               f"{_failed_step(exc.build_log, exc.msg)}; fix the Dockerfile "
                               f"(`docker build {context}` shows the whole log)") from exc
        except docker.errors.APIError as exc:
            raise SandboxError(f"building {image} from {context} failed: {exc}") from exc


_BUILDER_NOISE = ("--->", "Removing intermediate container", "Running in")


def _failed_step(build_log: Any, message: str) -> str:
    """The error of a failed build and the last line the failing step printed, on one line."""
    text = "".join(str(x.get("stream") or "") for x in build_log if isinstance(x, dict))
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines()]
    lines = [line for line in lines if line and not line.startswith(_BUILDER_NOISE)]
    said = lines[-1] if lines and not re.match(r"Step \d+/\d+ :", lines[-1]) else ""
    return f": {message.strip()[:300]}" + (f"; its last output: {said[:300]!r}" if said else "")
