"""OpenAI's error envelope, {"error": {"message", "type", "param", "code"}}, with the matching status; on the routes of
Anthropic's Messages API, Anthropic's: {"type": "error", "error": {"type", "message"}}."""

from __future__ import annotations

import json
import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmserve.errors import LLMServeError

logger = logging.getLogger(__name__)

ANTHROPIC_PREFIX = "/v1/messages"  # the routes of Anthropic's Messages API, whose clients read its error object

ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "BadRequestError",
         429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    # OpenAI's schema: code is a string or null (the HTTP status carries the number)
    return {"error": {"message": message, "type": TYPES.get(status, "BadRequestError"), "param": param, "code": code}}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def error_response(status: int, message: str, param=None, code=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def from_exception(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, LLMServeError):
        return APIError(e.status_code, e.message, e.param, code=e.code)
    logger.exception("internal error", exc_info=e)
    return APIError(500, f"internal error ({type(e).__name__}); see the server log")


def respond(request: Request, status: int, message: str, param=None, code=None, headers=None) -> JSONResponse:
    """The error object of the API the route belongs to: Anthropic's for /v1/messages, else OpenAI's."""
    root = request.scope.get("root_path") or ""  # --root-path: the route's own path follows it
    path = request.url.path[len(root):] if root and request.url.path.startswith(root) else request.url.path
    if path.startswith(ANTHROPIC_PREFIX):
        return JSONResponse(anthropic_error_body(status, message), status_code=status, headers=headers)
    return error_response(status, message, param, code, headers)


def from_validation_error(e, param: str) -> APIError:
    """A pydantic ValidationError of a request built from the client's fields (a Responses or Messages request read
    as a chat request): a 400 naming where, under the client's field `param`."""
    first = e.errors()[0] if e.errors() else {}
    where = ".".join(str(x) for x in first.get("loc", ()))
    return APIError(400, f"{param}: {where + ': ' if where else ''}{first.get('msg', 'invalid value')}", param=param)


def install(app) -> None:
    @app.exception_handler(APIError)
    async def _api(request: Request, e: APIError):
        return respond(request, e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(LLMServeError)
    async def _user(request: Request, e: LLMServeError):
        return respond(request, e.status_code, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        # FastAPI's 422 becomes OpenAI's 400, naming the first offending field.
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return respond(request, 400, "the request body is not valid JSON", None)
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        return respond(request, 400, f"{where}: {first.get('msg', 'invalid value')}", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        return respond(request, e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        err = from_exception(e)
        return respond(request, err.status, err.message, err.param)


def sse_error(e: BaseException) -> str:
    err = from_exception(e)
    return f"data: {json.dumps(error_body(err.status, err.message, err.param, err.code))}\n\n"
