"""Request bodies parsed without stalling the event loop (API-server process).

FastAPI parses a JSON body with `json.loads` on the event loop, so a body of millions of
token ids held every stream still. A route of `JSONBodyRoute` parses its body model first:
a small body with pydantic's JSON parser straight from the bytes (`model_validate_json`),
a large one in a thread where the interpreter hands the GIL back to the loop every few
milliseconds (`_parse_large`). Whatever is wrong (not JSON, nested too deep, a bad field)
becomes FastAPI's validation error, answered 400.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

#: Bodies up to this size are parsed on the loop, by pydantic's parser: at C speed, they
#: hold it for less than a thread hop would cost.
OFF_LOOP_BYTES = 64 * 1024

Handler = Callable[[Request], Coroutine[Any, Any, Response]]


class JSONBodyRoute(APIRoute):
    """An APIRoute whose one body parameter, a pydantic model, is parsed by
    `parse_json_body` before FastAPI's handler runs (which then finds it done)."""

    def get_route_handler(self) -> Handler:
        handler = super().get_route_handler()
        model = _body_model(self)
        if model is None:
            return handler

        async def parse_then_handle(request: Request) -> Response:
            parsed = _ParsedRequest(request.scope, request.receive)
            await parse_json_body(parsed, model)
            return await handler(parsed)

        return parse_then_handle


class _ParsedRequest(Request):
    """A request whose `json()` is the model already validated from its body."""

    parsed: Any = None

    async def json(self) -> Any:
        if self.parsed is None:
            return await super().json()
        return self.parsed


async def parse_json_body(request: _ParsedRequest, model: type[BaseModel]) -> None:
    """Validate the request's JSON body as `model` (see the module doc);
    RequestValidationError with FastAPI's locations ("body", field, ...) when it is not one.
    A body that is empty or declared as another media type is left to FastAPI."""
    body = await request.body()
    if not body or not _is_json(request.headers.get("content-type")):
        return
    try:
        if len(body) <= OFF_LOOP_BYTES and _parsed_by_pydantic(model, body, request):
            return
        request.parsed = await asyncio.to_thread(_parse_large, model, body)
    except ValidationError as exc:
        raise RequestValidationError([_in_body(error) for error in exc.errors(
            include_url=False, include_input=False)]) from None


def _parsed_by_pydantic(model: type[BaseModel], body: bytes, request: _ParsedRequest
                        ) -> bool:
    """Parse `body` with pydantic's parser into `request.parsed`; False when it nests past
    that parser's depth limit, which is lower than Python's: such a body takes the other
    path, so that what parses there (a deep `vllm_xargs`) is judged by its field."""
    try:
        request.parsed = model.model_validate_json(body)
    except ValidationError as exc:
        if any(error["type"] == "json_invalid" and "recursion limit" in error["msg"]
               for error in exc.errors(include_url=False, include_input=False)):
            return False
        raise
    return True


def _parse_large(model: type[BaseModel], body: bytes) -> BaseModel:
    """A C parser keeps the GIL for the whole body, which stalls the loop as surely as
    parsing on it; here every number is made by a Python function, so the interpreter
    switches threads as it parses, and only the validation runs in one piece."""
    try:
        value = json.loads(body, parse_int=_parse_int, parse_float=_parse_float)
    except json.JSONDecodeError as exc:
        raise _not_json(f"{exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise _not_json("it is nested too deeply to parse") from None
    except UnicodeDecodeError:
        raise _not_json("it is not UTF-8 text") from None
    return model.model_validate(value)


def _parse_int(text: str) -> int:
    return int(text)


def _parse_float(text: str) -> float:
    return float(text)


def _not_json(why: str) -> RequestValidationError:
    return RequestValidationError([{"type": "json_invalid", "loc": ("body",),
                                    "msg": f"Invalid JSON: {why}", "ctx": {"error": why}}])


def _in_body(error: Any) -> dict[str, Any]:
    error = dict(error)
    error["loc"] = ("body", *error.get("loc", ()))
    return error


def _is_json(content_type: str | None) -> bool:
    """FastAPI's rule: no content type, or application/json or application/*+json."""
    if not content_type:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                            and media.endswith("+json"))


def _body_model(route: APIRoute) -> type[BaseModel] | None:
    """The pydantic model of the route's single body parameter, if it has one."""
    params = route.dependant.body_params
    if len(params) != 1 or getattr(params[0].field_info, "embed", False):
        return None
    annotation: Any = params[0].field_info.annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None
