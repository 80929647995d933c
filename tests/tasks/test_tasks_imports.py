"""Import boundaries: `tasks` uses only shared types; the agent loop never imports torch."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import tasks, tasks.cli, tasks.check, tasks.testing, tasks.chat, tasks.builtin_tools
import tasks.suites.arith, tasks.suites.codefix, tasks.suites.longhaul
ours = sorted({m.split('.')[0] for m in sys.modules} & {'orchestrator', 'engine', 'learner',
                                                       'lab', 'stalewise'})
print('tasks imports', ours)
import orchestrator.rollout, orchestrator.engines.scripted
heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'docker'})
print('loop imports', heavy)
"""


def test_tasks_depend_only_on_shared_types_and_the_loop_is_light():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0] == "tasks imports []", out[0]
    assert out[1] == "loop imports []", out[1]
