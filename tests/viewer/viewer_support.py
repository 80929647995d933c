"""Helpers of the viewer tests: `stalewise view` as a real child process, Chromium's flags and
screenshots (under var/test-artifacts/, for a person to look at)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx


ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "var" / "test-artifacts"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--window-size=1400,1000")


class Viewer:
    """A running `stalewise view` child; `url(path)` is a page's address."""

    def __init__(self, db_url: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stalewise", "view", "--url", db_url, "--port", "0"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.port = self._bound_port()  # --port 0: the port it says it bound
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url("/static/viewer.css"), timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        output = self.stop()
        raise AssertionError(f"stalewise view did not start: {output}")

    def _bound_port(self) -> int:
        """The port of the viewer's first line, `stalewise view: http://127.0.0.1:PORT/ ...`,
        printed once its socket listens (lines before it, such as warnings, are passed over)."""
        said = []
        for line in self.proc.stdout:
            said.append(line)
            found = re.match(r"stalewise view: http://127\.0\.0\.1:(\d+)/", line)
            if found:
                return int(found.group(1))
        raise AssertionError(f"stalewise view did not say where it listens: {''.join(said)}"
                             f"{self.stop()}")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.stdout.read() if self.proc.stdout else ""


def screenshot(browser, name: str) -> Path:
    path = ARTIFACTS / f"{name}.png"
    browser.save_screenshot(str(path))
    return path
