"""The base of every request body, and its string type."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict


class Body(BaseModel):
    # Unknown fields are ignored, as vLLM does.
    model_config = ConfigDict(extra="ignore")


def _valid_unicode(text: str) -> str:
    # JSON can spell a lone UTF-16 surrogate ("\\ud800"), which neither a tokenizer nor a
    # UTF-8 response can carry.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("strings must be valid Unicode (a lone surrogate was found)") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
