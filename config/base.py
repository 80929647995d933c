"""The one base of every config section: strict (unknown keys are errors) and frozen.

Job, learner, engine and lab configs all derive from `ConfigSection`, so a config object is a
value: what `stalewise run --dry-run` prints is what every process of the job receives.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigSection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
