"""Field types that parameter models on every floor share, each defined once."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from pydantic_core import PydanticCustomError


class Strict(BaseModel):
    """A model that refuses unknown keys: a misspelt field is an error, never silently a default."""

    model_config = ConfigDict(extra="forbid")


# A node id, team or model name: lowercase, so it is safe as a key prefix and as a block name.
NAME = r"[a-z0-9][a-z0-9-]{0,62}"
Name = Annotated[str, Field(pattern=f"^{NAME}$")]

# A run or model id: a checkpoint folder and a model key segment, so never a path (no "/", no leading dot).
RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
RunId = Annotated[str, Field(pattern=RUN_ID_PATTERN)]


def _say_aware(v: object, handler: ValidatorFunctionWrapHandler) -> datetime:
    try:
        return handler(v)
    except ValidationError as e:
        if any(err["type"] == "timezone_aware" for err in e.errors()):
            # pydantic's own wording ("should have timezone info") does not show the form to use.
            raise PydanticCustomError("timezone_aware", "must be timezone-aware (e.g. 2026-01-31T00:00:00Z)") from None
        raise


# A decision or report time: pydantic's AwareDatetime, a naive one refused with an example of the form.
AwareTime = Annotated[AwareDatetime, WrapValidator(_say_aware)]
