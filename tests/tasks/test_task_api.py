"""Task instances and families: stable keys, content hashes, limits, demonstrations, SFT samples."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from core.sandbox import SandboxSpec
from core.tiny_tokenizer import build_tiny_tokenizer
from tasks import Component, Rubric, TaskFamily, TaskInstance, TaskLimits, demonstration_samples
from tasks.builtin_tools import bash, python
from tasks.chat import HermesChatFormat
from tasks.demos import Demonstration, DemoTurn, render_demonstration
from tasks.messages import ChatMessage
from tasks.suites import arith, codefix, longhaul

RUBRIC = Rubric(Component("one", lambda ctx: 1.0))


def make(index: int, split: str) -> TaskInstance:
    return TaskInstance(prompt=f"task {split} {index}", tools=(python,), verifier=RUBRIC,
                        data={"index": index})


def test_keys_are_stable_and_by_key_rebuilds_the_same_instance():
    family = TaskFamily("demo", make, size=5)
    task = family.instance(3, "test")
    assert task.key == "demo/test/3" and task.family == "demo"
    again = family.by_key(task.key)
    assert again.content_hash == task.content_hash
    assert [t.key for t in family.instances("train", start=3)] == ["demo/train/3",
                                                                   "demo/train/4"]
    with pytest.raises(IndexError):
        family.instance(5)
    with pytest.raises(ValueError, match="splits"):
        family.instance(0, "eval")
    with pytest.raises(ValueError, match="of the form"):
        family.by_key("other/train/1")


def test_content_hash_changes_with_any_defining_content():
    base = TaskInstance(prompt="p", tools=(python,), verifier=RUBRIC)
    same = TaskInstance(prompt=(ChatMessage("user", "p"),), tools=(python,), verifier=RUBRIC)
    assert base.content_hash == same.content_hash
    variants = [
        dataclasses.replace(base, prompt="q"),
        dataclasses.replace(base, tools=(python, bash)),
        dataclasses.replace(base, sandbox=SandboxSpec(files={"a.py": "x"})),
        dataclasses.replace(base, limits=TaskLimits(max_turns=3)),
        dataclasses.replace(base, hidden_files={"t.py": "assert 1"}),
        dataclasses.replace(base, data={"answer": 4}),
        dataclasses.replace(base, difficulty="hard"),
        dataclasses.replace(base, verifier=Rubric(Component("one", lambda ctx: 1.0, 0.5))),
    ]
    hashes = {v.content_hash for v in variants} | {base.content_hash}
    assert len(hashes) == len(variants) + 1
    assert dataclasses.replace(base, key="other/train/9").content_hash == base.content_hash


def test_instances_reject_bad_definitions():
    with pytest.raises(ValueError, match="unique names"):
        TaskInstance(prompt="p", tools=(python, python), verifier=RUBRIC)
    with pytest.raises(TypeError, match="JSON-serialisable"):
        TaskInstance(prompt="p", tools=(), verifier=RUBRIC, data={"x": object()})
    with pytest.raises(TypeError, match="@tool"):
        TaskInstance(prompt="p", tools=(print,), verifier=RUBRIC)  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        TaskLimits(max_turns=0)
    with pytest.raises(ValidationError):
        TaskLimits(max_turn=3)  # type: ignore[call-arg]


@pytest.mark.parametrize("fraction", [0.0, 0.25, 1.0])
def test_demonstration_sets_have_the_requested_share_of_wrong_answers(fraction):
    demos = arith.family().demonstrations(8, wrong_fraction=fraction, seed=1)
    assert sum(not d.correct for d in demos) == round(8 * fraction)
    for demo in demos:
        expected = str(demo.task.data["value"])
        assert (demo.turns[-1].assistant == f"<answer>{expected}</answer>") == demo.correct


@pytest.mark.parametrize("family", [arith.family(), codefix.family(),
                                    longhaul.family(max_k=8)], ids=lambda f: f.name)
def test_sft_samples_mask_exactly_the_assistant_turns(family):
    fmt = HermesChatFormat(build_tiny_tokenizer(), tool_listing="none")
    demos = family.demonstrations(4, wrong_fraction=0.5)
    samples = demonstration_samples(demos, fmt)
    assert len(samples) == 4
    for demo, sample in zip(demos, samples):
        assert len(sample.token_ids) == len(sample.loss_mask)
        masked = [t for t, m in zip(sample.token_ids, sample.loss_mask) if m]
        expected = [t for turn in demo.turns for t in fmt.encode_assistant(turn.assistant)]
        assert masked == expected
        assert sample.correct == demo.correct and sample.task_key == demo.task.key


def test_a_demonstration_with_missing_observations_is_rejected():
    task = arith.family().instance(0)
    fmt = HermesChatFormat(build_tiny_tokenizer())
    bad = Demonstration(task, (DemoTurn('<tool_call>{"name":"python","arguments":{"code":"1"}}'
                                        '</tool_call>'), DemoTurn("<answer>1</answer>")))
    with pytest.raises(ValueError, match="1 tool calls but 0 observations"):
        render_demonstration(bad, fmt)


def test_demonstrations_of_a_family_without_a_generator_say_how_to_add_one():
    from tasks import Component, Rubric, TaskFamily, TaskInstance

    rubric = Rubric(Component("zero", lambda ctx: 0.0, 1.0))
    family = TaskFamily("plain", lambda i, split: TaskInstance(prompt=f"q{i}", tools=(),
                                                               verifier=rubric))
    assert not family.has_demonstrations
    with pytest.raises(ValueError, match="has no demonstration generator; pass demonstrate="):
        family.demonstration(family.instance(0))
