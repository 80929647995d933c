"""`codefix`: a small Python repo with one planted bug; hidden tests decide the reward.

The sandbox holds `<module>.py` (one documented function with a bug) and a README. Tools:
`bash` and `write_file`. The hidden tests (generated per instance from the fixed function) and
their runner are written into `_hidden/` only at verification; the reward is the fraction of
hidden tests that pass (the breakdown also reports the counts as zero-weight metrics). Each
instance's hidden tests include at least one case the bug fails and one it passes, so partial
fixes score between 0 and 1. Difficulty buckets come from the bug catalogue (`easy`, `medium`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tasks.api import SplitShares, TaskFamily, TaskInstance, draw_in_split
from tasks.builtin_tools import bash, write_file
from tasks.demos import Demonstration, DemoTurn
from tasks.suites.codefix_bugs import BUGS, Bug, run
from tasks.suites.common import call_text, instance_rng, sandbox_spec, task_limits
from tasks.verify import Reward, VerifyContext

NAME = "codefix"
MODULES = ("calc", "util", "helpers", "core")
HIDDEN_DIR = "_hidden"
LIMIT_DEFAULTS: dict[str, Any] = dict(
    max_turns=8, max_generated_tokens=2048, context_length=4096, wall_time_s=300.0,
    max_malformed_calls=2, max_observation_chars=4096, tool_timeout_s=30.0,
    verify_timeout_s=60.0)
SANDBOX_DEFAULTS: dict[str, Any] = dict(memory_mb=256, exec_timeout_s=30.0, pids=64)

RUNNER = '''import importlib.util, json, os, sys
total = int(sys.argv[2])
sys.path.insert(0, os.getcwd())
try:
    spec = importlib.util.spec_from_file_location("hidden_tests", sys.argv[1])
    tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tests)
except BaseException as err:
    print(json.dumps({"passed": 0, "total": total, "error": repr(err)[:300]}))
    sys.exit(0)
passed = 0
for name in sorted(n for n in dir(tests) if n.startswith("test_")):
    try:
        getattr(tests, name)()
        passed += 1
    except BaseException:
        pass
print(json.dumps({"passed": passed, "total": total}))
'''


def hidden_tests(bug: Bug, module: str, cases: list[tuple[tuple[Any, ...], Any]]) -> str:
    lines = [f"from {module} import {bug.name}", "",
             "def _same(got, want):",
             "    if isinstance(want, float):",
             "        return isinstance(got, (int, float)) and abs(got - want) < 1e-9",
             "    return got == want", ""]
    for number, (args, expected) in enumerate(cases):
        call = f"{bug.name}({', '.join(repr(a) for a in args)})"
        lines += [f"def test_{number:02d}():", f"    assert _same({call}, {expected!r})", ""]
    return "\n".join(lines)


def choose_cases(bug: Bug, rng: Any, count: int) -> list[tuple[tuple[Any, ...], Any]]:
    """`count` cases with at least one the bug fails and one it passes."""
    failing, passing = [], []
    for _ in range(500):
        args = bug.inputs(rng)
        want, got = run(bug.source(True), bug.name, args), run(bug.source(False), bug.name, args)
        (passing if got == want else failing).append((args, want))
        if len(failing) >= count // 2 and len(passing) >= count - count // 2:
            break
    if not failing or not passing:
        raise RuntimeError(f"codefix bug {bug.name}: cannot find both failing and passing cases")
    n_pass = min(len(passing), count - min(len(failing), max(1, count // 2)))
    n_fail = min(len(failing), count - n_pass)
    return failing[:n_fail] + passing[:n_pass]


class HiddenTestsVerifier:
    """Runs the hidden tests in the sandbox; reward = fraction passing."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s

    def describe(self) -> str:
        return "codefix.hidden_tests(fraction passing)"

    async def __call__(self, ctx: VerifyContext) -> Reward:
        total = int(ctx.task.data["tests"])
        result = await ctx.sandbox.exec(
            ["python3", "-I", f"{HIDDEN_DIR}/run_tests.py", f"{HIDDEN_DIR}/test_hidden.py",
             str(total)], timeout=self.timeout_s)
        passed = 0
        lines = result.stdout.strip().splitlines()
        if result.ok and lines:
            try:
                passed = int(json.loads(lines[-1])["passed"])
            except (ValueError, KeyError, TypeError):
                passed = 0
        fraction = passed / total
        return Reward(fraction, {"tests_passed": fraction, "passed": float(passed),
                                 "total": float(total)})


def family(*, seed: int = 0, tests: int = 6, validation_share: float = 0.15,
           test_share: float = 0.25, image: str = "stalewise-base:latest",
           limits: Mapping[str, Any] | None = None,
           sandbox_limits: Mapping[str, Any] | None = None) -> TaskFamily:
    """The codefix family; `tests` hidden tests per instance (at least 2). The splits are
    disjoint by (function, module): `validation_share` of the pairs are validation-only,
    `test_share` test-only."""
    if tests < 2:
        raise ValueError(f"codefix needs tests >= 2 (one failing, one passing), got {tests}")
    shares = SplitShares(validation_share, test_share)
    task_limits_ = task_limits(LIMIT_DEFAULTS, limits)
    verifier = HiddenTestsVerifier()

    def make(index: int, split: str) -> TaskInstance:
        rng = instance_rng(NAME, seed, split, index)
        bug, module = draw_in_split(NAME, split, shares, rng,
                                    lambda r: (r.choice(BUGS), r.choice(MODULES)),
                                    key=lambda c: f"{c[0].name}@{c[1]}")
        buggy = f'"""Small helpers."""\n\n\n{bug.source(False)}'
        fixed = f'"""Small helpers."""\n\n\n{bug.source(True)}'
        cases = choose_cases(bug, rng, tests)
        files = {f"{module}.py": buggy,
                 "README.md": f"# {module}\n\nHelpers; see the docstrings in {module}.py.\n"}
        hidden = {f"{HIDDEN_DIR}/test_hidden.py": hidden_tests(bug, module, cases),
                  f"{HIDDEN_DIR}/run_tests.py": RUNNER}
        return TaskInstance(
            prompt=f"{module}.py: {bug.name}() has a bug. Fix the file; hidden tests check it.",
            tools=(bash, write_file), verifier=verifier,
            sandbox=sandbox_spec(image, SANDBOX_DEFAULTS, sandbox_limits, files),
            limits=task_limits_, hidden_files=hidden,
            data={"module": module, "function": bug.name, "fixed": fixed, "buggy": buggy,
                  "tests": len(cases)},
            difficulty=bug.difficulty)

    def demonstrate(task: TaskInstance, correct: bool) -> Demonstration:
        path = f"{task.data['module']}.py"
        content = task.data["fixed"] if correct else task.data["buggy"]
        return Demonstration(task, (
            DemoTurn(call_text("bash", {"command": f"cat {path}"}),
                     (task.data["buggy"].rstrip("\n"),)),
            DemoTurn(call_text("write_file", {"path": path, "content": content}),
                     (f"wrote {len(content.encode())} bytes to {path}",)),
            DemoTurn("Fixed."),
        ), correct=correct)

    return TaskFamily(NAME, make, demonstrate=demonstrate,
                      description="fix a planted bug in a small Python module",
                      options=dict(seed=seed, tests=tests, validation_share=validation_share, test_share=test_share, image=image),
                      split_key=lambda task: f"{task.data['function']}@{task.data['module']}",
                      shares=shares)
