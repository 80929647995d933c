"""The one base of every config section: strict (unknown keys are errors) and frozen.

Job, learner, engine and lab configs all derive from `ConfigSection`, so a config object is a
value: what `stalewise run --dry-run` prints is what every process of the job receives. Floats
are finite: `inf` and `nan` are errors wherever they are written.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigSection(BaseModel):
    # inf and nan are refused in every float (a temperature of inf passed validation, and the
    # job failed after its warm start, when the pipeline built its sampling params)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
