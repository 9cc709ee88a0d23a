"""The base of every config section (pydantic): unknown keys are errors, assignments validated."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every config section: forbids unknown keys, validates assignments."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
