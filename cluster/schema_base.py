"""Base class shared by every config section: strict (unknown keys and wrong types are errors)."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section. Unknown keys are refused and values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=False)
