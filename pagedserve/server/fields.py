"""The base of every request body, and its string type."""

from __future__ import annotations

from functools import cache
from types import NoneType, UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import AfterValidator, BaseModel, ConfigDict, StringConstraints, model_validator


class Body(BaseModel):
    # Unknown fields are ignored, as vLLM does.
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_the_default(cls, data: Any) -> Any:
        """OpenAI documents its optional fields "or null", and vLLM takes null for n,
        stream, echo, logprobs...: a null for a field that holds no None (a flag, a count)
        means its default."""
        if isinstance(data, dict) and any(v is None for v in data.values()):
            defaulted = _defaulted_by_null(cls)
            data = {k: v for k, v in data.items() if v is not None or k not in defaulted}
        return data


@cache
def _defaulted_by_null(model: type[BaseModel]) -> frozenset[str]:
    """The keys (names, and aliases) of ``model``'s optional fields that hold no None."""
    return frozenset(key for name, f in model.model_fields.items()
                     if not f.is_required() and not _takes_none(f.annotation)
                     for key in (name, f.alias) if key)


def _takes_none(annotation: Any) -> bool:
    if annotation is Any or annotation is None or annotation is NoneType:
        return True
    origin = get_origin(annotation)
    if origin is Literal:
        return None in get_args(annotation)
    if origin in (Union, UnionType):
        return any(_takes_none(a) for a in get_args(annotation))
    return False


def _valid_unicode(text: str) -> str:
    # JSON can spell a lone UTF-16 surrogate ("\\ud800"), which neither a tokenizer nor a
    # UTF-8 response can carry.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("strings must be valid Unicode (a lone surrogate was found)") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


def short_text(max_length: int) -> Any:
    """Text of at most ``max_length`` characters (the length checked first, so that the
    error names characters)."""
    return Annotated[str, StringConstraints(max_length=max_length),
                     AfterValidator(_valid_unicode)]
