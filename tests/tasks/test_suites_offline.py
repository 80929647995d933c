"""Built-in suites without a sandbox: instances are well formed and their checks are sound."""

from __future__ import annotations

import math
import random
import statistics
import sys
import types

import pytest

from tasks.suites import arith, codefix, longhaul, story, vault
from tasks.suites.codefix_bugs import BUGS, run


def test_arith_values_and_buckets():
    family = arith.family(max_ops=4, max_value=9)
    tasks = list(family.instances(count=200))
    assert {t.difficulty for t in tasks} == {"ops=1", "ops=2", "ops=3", "ops=4"}
    for task in tasks:
        text = task.data["expression"]
        assert task.data["value"] == eval(text)
        assert sum(text.count(op) for op in "+-*") == int(task.difficulty[4:])
        assert len(task.prompt[0].content) <= 40, "arith prompts must stay short for tiny models"
    assert arith.evaluate("2-(3-4)") == 3
    with pytest.raises(ValueError):
        arith.evaluate("__import__('os')")


def test_arith_instances_differ_by_split_and_seed():
    a = arith.family().instance(0, "train").data["expression"]
    texts = {arith.family(seed=s).instance(i, sp).data["expression"]
             for s in (0, 1) for i in range(5) for sp in ("train", "test")}
    assert len(texts) > 10 and a in texts


def hidden_results(task, which: str) -> list[bool]:
    """Run the hidden tests in this process against the fixed or the buggy module."""
    module = types.ModuleType(task.data["module"])
    exec(compile(task.data[which], module.__name__, "exec"), module.__dict__)  # noqa: S102
    sys.modules[module.__name__] = module
    try:
        namespace: dict = {}
        exec(compile(task.hidden_files["_hidden/test_hidden.py"], "hidden", "exec"),  # noqa: S102
             namespace)
        results = []
        for name in sorted(n for n in namespace if n.startswith("test_")):
            try:
                namespace[name]()
                results.append(True)
            except AssertionError:
                results.append(False)
        return results
    finally:
        del sys.modules[module.__name__]


def test_codefix_hidden_tests_separate_the_fix_from_the_bug():
    seen = set()
    for task in codefix.family(tests=6).instances(count=40):
        seen.add(task.data["function"])
        assert set(task.hidden_files).isdisjoint(task.sandbox.files)
        fixed, buggy = hidden_results(task, "fixed"), hidden_results(task, "buggy")
        assert len(fixed) == len(buggy) == task.data["tests"] == 6
        assert all(fixed), task.key
        assert any(buggy) and not all(buggy), (task.key, buggy)
    assert len(seen) >= 6


def test_every_bug_is_a_real_bug():
    for bug in BUGS:
        rng = random.Random(0)
        outcomes = set()
        for _ in range(300):
            args = bug.inputs(rng)
            outcomes.add(run(bug.source(True), bug.name, args) == run(bug.source(False),
                                                                         bug.name, args))
        assert outcomes == {True, False}, bug.name


def test_longhaul_chains_buckets_and_heavy_tailed_latency():
    family = longhaul.family(min_k=1, max_k=30)
    tasks = list(family.instances(count=300))
    ks = [t.data["k"] for t in tasks]
    assert min(ks) == 1 and max(ks) >= 25
    for task in tasks:
        keys = task.data["chain"]
        assert len(keys) == task.data["k"] + 1 == len(set(keys))
        assert task.difficulty == longhaul.bucket_of(task.data["k"],
                                                     longhaul.buckets((1, 3, 8, 16), 30))
    assert {t.difficulty for t in tasks} == {"k=1-2", "k=3-7", "k=8-15", "k=16-30"}
    delays = sorted(longhaul.step_latency(f"t{i}", j, 0.5, 1.0, 60.0)
                    for i in range(200) for j in range(5))
    assert delays[len(delays) // 100] < 0.1 and delays[-len(delays) // 100] > 4.0
    assert statistics.median(delays) == pytest.approx(0.5, rel=0.15)
    assert max(delays) <= 60.0
    durations = [sum(longhaul.step_latency(t.key, j, 0.5, 1.0, 60.0) for j in range(t.data["k"]))
                 for t in tasks]
    assert math.log10(max(durations) / min(durations)) >= 2, "should span orders of magnitude"


def test_longhaul_rejects_bad_options():
    with pytest.raises(ValueError, match="min_k"):
        longhaul.family(min_k=5, max_k=2)
    with pytest.raises(ValueError, match="latency_in"):
        longhaul.family(latency_in="gpu")  # type: ignore[arg-type]


def test_longhaul_step_latency_is_a_stable_standard_lognormal():
    draws = [longhaul.stable_normal(f"t{i}:{j}") for i in range(1000) for j in range(4)]
    assert draws == [longhaul.stable_normal(f"t{i}:{j}") for i in range(1000) for j in range(4)]
    assert abs(statistics.fmean(draws)) < 0.05 and abs(statistics.stdev(draws) - 1.0) < 0.05
    assert sum(abs(z) > 1.96 for z in draws) / len(draws) == pytest.approx(0.05, abs=0.015)
    assert longhaul.step_latency("t1", 0, 0.5, 0.0, 60.0) == 0.5  # sigma 0: the median


def test_arith_and_vault_name_the_failure_mode_of_an_unsolved_transcript():
    from tasks.messages import ChatMessage

    def talk(*turns):
        return [ChatMessage(role, text) for role, text in turns]

    family = arith.family(max_ops=1)
    task = family.instance(0, "test")
    value = str(task.data["value"])
    call = ("assistant", "<tool_call>...</tool_call>")
    answered = ("assistant", f"<answer>{value}</answer>")
    assert family.failure_mode(task, talk(("assistant", "<answer>3</answer>"))) == "no tool call"
    assert family.failure_mode(task, talk(call, ("tool", "-1"), answered)
                               ) == "tool code does not compute the expression"
    assert family.failure_mode(task, talk(call, ("tool", value), ("assistant", "<answer>x</answer>"))
                               ) == "wrong answer after the right tool output"
    assert family.failure_mode(task, talk(call, ("tool", value), ("assistant", "no idea"))
                               ) == "no answer after the right tool output"

    walls = vault.family(depths=[6])
    walk = walls.instance(0, "test")
    doors = walk.data["doors"]
    go = ("assistant", "<tool_call>...</tool_call>")
    assert walls.failure_mode(walk, talk(go, ("tool", f"door {doors[1]}"),
                                         ("assistant", f"<answer>{doors[1]}</answer>"))
                              ) == "stopped before the gold"
    assert walls.failure_mode(walk, talk(go, ("tool", "no door abc here"))
                              ) == "a door that was not there"
    assert walls.failure_mode(walk, talk(go, ("tool", "gold 0000"),
                                         ("assistant", "<answer>1</answer>"))
                              ) == "wrong answer after the gold"


def test_story_prompts_hide_the_expression_and_the_value_is_its_result():
    from tasks.messages import ChatMessage

    family = story.family(max_value=20)
    shapes = set()
    for index in range(300):
        task = family.instance(index, "train")
        text, expression = task.prompt[0].content, task.data["expression"]
        assert expression not in text and text.endswith("Use python.")
        assert task.data["value"] == int(eval(expression, {"__builtins__": {}}, {})) >= 0
        shapes.add(task.difficulty)
    assert shapes == {f"shape={k}" for k in range(len(story.SHAPES))}
    right = family.demonstrations(4, start=300)
    wrong = family.demonstrations(4, start=300, wrong_fraction=1.0)
    for good, bad in zip(right, wrong):
        assert good.assistant_texts[-1] == f"<answer>{good.task.data['value']}</answer>"
        assert bad.assistant_texts[-1] != good.assistant_texts[-1]
    task = family.instance(0, "test")
    value = str(task.data["value"])
    call = ChatMessage("assistant", "<tool_call>...</tool_call>")
    assert family.failure_mode(task, [call, ChatMessage("tool", value + "1")]
                               ) == "the code computes another quantity"
    assert family.failure_mode(task, [ChatMessage("assistant", "<answer>1</answer>")]
                               ) == "no tool call"
