"""User-facing errors.

Every error a user can cause derives from LLMServeError: the CLI prints its message on one line and
exits non-zero, the server maps it to the OpenAI error object. Anything else is a bug.
"""


class LLMServeError(Exception):
    """An error caused by the user's input or environment, with a message meant for them."""

    status_code = 400
    error_type = "BadRequestError"
    code: str | None = None  # the OpenAI error object's `code`, where one names the case (model_not_found, ...)

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class ModelLoadError(LLMServeError):
    """The model path, format, architecture or quantization cannot be served."""

    status_code = 404
    error_type = "NotFoundError"


class UnsupportedModelError(ModelLoadError):
    status_code = 400
    error_type = "BadRequestError"


class InvalidRequestError(LLMServeError):
    """A request parameter is out of range or the prompt does not fit the context."""


def validation_summary(e) -> str:
    """A pydantic ValidationError's first error as `key.path: message`, for one-line errors about a config file."""
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "(top level)"
    return f"{where}: {err['msg'].removeprefix('Value error, ')}"
