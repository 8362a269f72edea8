"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with its status
(API-server process). Every error the API server answers goes through here: from a core
route, FastAPI's request validation, Starlette's router (unknown route, wrong method) or a
plugin route raising `HTTPException`.

Status choices: 400 an invalid request field, FastAPI's validation errors included (OpenAI
answers 400, not 422), `param` naming the field, and a body that is not JSON or nests too
deep to parse (vLLM's status; the message says where); 401 bad or missing API key, 404
unknown route or model, 405 wrong method, 413 body too large, 500 an unexpected error (the
message carries the request id, never a traceback), 503 the engine is dead.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from gateway.frontend.engine_client.admission import RequestRejectedError
from gateway.sampling_params import InvalidParameterError

# OpenAI's `type` strings.
INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
SERVER_ERROR = "server_error"

_TYPE_BY_STATUS = {401: AUTHENTICATION}


#: What any operation may answer besides its own success, whatever its route (core or
#: plugin): the handlers below and the middleware answer these for every route.
ERROR_STATUSES = {
    400: "A request field is invalid (`param` names it), or the body is not JSON.",
    401: "The API key is missing or wrong (when the server requires one).",
    404: "Unknown model or resource.",
    413: "The request body is larger than the server accepts.",
    500: "An unexpected error; the message carries the request id.",
    503: "The engine is not running, the server is shutting down, or it is at its "
         "queue limit (then `Retry-After` says when to retry).",
}
#: The OpenAPI schema of every error body.
ERROR_SCHEMA: dict[str, Any] = {
    "title": "ErrorResponse", "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                       "code": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}},
}


class OpenAIError(Exception):
    """An error answered as OpenAI-shaped JSON with `status` (raise it from a route)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or error_type(status)
        self.headers = headers


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was ready (its request was aborted)."""


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status."""
    if status >= 500:
        return SERVER_ERROR
    return _TYPE_BY_STATUS.get(status, INVALID_REQUEST)


def error_body(status: int, message: str, *, param: str | None = None,
               code: str | None = None, type: str | None = None) -> bytes:
    """The JSON body of an error response."""
    return msgspec.json.encode({"error": {
        "message": message, "type": type or error_type(status), "param": param, "code": code,
    }})


def error_response(status: int, message: str, *, param: str | None = None,
                   code: str | None = None, type: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(status, message, param=param, code=code, type=type),
                    status_code=status, headers=headers, media_type="application/json")


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error the app raises in the OpenAI shape, and say so in the app's
    OpenAPI schema."""
    _document_errors(app)
    app.add_exception_handler(OpenAIError, _openai_error)  # type: ignore[arg-type]
    app.add_exception_handler(InvalidParameterError, _invalid_parameter)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_exception)  # type: ignore[arg-type]
    app.add_exception_handler(RequestRejectedError, _rejected)  # type: ignore[arg-type]
    app.add_exception_handler(ClientDisconnected, _client_disconnected)
    app.add_exception_handler(ClientDisconnect, _client_disconnected)  # while reading the body


def _document_errors(app: FastAPI) -> None:
    """/openapi.json lists `ERROR_STATUSES` with `ERROR_SCHEMA` on every operation (plugin
    routes included, as they are built when the schema is first asked for), in place of
    FastAPI's 422 `HTTPValidationError`, which this app never sends."""
    build_schema = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            _add_error_responses(build_schema())
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_error_responses(schema: dict[str, Any]) -> None:
    schema.setdefault("components", {}).setdefault("schemas", {})["ErrorResponse"] = \
        ERROR_SCHEMA
    content = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path_item in schema.get("paths", {}).values():
        for operation in path_item.values():
            responses = operation.setdefault("responses", {})
            if responses.get("422", {}).get("description") == "Validation Error":
                del responses["422"]  # FastAPI's own: this app answers 400 instead
            for status, description in ERROR_STATUSES.items():
                if str(status) not in responses:
                    responses[str(status)] = {"description": description, "content": content}


async def _client_disconnected(request: Request, exc: Exception) -> Response:
    # Nobody reads this; 499 ("client closed request") is what access logs show for it.
    return Response(status_code=499)


async def _openai_error(request: Request, exc: OpenAIError) -> Response:
    return error_response(exc.status, exc.message, param=exc.param, code=exc.code,
                          type=exc.type, headers=exc.headers)


async def _rejected(request: Request, exc: RequestRejectedError) -> Response:
    return error_response(503, str(exc), code=exc.code,
                          headers={"Retry-After": str(exc.retry_after_s)})


async def _invalid_parameter(request: Request, exc: InvalidParameterError) -> Response:
    return error_response(400, str(exc), param=exc.param)


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    errors = list(exc.errors())
    if any(err.get("type") == "json_invalid" for err in errors):
        detail = errors[0].get("ctx", {}).get("error", "")
        return error_response(400, f"The request body is not valid JSON: {detail}".rstrip(": "),
                              code="json_invalid")
    first = errors[0] if errors else {}
    param = _param_name(first.get("loc", ()))
    message = "; ".join(_describe(err) for err in errors) or "Invalid request."
    return error_response(400, message, param=param)


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    if status == 404 and exc.detail == "Not Found":
        message = f"Unknown request URL: {request.method} {request.url.path}."
        return error_response(404, message, code="unknown_url", headers=_headers(exc))
    if status == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}."
        return error_response(405, message, code="method_not_allowed", headers=_headers(exc))
    return error_response(status, str(exc.detail), headers=_headers(exc))


def _headers(exc: HTTPException) -> dict[str, str] | None:
    return dict(exc.headers) if exc.headers else None


def _param_name(loc: Any) -> str | None:
    """The request field an error is about: its top-level name (OpenAI's `param`)."""
    parts = _field_path(loc)
    return parts[0] if parts else None


def _field_path(loc: Any) -> list[str]:
    return [str(part) for part in loc if part not in ("body", "query", "path", "header")]


def _describe(err: dict[str, Any]) -> str:
    where = ".".join(_field_path(err.get("loc", ())))
    message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{where}: {message}" if where else message
