"""OpenAI's error envelope: {"error": {"message", "type", "param", "code"}} with the matching status."""

from __future__ import annotations

import json
import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmserve.errors import LLMServeError

logger = logging.getLogger(__name__)

TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "BadRequestError",
         429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    # OpenAI's schema: code is a string or null (the HTTP status carries the number)
    return {"error": {"message": message, "type": TYPES.get(status, "BadRequestError"), "param": param, "code": code}}


def error_response(status: int, message: str, param=None, code=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def from_exception(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, LLMServeError):
        return APIError(e.status_code, e.message, e.param, code=e.code)
    logger.exception("internal error", exc_info=e)
    return APIError(500, f"internal error ({type(e).__name__}); see the server log")


def install(app) -> None:
    @app.exception_handler(APIError)
    async def _api(request: Request, e: APIError):
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(LLMServeError)
    async def _user(request: Request, e: LLMServeError):
        return error_response(e.status_code, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        # FastAPI's 422 becomes OpenAI's 400, naming the first offending field.
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON", None)
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        return error_response(400, f"{where}: {first.get('msg', 'invalid value')}", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        err = from_exception(e)
        return error_response(err.status, err.message, err.param)


def sse_error(e: BaseException) -> str:
    err = from_exception(e)
    return f"data: {json.dumps(error_body(err.status, err.message, err.param, err.code))}\n\n"
