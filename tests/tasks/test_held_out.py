"""Three splits, disjoint by construction: for every built-in family, no identity (split key)
is in two of `train`, `validation` and `test`, and demonstrations come from `train` only.
Where each split is read on the real code paths: tests/orchestrator/test_splits.py (RL and
the evaluations) and tests/learner/test_warm_start_splits.py (selection and the check)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.api import SPLITS, SplitShares, TaskFamily, TaskInstance
from tasks.builtin_tools import python
from tasks.loading import available_entry_points, load_family
from tasks.verify import Component, Rubric

TRAIN, DEMOS, HELD = 400, 200, 128


def split_keys(family: TaskFamily, split: str, count: int) -> set[str]:
    return {family.split_key(t) for t in family.instances(split, 0, count)}


@pytest.mark.parametrize("name", available_entry_points())
def test_the_three_splits_of_every_built_in_family_share_no_identity(name):
    family = load_family(name, {})
    assert family.held_out and family.splits == SPLITS
    train, validation, test = (split_keys(family, split, n) for split, n in
                               (("train", TRAIN), ("validation", HELD), ("test", HELD)))
    demos = {family.split_key(d.task) for d in family.demonstrations(DEMOS, start=TRAIN)}
    assert not (train | demos) & (validation | test) and not validation & test
    assert {family.shares.of(name, key) for key in demos} == {"train"}
    assert {family.shares.of(name, key) for key in test} == {"test"}
    assert {family.shares.of(name, key) for key in validation} == {"validation"}


@pytest.mark.parametrize("name, options", [("arith", {"max_ops": 2, "max_value": 9}),
                                           ("vault", {"depths": [6, 8]}),
                                           ("story", {"max_value": 20})])
def test_the_shipped_tasks_have_a_test_pool_of_at_least_a_thousand_distinct_instances(
        name, options):
    family = load_family(name, options)
    hashes: set[str] = set()
    for task in family.instances("test", 0, 10_000):
        hashes.add(task.content_hash)
        if len(hashes) == 1000:
            break
    assert len(hashes) == 1000


def test_the_shares_split_the_identities_in_the_stated_proportions():
    shares = SplitShares(validation=0.1, test=0.2)
    homes = [shares.of("f", str(n)) for n in range(20_000)]
    assert abs(homes.count("test") / len(homes) - 0.2) < 0.01
    assert abs(homes.count("validation") / len(homes) - 0.1) < 0.01
    with pytest.raises(ValueError, match="validation_share \\+ test_share < 1"):
        SplitShares(validation=0.5, test=0.5)


def _family_ignoring_splits() -> TaskFamily:
    def make(index: int, split: str) -> TaskInstance:
        return TaskInstance(prompt=f"task {index}", tools=(python,),
                            verifier=Rubric(Component("one", lambda ctx: 1.0, 1.0)),
                            data={"n": index})
    return TaskFamily("careless", make, split_key=lambda t: str(t.data["n"]),
                      shares=SplitShares(0.3, 0.3))


def test_a_family_whose_instances_cross_splits_is_refused_with_the_fix():
    family = _family_ignoring_splits()
    homes = {family.shares.of("careless", str(n)) for n in range(16)}
    assert homes == set(SPLITS)  # so some index below lands in the wrong split
    with pytest.raises(ValueError, match="draw_in_split"):
        for n in range(16):
            family.instance(n, "test")


def test_a_job_file_that_still_names_eval_share_is_told_what_replaced_it(tmp_path: Path):
    from tasks.loading import TaskLoadError

    with pytest.raises(TaskLoadError, match="validation_share"):
        load_family("arith", {"eval_share": 0.3})
