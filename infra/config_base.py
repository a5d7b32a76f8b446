"""The base model of every config section: unknown keys are errors, assignments are validated.

A module of its own so that the section modules (infra/config_sections.py, infra/trainer_config.py,
infra/rl_config.py, infra/rollout_correction.py) share one base without importing one another for it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
