"""The error a request the engine refuses raises (its fields' checks live beside them)."""


class InvalidRequest(ValueError):
    """A request the engine refuses; ``param`` names the offending field when known, and
    ``code`` is OpenAI's error code for it."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code

    def __reduce__(self) -> tuple[type, tuple[str, str | None, str]]:  # pickles whole
        return type(self), (str(self), self.param, self.code)
