"""Intra-op thread control for the lab's many small tensor operations.

On a shared machine, torch's default two intra-op threads make each small op wait for a busy
core (measured: 80 us instead of 2 us per log_softmax of a 10 x 8 tensor under load), so the
lab runs with one thread and restores the previous setting afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
