"""Shared helpers of the lab tests (imported by the test modules of this folder)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from lab.config import LabConfig


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The lab's tensors are small: one intra-op thread is fastest on a shared 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def lab_config(**sections: dict) -> LabConfig:
    """A validated LabConfig from section dicts, e.g. lab_config(policy={"vocab_size": 6})."""
    return LabConfig.model_validate(sections)
