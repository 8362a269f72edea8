"""Attaching endpoint plugins to the app: isolation, route conflicts and the init phase.

Runs in the API-server process while the app is built, after every core route is attached
(docs/plugins.md, "vllm.endpoint_plugins"). Each `attach_router(app)` is isolated: if it
raises, the app's routes, middleware list and exception handlers are put back as they were
(so routes it added before raising are gone), `attach-failed` is recorded, and the next
plugin attaches. A plugin route with the same path and method as a core route replaces it
(WARNING, and the report says so); two plugins claiming one path and method stop start-up
naming both. Each `init_state` is isolated too (`init_endpoint_plugins`); the plugins that
serve are recorded `attached`.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from starlette.routing import BaseRoute

from gateway.logger import init_logger
from gateway.plugins import ENDPOINT_PLUGINS_GROUP, EndpointPlugin, EngineClient, PluginError
from gateway.plugins.discovery import discover
from gateway.plugins.groups import LoadedEndpointPlugin
from gateway.plugins.loader import error_text, record
from gateway.plugins.process import process_role

logger = init_logger(__name__)

RouteKey = tuple[str, str]  # (path, method); method "*" for a mount or a websocket route


@dataclass
class AttachedPlugin:
    """A plugin whose `attach_router` succeeded, with the routes it owns."""

    entry_name: str  # the entry-point name (what VLLM_PLUGINS lists)
    plugin: EndpointPlugin
    routes: list[BaseRoute] = field(default_factory=list)
    replaced: list[BaseRoute] = field(default_factory=list)  # core routes it took over

    def describe(self) -> str:
        text = "routes: " + (", ".join(_describe_route(r) for r in self.routes) or "none")
        if self.replaced:
            text += "; replaces core " + ", ".join(_describe_route(r) for r in self.replaced)
        return text


def attach_endpoint_plugins(app: FastAPI, plugins: Sequence[LoadedEndpointPlugin]
                            ) -> list[AttachedPlugin]:
    """Call each plugin's `attach_router(app)` in order, isolated, applying the conflict
    rules. Every route already on `app` counts as a core route. Returns the plugins that
    attached; raises `PluginError` when two plugins claim the same path and method."""
    owners: dict[RouteKey, str | None] = {key: None for route in app.router.routes
                                          for key in route_keys(route)}
    attached: list[AttachedPlugin] = []
    for loaded in plugins:
        added = _attach_isolated(app, loaded.entry_name, loaded.plugin)
        if added is None:
            continue
        item = AttachedPlugin(loaded.entry_name, loaded.plugin, added)
        _claim_routes(app, item, owners)
        attached.append(item)
    app.openapi_schema = None
    return attached


def _attach_isolated(app: FastAPI, entry_name: str, plugin: EndpointPlugin
                     ) -> list[BaseRoute] | None:
    routes_before = list(app.router.routes)
    middleware_before = list(app.user_middleware)
    handlers_before = dict(app.exception_handlers)
    try:
        plugin.attach_router(app)
    except Exception as exc:  # noqa: BLE001 - any failure skips this plugin alone
        app.router.routes[:] = routes_before
        app.user_middleware[:] = middleware_before
        app.exception_handlers.clear()
        app.exception_handlers.update(handlers_before)
        logger.error("Endpoint plugin %r: attach_router raised; its routes are removed and "
                     "it is skipped.\n%s", entry_name, traceback.format_exc())
        record(ENDPOINT_PLUGINS_GROUP, entry_name, "attach-failed", error=error_text(exc))
        return None
    before_ids = {id(route) for route in routes_before}
    return [route for route in app.router.routes if id(route) not in before_ids]


def _claim_routes(app: FastAPI, item: AttachedPlugin,
                  owners: dict[RouteKey, str | None]) -> None:
    """Apply the conflict rules to the routes `item` just added, and take ownership."""
    claimed = {key for route in item.routes for key in route_keys(route)}
    for key in sorted(claimed):
        if key in owners and owners[key] is not None:
            raise PluginError(_conflict_message(key, owners[key] or "", item.entry_name))
    added_ids = {id(route) for route in item.routes}
    for route in list(app.router.routes):
        if id(route) not in added_ids and route_keys(route) & claimed:
            app.router.routes.remove(route)
            item.replaced.append(route)
            logger.warning("Endpoint plugin %r replaces the core route %s.", item.entry_name,
                           _describe_route(route))
    for key in claimed:
        owners[key] = item.entry_name
    logger.info("Endpoint plugin %r attached (%s).", item.entry_name, item.describe())


async def init_endpoint_plugins(app: FastAPI, attached: Sequence[AttachedPlugin],
                                engine_client: EngineClient, args: Any) -> list[AttachedPlugin]:
    """Call each attached plugin's `init_state(engine_client, app.state, args)`, isolated.

    Returns the plugins that serve; a failing one loses its routes (the core routes it
    replaced come back) and is recorded `init-failed`.
    """
    serving: list[AttachedPlugin] = []
    for item in attached:
        try:
            await item.plugin.init_state(engine_client, app.state, args)
        except Exception as exc:  # noqa: BLE001 - any failure skips this plugin alone
            _detach(app, item)
            logger.error("Endpoint plugin %r: init_state raised; its routes are removed and "
                         "it is skipped.\n%s", item.entry_name, traceback.format_exc())
            record(ENDPOINT_PLUGINS_GROUP, item.entry_name, "init-failed",
                   error=error_text(exc), detail=item.describe())
            continue
        record(ENDPOINT_PLUGINS_GROUP, item.entry_name, "attached", detail=item.describe())
        serving.append(item)
    app.openapi_schema = None
    return serving


def _detach(app: FastAPI, item: AttachedPlugin) -> None:
    owned = {id(route) for route in item.routes}
    app.router.routes[:] = [r for r in app.router.routes if id(r) not in owned]
    app.router.routes.extend(item.replaced)


def route_keys(route: BaseRoute) -> set[RouteKey]:
    """The (path, method) pairs a route answers. A router included whole (newer FastAPI
    keeps `include_router` as one entry) answers those of every route inside it."""
    contexts = getattr(route, "effective_route_contexts", None)
    if callable(contexts):
        return {key for context in contexts() for key in _keys(context)}
    return _keys(route)


def _keys(route: Any) -> set[RouteKey]:
    path = str(getattr(route, "path", ""))
    methods = getattr(route, "methods", None)
    if not methods:
        return {(path, "*")}
    return {(path, method) for method in methods}


def _describe_route(route: BaseRoute) -> str:
    by_path: dict[str, set[str]] = {}
    for path, method in route_keys(route):
        by_path.setdefault(path, set()).add(method)
    parts = []
    for path, methods in sorted(by_path.items()):
        if len(methods) > 1:
            methods.discard("HEAD")
        parts.append(f"{'|'.join(sorted(methods))} {path}")
    return ", ".join(parts)


def _conflict_message(key: RouteKey, first: str, second: str) -> str:
    path, method = key
    return (f"Endpoint plugins {first!r} ({_distribution(first)}) and {second!r} "
            f"({_distribution(second)}) both add the route {method} {path} "
            f"(group {ENDPOINT_PLUGINS_GROUP}, process {process_role()}, pid {os.getpid()}). "
            "Two plugins may not claim the same path and method: remove one from "
            "VLLM_PLUGINS.")


def _distribution(entry_name: str) -> str:
    for found in discover(ENDPOINT_PLUGINS_GROUP):
        if found.name == entry_name:
            return f"distribution {found.distribution}"
    return "distribution unknown"
