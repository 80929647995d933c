"""orchestrator.release: which decided groups may enter the learner stream, in what order."""

from __future__ import annotations

import pytest

from orchestrator.release import ReleaseOrder


def test_ready_first_releases_each_group_when_decided():
    order = ReleaseOrder("ready_first")
    for g in (1, 2, 3):
        order.opened(g, 0)
    assert order.ready(3) == [3]
    assert order.ready(1) == [1]


def test_in_order_holds_a_group_until_everything_dispatched_before_it_is_decided():
    order = ReleaseOrder("in_order")
    for g in (10, 11, 12, 13):
        order.opened(g, 0)
    assert order.ready(12) == [] and order.ready(13) == []
    assert order.waiting == 2
    assert order.ready(10) == [10]
    assert order.ready(11) == [11, 12, 13]  # the head arrives: the line moves up to the next open
    assert order.waiting == 0
    order.opened(14, 1)
    order.opened(15, 1)
    assert order.ready(15) == []
    order.reopened(11, 0)  # released but requeued: it is open again and keeps its early place
    assert order.ready(14) == []
    assert order.ready(11) == [11, 14, 15]


def test_groups_released_behind_a_reopened_group_wait_for_it_again():
    """A batch [11, 12, 13] is released; 11 turns out to need a requeue. 12 and 13 must not
    enter before it: they go back in line, decided, and enter right after 11 does."""
    order = ReleaseOrder("in_order")
    for g in (10, 11, 12, 13, 14):
        order.opened(g, 0)
    assert order.ready(12) == [] and order.ready(13) == [] and order.ready(10) == [10]
    entering = order.ready(11)
    assert entering == [11, 12, 13]
    order.reopened(11, 0)
    for behind in entering[1:]:
        order.returned(behind, 0)
    assert order.releasable() == [] and order.waiting == 2
    assert order.ready(14) == []
    assert order.ready(11) == [11, 12, 13, 14]


def test_weight_fifo_holds_newer_weights_behind_a_reopened_group():
    order = ReleaseOrder("weight_fifo")
    order.opened(1, 0)
    order.opened(2, 1)
    order.opened(3, 1)
    assert order.ready(3) == [] and order.ready(2) == []
    entering = order.ready(1)
    assert entering == [1, 2, 3]
    order.reopened(1, 0)
    for behind in entering[1:]:
        order.returned(behind, 1)
    assert order.releasable() == []  # version 0 is open again
    assert order.ready(1) == [1, 2, 3]


def test_weight_fifo_lets_older_weights_go_first():
    order = ReleaseOrder("weight_fifo")
    order.opened(1, 0)
    order.opened(2, 1)
    order.opened(3, 1)
    order.opened(4, 0)
    assert order.ready(2) == []  # version 0 still open
    assert order.ready(1) == [1]  # the oldest weights: ready first among themselves
    assert order.ready(4) == [4, 2]  # the last of version 0, then version 1 may go
    assert order.ready(3) == [3]


def test_unknown_order_is_refused():
    with pytest.raises(ValueError, match="in_order"):
        ReleaseOrder("fastest")  # type: ignore[arg-type]
