"""A second Docker engine on this machine, standing in for a remote sandbox host, for tests.

`SecondDockerd` drives scripts/second_dockerd.sh (start / kill / stop) on a short private
directory under /tmp and copies images into the engine from the first one. The root conftest's
`second_docker_host` fixture hands one out, shared by the whole session and restarted when a
test killed it; any test (sandbox pools, the Ray end-to-end job) can use it.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "second_dockerd.sh"


class SecondDockerd:
    def __init__(self, directory: str | None = None) -> None:
        self.dir = directory or tempfile.mkdtemp(prefix="swd-", dir="/tmp")
        self.url = f"unix://{self.dir}/docker.sock"

    def _script(self, action: str) -> str:
        done = subprocess.run(["bash", str(SCRIPT), action, self.dir], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"second_dockerd.sh {action} failed: {done.stderr.strip()}")
        return done.stdout.strip()

    def start(self) -> str:
        """Start it (or find it running); its URL."""
        url = self._script("start")
        assert url == self.url, url
        return url

    def kill(self) -> None:
        """Lose the host: dockerd, containerd, shims and container processes SIGKILLed."""
        self._script("kill")

    def stop(self) -> None:
        """Stop it and delete its directory (images included)."""
        self._script("stop")

    def client(self):
        import docker

        return docker.DockerClient(base_url=self.url, timeout=120)

    def import_images(self, *images: str) -> None:
        """Copy `images` from the first engine (save | load), skipping ones already present."""
        from sandboxes.engine import connect
        from sandboxes.hosts import copy_image
        from sandboxes.image import image_exists

        source, target = connect(), self.client()
        try:
            for image in images:
                if image_exists(target, image) is None:
                    copy_image(source, target, image)
        finally:
            source.close()
            target.close()
