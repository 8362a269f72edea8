"""Request bodies parsed without stalling the event loop (API-server process).

FastAPI parses a JSON body with `json.loads` on the event loop, so a body of millions of
token ids held every stream still. A route of `JSONBodyRoute` parses its body model first:
a small body with pydantic's JSON parser straight from the bytes (`model_validate_json`),
a large one in a thread where the interpreter hands the GIL back to the loop every few
milliseconds (`_parse_large`: long lists validated a slice at a time). Whatever is wrong
(not JSON, nested too deep, a bad field) becomes FastAPI's validation error, answered 400.
`OffLoopJSONRequest.json()` parses the same way for routes that read the body themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import sys
import threading
import traceback
import types
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, Union, get_args, get_origin

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from gateway.frontend.memory import trim_heaps

#: Bodies up to this size are parsed on the loop, by pydantic's parser: at C speed, they
#: hold it for less than a thread hop would cost.
OFF_LOOP_BYTES = 64 * 1024
#: A top-level list longer than this is validated this many items at a time, so that the
#: loop gets the GIL between slices (400,000 chat messages took 3 s to validate).
SLICE_ITEMS = 1024

Handler = Callable[[Request], Coroutine[Any, Any, Response]]


class JSONBodyRoute(APIRoute):
    """An APIRoute whose one body parameter, a pydantic model, is parsed by
    `parse_json_body` before FastAPI's handler runs (which then finds it done); any other
    JSON body (several body parameters, or a `Request` whose `json()` the route awaits) is
    parsed by `OffLoopJSONRequest.json()`. Endpoint plugins may use it as their routers'
    `route_class` (docs/plugins.md)."""

    def get_route_handler(self) -> Handler:
        handler = super().get_route_handler()
        model = _body_model(self)

        async def parse_then_handle(request: Request) -> Response:
            parsed = OffLoopJSONRequest(request.scope, request.receive)
            with _skipped_by_collector():
                try:
                    if model is not None:
                        await parse_json_body(parsed, model)
                    return await handler(parsed)
                except Exception as exc:  # its frames' locals would keep the body alive
                    traceback.clear_frames(exc.__traceback__)
                    raise
                finally:
                    await _free_off_loop(parsed)
                    if len(getattr(parsed, "_body", b"")) > OFF_LOOP_BYTES:
                        await asyncio.to_thread(trim_heaps)

        return parse_then_handle


class OffLoopJSONRequest(Request):
    """A request whose `json()` is the model already validated from its body, if any; else
    the body parsed as Starlette parses it (the same values and errors), off the loop when
    it is large."""

    parsed: Any = None

    async def json(self) -> Any:
        if self.parsed is not None:
            return self.parsed
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) <= OFF_LOOP_BYTES:
                self._json = json.loads(body)
            else:
                self._json = await asyncio.to_thread(_loads_paused, body)
        return self._json



async def parse_json_body(request: OffLoopJSONRequest, model: type[BaseModel]) -> None:
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


async def _free_off_loop(request: OffLoopJSONRequest) -> None:
    """Free the long lists of the request's parsed body a slice at a time in a thread,
    where nothing else holds the body or the list any more: freeing 400,000 chat messages
    at once held the loop 0.3 s. (Where something still holds them, e.g. a stream that is
    not over, they are freed as ever when that lets go.)"""
    body, request.parsed = request.parsed, None
    if not isinstance(body, BaseModel) or _num_holders(body) != _ONE_HOLDER:
        return
    fields = vars(body)
    names = [name for name, value in fields.items()
             if isinstance(value, list) and len(value) > SLICE_ITEMS]
    if names and all(_num_holders(fields[name]) == _ONE_HOLDER for name in names):
        lists = [fields[name] for name in names]
        del body, fields
        await asyncio.to_thread(_empty_in_slices, lists)


def _num_holders(value: Any) -> int:
    """References to `value`, counting the caller's one as this function's (the count
    with no other holder is measured at import: it differs across Python versions)."""
    return sys.getrefcount(value)


def _calibrate() -> int:
    fields: dict[str, list[Any]] = {"items": []}
    return _num_holders(fields["items"])


_ONE_HOLDER = _calibrate()


def _empty_in_slices(lists: list[list[Any]]) -> None:
    for items in lists:
        while items:
            del items[-SLICE_ITEMS:]


def _parsed_by_pydantic(model: type[BaseModel], body: bytes, request: OffLoopJSONRequest
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
    with _collector_paused():
        return _parse_large_unpaused(model, body)


def _parse_large_unpaused(model: type[BaseModel], body: bytes) -> BaseModel:
    try:
        value = _loads_yielding(body)
    except json.JSONDecodeError as exc:
        raise _not_json(f"{exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise _not_json("it is nested too deeply to parse") from None
    except UnicodeDecodeError:
        raise _not_json("it is not UTF-8 text") from None
    if isinstance(value, dict):
        _validate_long_lists(model, value)
    return model.model_validate(value)


_paused_lock = threading.Lock()
_num_paused = 0  # parses under way with the cyclic collector paused
_collector_was_enabled = False


_num_frozen = 0  # requests under way that may have frozen a large body's objects
_froze = False  # whether a parse froze objects since the last such request ended


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a large body is parsed: it ran full
    collections over the millions of new objects, each holding the GIL (so the loop) for
    0.5 to 1 s. What the parse made is then frozen (`gc.freeze`, which costs nothing),
    so that later collections skip it, until `_skipped_by_collector` ends."""
    global _num_paused, _collector_was_enabled, _froze
    with _paused_lock:
        if _num_paused == 0:
            _collector_was_enabled = gc.isenabled()
            gc.disable()
        _num_paused += 1
    try:
        yield
    finally:
        with _paused_lock:
            _num_paused -= 1
            gc.freeze()
            _froze = True
            if _num_paused == 0 and _collector_was_enabled:
                gc.enable()


@contextlib.contextmanager
def _skipped_by_collector() -> Iterator[None]:
    """While a request with a large body is handled: the objects frozen meanwhile go back
    to the collector when the last such request ends (freed ones are simply gone; nothing
    is lost, collection is only put off)."""
    global _num_frozen, _froze
    with _paused_lock:
        _num_frozen += 1
    try:
        yield
    finally:
        with _paused_lock:
            _num_frozen -= 1
            if _num_frozen == 0 and _froze:
                gc.unfreeze()
                _froze = False


def _loads_yielding(body: bytes) -> Any:
    """`json.loads`, with a Python call per number and per object, where the interpreter
    may switch threads (a body of strings alone is parsed in one piece, about 0.2 s at the
    16 MiB cap)."""
    return json.loads(body, parse_int=_parse_int, parse_float=_parse_float,
                      object_hook=_object)


def _loads_paused(body: bytes) -> Any:
    with _collector_paused():
        return _loads_yielding(body)


def _object(value: dict[str, Any]) -> dict[str, Any]:
    return value


def _validate_long_lists(model: type[BaseModel], value: dict[str, Any]) -> None:
    """Validate each top-level field of `value` that is a long list of one item type, a
    slice at a time, in place (pydantic then takes the validated items as they are);
    RequestValidationError with the item's place in the whole list."""
    for name, info in model.model_fields.items():
        key = info.alias or name
        items = value.get(key)
        if not isinstance(items, list) or len(items) <= SLICE_ITEMS:
            continue
        adapter = _list_adapter(info.annotation)  # type: ignore[arg-type]
        if adapter is None:
            continue
        slices: list[list[Any]] = []
        for start in reversed(range(0, len(items), SLICE_ITEMS)):  # last first, freed
            try:
                slices.append(adapter.validate_python(items[start:]))
            except ValidationError as exc:
                raise RequestValidationError([_in_list(error, key, start) for error in
                                              exc.errors(include_url=False,
                                                         include_input=False)]) from None
            del items[start:]  # what is validated is freed a slice at a time
        value[key] = [item for part in reversed(slices) for item in part]


@functools.cache
def _list_adapter(annotation: Any) -> TypeAdapter[Any] | None:
    """A strict validator of `list[X]` for a field annotated `list[X]` or `list[X] | None`
    whose items are pydantic models (slow to validate; numbers and strings are not)."""
    if get_origin(annotation) in (Union, types.UnionType):
        members = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(members) != 1:
            return None
        annotation = members[0]
    if get_origin(annotation) is not list:
        return None
    (item,) = get_args(annotation) or (Any,)
    if not (isinstance(item, type) and issubclass(item, BaseModel)):
        return None
    return TypeAdapter(list[item])  # type: ignore[valid-type]


def _in_list(error: Any, key: str, start: int) -> dict[str, Any]:
    error = dict(error)
    index, *rest = error.get("loc", (0,))
    error["loc"] = ("body", key, start + index if isinstance(index, int) else index, *rest)
    return error


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
