"""Configuration of the RL stage (kept apart from infra/config.py because it is the largest section)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class RLConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    enabled: bool = Field(False, description="Run the RL stage after SFT.")
