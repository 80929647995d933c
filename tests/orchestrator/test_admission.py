"""Table-driven tests of every admission rule and reason."""

from __future__ import annotations

import pytest

from config.job import AdmissionConfig
from orchestrator.admission import MemberOutcome, decide_group, decide_member, overlong_penalty

V = 10  # learner version at decision time
MAX_TOKENS = 100


def member(kind="ok", reward=1.0, version=V, tokens=10, attempt=0, tid=1) -> MemberOutcome:
    return MemberOutcome(trajectory_id=tid, kind=kind, reward=reward, min_version=version,
                         sampled_tokens=tokens, attempt=attempt)


MEMBER_CASES = [
    # (id, config overrides, member, expected action, reason, reward)
    ("fresh", {}, member(), "admit", "fresh", 1.0),
    ("lag within bound", {"max_lag": 2}, member(version=V - 2), "admit", "lagged", 1.0),
    ("stale drop", {"max_lag": 2, "stale": "drop"}, member(version=V - 3), "drop", "stale_drop", 1.0),
    ("stale requeue", {"max_lag": 2, "stale": "requeue"}, member(version=V - 3), "requeue",
     "stale_requeue", 1.0),
    ("stale requeue limit", {"max_lag": 2, "stale": "requeue"},
     member(version=V - 3, attempt=2), "drop", "requeue_limit", 1.0),
    ("stale keep", {"max_lag": 2, "stale": "keep"}, member(version=V - 5), "admit", "stale_keep", 1.0),
    ("infra error excluded, unscored", {}, member(kind="infra_error", reward=None), "drop",
     "infra_error", None),
    ("a verifier that could not score is excluded and counted apart", {},
     member(kind="verifier_error", reward=None), "drop", "verifier_error", None),
    ("infra error is not scored 0 even with timeout=fail", {"timeout": "fail"},
     member(kind="infra_error", reward=None), "drop", "infra_error", None),
    ("timeout fail", {"timeout": "fail"}, member(kind="timeout", reward=None), "admit",
     "timeout_fail", 0.0),
    ("timeout mask", {"timeout": "mask"}, member(kind="timeout", reward=None), "mask",
     "timeout_mask", 0.0),
    ("timeout drop", {"timeout": "drop"}, member(kind="timeout", reward=None), "drop",
     "timeout_drop", None),
    ("failed scored 0", {}, member(kind="failed", reward=None), "admit", "fresh", 0.0),
    ("overlong keep", {"overlong": "keep"}, member(kind="overlong", reward=0.0, tokens=100),
     "admit", "overlong_keep", 0.0),
    ("overlong mask", {"overlong": "mask"}, member(kind="overlong", reward=0.0, tokens=100),
     "mask", "overlong_mask", 0.0),
    ("overlong drop", {"overlong": "drop"}, member(kind="overlong", reward=0.0, tokens=100),
     "drop", "overlong_drop", 0.0),
    ("overlong penalize at limit", {"overlong": "penalize", "overlong_cache_len": 20},
     member(kind="overlong", reward=0.0, tokens=100), "admit", "overlong_penalty", -1.0),
    ("penalize inside the window", {"overlong": "penalize", "overlong_cache_len": 20},
     member(reward=1.0, tokens=90), "admit", "overlong_penalty", 0.5),
    ("penalize below the window", {"overlong": "penalize", "overlong_cache_len": 20},
     member(reward=1.0, tokens=80), "admit", "fresh", 1.0),
    ("stale keep and penalized", {"overlong": "penalize", "overlong_cache_len": 20, "max_lag": 0,
                                  "stale": "keep"},
     member(reward=1.0, tokens=90, version=V - 1), "admit", "stale_keep", 0.5),
    ("unknown version is not stale", {"max_lag": 0}, member(version=None), "admit", "fresh", 1.0),
]


@pytest.mark.parametrize("overrides,outcome,action,reason,reward",
                         [c[1:] for c in MEMBER_CASES], ids=[c[0] for c in MEMBER_CASES])
def test_member_rules(overrides, outcome, action, reason, reward):
    d = decide_member(outcome, AdmissionConfig(**overrides), V, max_tokens=MAX_TOKENS)
    assert (d.action, d.reason, d.reward) == (action, reason, reward)
    assert d.lag == (None if outcome.min_version is None else V - outcome.min_version)


def group(*specs) -> list[MemberOutcome]:
    return [member(tid=i, **spec) for i, spec in enumerate(specs)]


GROUP_CASES = [
    ("varied rewards admitted", {}, group({"reward": 1.0}, {"reward": 0.0}),
     [("admit", "fresh"), ("admit", "fresh")]),
    ("zero variance dropped", {"zero_variance": "drop"}, group({"reward": 1.0}, {"reward": 1.0}),
     [("drop", "zero_variance"), ("drop", "zero_variance")]),
    ("zero variance kept", {"zero_variance": "keep"}, group({"reward": 0.0}, {"reward": 0.0}),
     [("admit", "fresh"), ("admit", "fresh")]),
    ("infra error does not make a zero-variance group look varied", {"zero_variance": "drop"},
     group({"reward": 1.0}, {"reward": 1.0}, {"kind": "infra_error", "reward": None}),
     [("drop", "zero_variance"), ("drop", "zero_variance"), ("drop", "infra_error")]),
    ("too few scoring members", {"min_group_size": 2},
     group({"reward": 1.0}, {"kind": "infra_error", "reward": None}),
     [("drop", "group_too_small"), ("drop", "infra_error")]),
    ("masked members count for the statistics", {"timeout": "mask", "zero_variance": "drop"},
     group({"reward": 1.0}, {"kind": "timeout", "reward": None}),
     [("admit", "fresh"), ("mask", "timeout_mask")]),
    ("a requeued member holds the group", {"max_lag": 0, "stale": "requeue"},
     group({"reward": 1.0}, {"reward": 1.0, "version": V - 1}),
     [("admit", "fresh"), ("requeue", "stale_requeue")]),
]


@pytest.mark.parametrize("overrides,members,expected", [c[1:] for c in GROUP_CASES],
                         ids=[c[0] for c in GROUP_CASES])
def test_group_rules(overrides, members, expected):
    decisions = decide_group(members, AdmissionConfig(**overrides), V, max_tokens=MAX_TOKENS)
    assert [(d.action, d.reason) for d in decisions] == expected
    assert [d.trajectory_id for d in decisions] == [m.trajectory_id for m in members]


@pytest.mark.parametrize("tokens,expected", [(0, 0.0), (80, 0.0), (85, -0.25), (100, -1.0),
                                             (150, -1.0)])
def test_overlong_penalty_shape(tokens, expected):
    assert overlong_penalty(tokens, max_len=100, cache_len=20, factor=1.0) == pytest.approx(expected)
