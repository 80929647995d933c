"""The vLLM launcher's process handling, with a stand-in for vLLM's interpreter (a shell script
that serves `/health` and leaves a helper behind, as vLLM's engine core does): `start_vllm`
returns once `/health` answers, with the stalewise settings in the child's environment; the
server leads its own process group, and stopping it ends the helper too. vLLM itself is tested
in tests/engine/test_vllm_backend.py (marked `vllm`)."""

from __future__ import annotations

import sys

import httpx
import pytest

from core.children import LaunchError, group_members
from orchestrator.engines.launch import start_vllm

HANG_GUARD_S = 120.0

FAKE_VLLM = """#!/bin/sh
while [ $# -gt 0 ]; do
  case "$1" in --port) port=$2; shift;; --model) model=$2; shift;; esac
  shift
done
echo "dev mode $VLLM_SERVER_DEV_MODE, initial version $STALEWISE_INITIAL_VERSION"
[ -d "$model" ] || { echo "no model at $model"; exit 2; }
sleep 600 &
exec PYTHON -m http.server "$port" --bind 127.0.0.1 --directory "$model"
"""


@pytest.fixture
def fake_vllm(tmp_path):
    script = tmp_path / "python"
    script.write_text(FAKE_VLLM.replace("PYTHON", sys.executable))
    script.chmod(0o755)
    return script


def test_vllm_answers_then_stops_with_the_helpers_it_started(tmp_path, fake_vllm):
    model = tmp_path / "model"
    model.mkdir()
    (model / "health").write_text("ok")
    log = tmp_path / "vllm.log"
    server = start_vllm(model, python=fake_vllm, log_path=log, initial_version=3,
                        startup_timeout=HANG_GUARD_S)
    try:
        assert httpx.get(f"{server.url}/health", timeout=30).text == "ok"
        assert "dev mode 1, initial version 3" in server.log_tail()
        assert len(group_members(server.pid)) == 2  # the server and its helper
    finally:
        server.stop(5.0)
    assert group_members(server.pid) == []


def test_vllm_that_exits_before_answering_is_reported_with_its_log(tmp_path, fake_vllm):
    with pytest.raises(LaunchError, match=r"vLLM exited with code 2 before answering /health; "
                                          r"log tail:\n(.|\n)*no model at"):
        start_vllm(tmp_path / "missing", python=fake_vllm, startup_timeout=HANG_GUARD_S)
