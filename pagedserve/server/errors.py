"""OpenAI's error shape: every non-2xx answer is ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: every non-2xx answer has this shape."""

    error: ErrorInfo


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered in OpenAI's shape with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    default = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {
        "message": message,
        "type": ERROR_TYPES.get(status, default),
        "param": param,
        "code": code,
    }}


def validation_error(errors: list[Any]) -> APIError:
    """The first pydantic/FastAPI validation error as a 400 naming its field."""
    if not errors:
        return APIError(400, "Invalid request body.", code="invalid_value")
    first = errors[0]
    if first.get("type") == "json_invalid":  # its location is a character offset
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"The request body is not valid JSON: {detail}".rstrip(": "),
                        code="invalid_json")
    # Union members and validators add steps such as "function-after[...]" to the path.
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and "[" not in str(p)]
    message = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        message = "Field required"
    text = f"{'.'.join(loc)}: {message}" if loc else message
    # param names the top-level field; the message keeps the full path.
    return APIError(400, text, param=loc[0] if loc else None, code="invalid_value")
