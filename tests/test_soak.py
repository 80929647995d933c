"""The fault-injection soak (bench/soak.py) as part of the suite: a real job survives three
faults of the kinds that go deepest (the orchestrator SIGKILLed and resumed, its Docker engine
killed and restarted, the store's disk full) with every invariant held.

The soak prints one last line, `faults N survived, invariants K/K held`, and exits 0 only
then; this test holds it to that, and to having checked at least the ten invariants it lists.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.docker, pytest.mark.slow]
SOAK = Path(__file__).resolve().parents[1] / "bench" / "soak.py"


def test_a_job_survives_three_faults_with_every_invariant_held():
    done = subprocess.run([sys.executable, str(SOAK), "--faults", "3", "--seed", "27",
                           "--kinds", "orchestrator,dockerd,disk_full"],
                          capture_output=True, text=True, timeout=1500)
    output = done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    match = re.fullmatch(r"faults (\d+) survived, invariants (\d+)/(\d+) held", last)
    assert done.returncode == 0 and match, output[-6000:]
    faults, held, checked = map(int, match.groups())
    assert faults == 3 and held == checked >= 10, output[-6000:]
    for kind in ("orchestrator", "dockerd", "disk_full"):
        assert re.search(rf"step +\d+ +{kind} ", output), f"no {kind} fault was injected"
