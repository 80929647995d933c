"""The one base of every config section: strict (unknown keys are errors) and frozen.

Job, learner, engine and lab configs all derive from `ConfigSection`, so a config object is a
value: what `stalewise run --dry-run` prints is what every process of the job receives. Floats
are finite: `inf` and `nan` are errors wherever they are written. A seed (`Seed`) is an integer
from 0 to 2**63 - 1, what NumPy and torch both take (-1 means "a random seed" elsewhere; here
it would have been a fixed seed of its own).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

Seed = Annotated[int, Field(ge=0, le=2**63 - 1)]


class ConfigSection(BaseModel):
    # inf and nan are refused in every float (a temperature of inf passed validation, and the
    # job failed after its warm start, when the pipeline built its sampling params)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
