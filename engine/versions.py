"""Resident weight versions of the embedded engine: one copy of the weights per version.

A `WeightsSlot` is one policy version's weights (its own model copy and its own `RowForward`,
so its own KV rows): sequences decoding with that version live in its rows 0..n-1, and one
batched forward per slot serves them each step. Nothing mutable is shared between slots: a new
slot deep-copies a model and loads the new state into the copy.

`plan_residency` decides which versions to drop; it is a pure function so the rule is tested
on its own. Guarantees:

- the current version is never dropped;
- every other version that nothing references (no running sequence, no waiting request, no
  live session pinned to it) is freed;
- if more than `max_resident` versions would remain, the oldest versions other than the current
  one are evicted (unreferenced ones first, though those are already freed by the rule above)
  until `max_resident` remain, even if something still references them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.checkpoint import assign_state_dict
from engine.forward import RowForward
from engine.requests import RequestError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


class VersionNotResident(RequestError):
    """A request is pinned to a weights version this engine does not hold (now, or any more)."""


@dataclass(eq=False)
class WeightsSlot:
    """One resident policy version: its weights, its forward, and the sequences it decodes."""

    version: int
    path: str
    model: PreTrainedModel
    forward: RowForward
    active: list[Any] = field(default_factory=list)   # engine sequences; active[i] is row i

    def overwrite(self, state: dict[str, torch.Tensor], version: int, path: str) -> None:
        """Load `state` into this slot's own model in place (nothing else holds these weights)."""
        assign_state_dict(self.model, state)
        self.forward.refresh_weights()
        self.version = version
        self.path = path


def build_slot(template: PreTrainedModel, state: dict[str, torch.Tensor], *, version: int,
               path: str, rows: int, max_len: int | None) -> WeightsSlot:
    """A new slot: a private deep copy of `template` with `state` loaded, and its own KV rows."""
    model = copy.deepcopy(template)
    assign_state_dict(model, state)
    return WeightsSlot(version, path, model, RowForward(model, rows=rows, max_len=max_len))


@dataclass(frozen=True)
class ResidencyPlan:
    freed: tuple[int, ...]     # unreferenced, dropped
    evicted: tuple[int, ...]   # still referenced, dropped to respect the cap


def plan_residency(resident: list[int], *, current: int, referenced: set[int],
                   max_resident: int) -> ResidencyPlan:
    """Which of the `resident` versions to drop (see module docstring)."""
    if max_resident < 1:
        raise ValueError(f"max_resident must be >= 1, got {max_resident}")
    if current not in resident:
        raise ValueError(f"current version {current} is not among the resident {resident}")
    freed = tuple(v for v in sorted(resident) if v != current and v not in referenced)
    kept = [v for v in sorted(resident) if v == current or v in referenced]
    evicted: list[int] = []
    candidates = [v for v in kept if v != current]  # oldest first
    while len(kept) > max_resident and candidates:
        victim = candidates.pop(0)
        kept.remove(victim)
        evicted.append(victim)
    return ResidencyPlan(freed, tuple(evicted))


def not_resident_message(version: int, *, resident: tuple[int, ...], current: int,
                         gone: str | None) -> str:
    """Why a request pinned to `version` cannot be served, and what to do about it."""
    held = ", ".join(str(v) for v in resident)
    if gone is not None:
        why = f"it was {gone}"
    elif version > current:
        why = f"it is newer than the current version {current}; load it with update_weights first"
    else:
        why = "it was never loaded here"
    return (f"weights version {version} is not resident in this engine ({why}); resident "
            f"versions: [{held}], current {current}. Start the trajectory again on the current "
            f"version, or keep its session pinned (and raise --max-resident-versions) so the "
            f"version stays loaded")
