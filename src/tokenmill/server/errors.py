"""Error bodies with the right status, in the shape of the API the path belongs to: OpenAI's
`{"error": {"message", "type", "param", "code"}}`, or under `/v1/messages` Anthropic's
`{"type": "error", "error": {"type", "message"}}` (`body_for` picks by path)."""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("tokenmill.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 503: "service_unavailable"}  # fmt: skip


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}


# Anthropic's error types by status; other 4xx are invalid_request_error, other 5xx api_error (its docs say so)
_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                    529: "overloaded_error"}  # fmt: skip
ANTHROPIC_PATH = "/v1/messages"


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def body_for(path: str, status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The error body in the shape of the API that `path` belongs to."""
    if is_anthropic(path):
        return anthropic_error_body(status, message)
    return error_body(status, message, param, code)


def error_response(path: str, err: APIError) -> JSONResponse:
    return JSONResponse(body_for(path, err.status, err.message, err.param, err.code), err.status, headers=err.headers)


# what a validation message names that its start does not: (pattern, param, code)
_NAMED = ((re.compile(r"^logit_bias names token id"), "logit_bias", None),
          (re.compile(r"^This model's maximum context length"), None, "context_length_exceeded"))  # fmt: skip


def bad_value(e: ValueError) -> APIError:
    """A ValueError from parameter validation -> 400 naming the parameter when the message starts with it (a prompt
    past the context: OpenAI's code `context_length_exceeded`, which clients look for)."""
    message = str(e)
    match = re.match(r"^(\w+)=", message)
    if match:
        return APIError(400, message, param=match.group(1))
    param, code = next(((p, c) for pattern, p, c in _NAMED if pattern.match(message)), (None, None))
    return APIError(400, message, param=param, code=code)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    # NOTE: a union reports one error per member; the deepest (a content block's own complaint, not "content
    # should be a string") says what is wrong
    field = [e for e in errors if tuple(e.get("loc", ()))[:2] == tuple(first.get("loc", ()))[:2]]
    first = max(field, key=lambda e: len(e.get("loc", ())))
    # NOTE: pydantic names union members and validators in the location ("prompt.function-after[...]",
    # "prompt.list[str].0"); a client wants the field path only.
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_type_tag(p)]
    param = loc[0] if loc else None
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('msg')}", None
    if first.get("type") == "extra_forbidden":
        return f"unsupported parameter: {'.'.join(loc)} (tokenmill does not implement it)", param
    if first.get("type") == "missing":
        return f"missing required parameter: {'.'.join(loc)}", param
    message = str(first.get("msg", "")).removeprefix("Value error, ")
    return f"invalid value for {'.'.join(loc) or 'body'}: {message}", param


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "list", "dict", "other"))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if request.method == "POST" and kind != "application/json":  # (FastAPI reads no other body as JSON)
            message = f"send the body as JSON with Content-Type: application/json (it came as {kind or 'no type'})"
        return JSONResponse(body_for(request.url.path, 400, message, param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(body_for(request.url.path, exc.status_code, str(exc.detail)), exc.status_code)
