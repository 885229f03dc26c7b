"""Every error the HTTP service answers, mapped to its status in one place, by exception type.

    opt_serving.errors.InvalidRequest      400  param and code from the exception (context_length_exceeded, ...)
    opt_serving.errors.NotFound            404  (a model this server does not serve: model_not_found)
    ValueError (any other)                  400  no param: nothing says which field is at fault
    opt_serving.errors.Overloaded          429  Retry-After (engine.QueueFull: code queue_full)
    opt_serving.errors.Unavailable         503  (engine.EngineClosed: shutting_down; runner StageDied:
                                                 stage_died, with Retry-After)
    TimeoutError                            504
    pydantic validation                     400  param: the field pydantic names, or the InvalidRequest's
    anything else                           500  logged

The engine's own exceptions are listed by name as well as through their opt_serving.errors bases, so the
mapping does not depend on which of those bases they have. Every body has OpenAI's error shape
(protocol.error_json).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Optional

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from opt_serving.engine.scheduler import EngineClosed, QueueFull
from opt_serving.errors import InvalidRequest, NotFound, OPTServingError, Overloaded, Unavailable
from opt_serving.runner.types import StageDied
from opt_serving.service import protocol as P

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1


class ApiError(Exception):
    """An error answered in OpenAI's shape with a given status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def json(self) -> dict:
        return P.error_json(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.json(), status_code=self.status, headers=self.headers)


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


# (exception types, status, error type, code (None: the exception's own), message prefix, Retry-After);
# the first row whose types match wins, so a named engine exception comes before its base class
_REFUSALS = [
    ((QueueFull,), 429, "rate_limit_error", "queue_full", "server busy: ", True),
    ((Overloaded,), 429, "rate_limit_error", None, "server busy: ", True),
    ((EngineClosed,), 503, "server_error", "shutting_down", "server shutting down: ", False),
    # the replica's health check fails too: Serve rebuilds it with its stages
    ((StageDied,), 503, "server_error", "stage_died", "model unavailable: ", True),
    ((Unavailable,), 503, "server_error", None, "model unavailable: ", True),
]


def to_api_error(e: BaseException) -> Optional[ApiError]:
    """A refusal or a bad request -> its HTTP error; None for anything else (a bug: 500)."""
    for types, status, kind, code, prefix, retry in _REFUSALS:
        if isinstance(e, types):
            message = f"{prefix}{e}" + ("; retry later" if status == 429 else "")
            return ApiError(status, message, kind, code=code or getattr(e, "code", None),
                            headers={"Retry-After": str(RETRY_AFTER_S)} if retry else None)
    if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
        return ApiError(504, "request timed out", "timeout_error", code="timeout")
    if isinstance(e, InvalidRequest):
        return ApiError(400, str(e), param=e.param, code=e.code)
    if isinstance(e, NotFound):
        return ApiError(404, str(e), param=e.param, code=e.code)
    if isinstance(e, ValueError):  # not typed: a 400 all the same, the message says what is wrong
        return ApiError(400, str(e))
    return None


def internal_error(e: BaseException) -> ApiError:
    """What a client is told of a bug (the details go to the log)."""
    return ApiError(500, f"internal error: {type(e).__name__}", "server_error")


def unwrap(e: BaseException) -> BaseException:
    """The first exception of a (nested) exception group, e.g. from a TaskGroup."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


@contextlib.contextmanager
def as_http_errors():
    """Refusals raised inside (queue full, too long, closing, timeout, bad parameters) leave as ApiErrors."""
    try:
        yield
    except Exception as e:
        mapped = to_api_error(unwrap(e))
        if mapped is None:
            raise
        raise mapped from e


def validation_error(e: RequestValidationError) -> ApiError:
    """pydantic's first complaint -> a 400 naming the field (its location, or the InvalidRequest a request
    model's own check raised)."""
    errors = e.errors()
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    cause = first.get("ctx", {}).get("error")
    if first.get("type") == "json_invalid":
        msg = f"request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
    elif not loc and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
        msg = "request body must be a JSON object (send Content-Type: application/json)"
    else:
        msg = first["msg"].removeprefix("Value error, ")
        if loc:
            msg = f"{'.'.join(loc)}: {msg}"
    param = loc[0] if loc else getattr(cause, "param", None)
    return ApiError(400, msg, param=param, code=getattr(cause, "code", None) if not loc else None)


def install_error_handlers(app: FastAPI) -> None:
    """Every error answered in OpenAI's JSON shape."""

    @app.exception_handler(ApiError)
    async def _api_error(_req, e: ApiError):
        return e.response()

    @app.exception_handler(OPTServingError)
    async def _typed_error(_req, e: OPTServingError):
        return (to_api_error(e) or internal_error(e)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req, e: RequestValidationError):
        return validation_error(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, e: StarletteHTTPException):
        return JSONResponse(P.error_json(str(e.detail)), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(_req, e: Exception):
        log.exception("internal error")
        return internal_error(e).response()
