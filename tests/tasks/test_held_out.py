"""Held out means held out: for every built-in family, no eval instance's identity (its split
key) appears among training instances or the demonstrations the SFT warm start uses."""

from __future__ import annotations

import pytest

from tasks.api import TaskFamily, TaskInstance, split_of
from tasks.builtin_tools import python
from tasks.loading import available_entry_points, load_family
from tasks.verify import Component, Rubric

TRAIN, DEMOS, EVAL = 400, 200, 128


@pytest.mark.parametrize("name", available_entry_points())
def test_eval_instances_never_appear_in_training_or_demonstrations(name):
    family = load_family(name, {})
    assert family.split_key is not None, f"built-in family {name} must define a split_key"
    train = {family.split_key(t) for t in family.instances("train", 0, TRAIN)}
    demos = {family.split_key(d.task) for d in family.demonstrations(DEMOS, start=TRAIN)}
    evaluated = [family.split_key(t) for t in family.instances("eval", 0, EVAL)]
    assert not (train | demos) & set(evaluated)
    assert all(split_of(name, key, family.eval_share) == "eval" for key in evaluated)


def _family_ignoring_splits() -> TaskFamily:
    def make(index: int, split: str) -> TaskInstance:
        return TaskInstance(prompt=f"task {index}", tools=(python,), verifier=Rubric(Component("one", lambda ctx: 1.0, 1.0)),
                            data={"n": index})
    return TaskFamily("careless", make, split_key=lambda t: str(t.data["n"]), eval_share=0.5)


def test_a_family_whose_instances_cross_splits_is_refused_with_the_fix():
    family = _family_ignoring_splits()
    homes = {split_of("careless", str(n), 0.5) for n in range(8)}
    assert homes == {"train", "eval"}  # so some index below lands in the wrong split
    with pytest.raises(ValueError, match="draw_in_split"):
        for n in range(8):
            family.instance(n, "eval")
