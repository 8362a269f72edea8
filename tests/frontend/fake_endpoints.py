"""Source of a fake endpoint-plugin distribution, one entry point per behaviour under test.

Written into a temporary site folder by `write_fake_endpoints` (a real dist-info with entry
points), so the server finds these plugins exactly as it finds an installed one.
"""

from __future__ import annotations

from pathlib import Path

from gateway.plugins import ENDPOINT_PLUGINS_GROUP, GENERAL_PLUGINS_GROUP
from tests.plugin_dists import write_dist

MODULE = "gw_test_endpoints"
GENERAL_NAME = "gw_test_general"  # a no-op general plugin in the same distribution

SOURCE = '''
from fastapi import APIRouter, FastAPI


class RoutePlugin:
    """Adds one route answering {"plugin": name}; can fail at attach or init."""

    def __init__(self, name, path, method="GET", required_tasks=None, fail_attach=False,
                 fail_init=False, crash=False):
        self.name, self.path, self.method = name, path, method
        self.required_tasks = required_tasks
        self.fail_attach, self.fail_init, self.crash = fail_attach, fail_init, crash

    def attach_router(self, app: FastAPI) -> None:
        router = APIRouter()

        async def handler():
            if self.crash:
                raise RuntimeError("SECRET-TRACEBACK-DETAIL")
            return {"plugin": self.name}

        router.add_api_route(self.path, handler, methods=[self.method],
                             summary=f"plugin {self.name}")
        app.include_router(router)
        if self.fail_attach:
            raise RuntimeError("attach exploded")

    async def init_state(self, engine_client, state, args):
        if self.fail_init:
            raise RuntimeError("init exploded")
        setattr(state, self.name.replace("-", "_") + "_ready", engine_client is not None)


def hello():
    return RoutePlugin("hello-plugin", "/v1/hello")


def needs_embed():
    return RoutePlugin("needs_embed", "/v1/embed-thing", required_tasks=("embed",))


def factory_raises():
    raise RuntimeError("factory exploded")


def not_a_plugin():
    return object()


def attach_raises():
    return RoutePlugin("attach_raises", "/v1/half-attached", fail_attach=True)


def init_raises():
    return RoutePlugin("init_raises", "/v1/init-broken", fail_init=True)


def replaces_models():
    return RoutePlugin("replaces_models", "/v1/models")


def replaces_detokenize_then_fails():
    return RoutePlugin("replaces_detokenize", "/detokenize", method="POST", fail_init=True)


def crashes():
    return RoutePlugin("crashes", "/v1/crash", crash=True)


def twin_a():
    return RoutePlugin("twin_a", "/v1/twin")


def twin_b():
    return RoutePlugin("twin_b", "/v1/twin")


def general():
    """A general plugin doing nothing: every process records it (engine core too)."""
'''

#: entry-point name -> factory; every behaviour the tests name.
ENTRY_POINTS = {
    "hello": "hello",
    "needs_embed": "needs_embed",
    "factory_raises": "factory_raises",
    "not_a_plugin": "not_a_plugin",
    "attach_raises": "attach_raises",
    "init_raises": "init_raises",
    "replaces_models": "replaces_models",
    "replaces_detokenize": "replaces_detokenize_then_fails",
    "crashes": "crashes",
    "twin_a": "twin_a",
    "twin_b": "twin_b",
}


def write_fake_endpoints(site: Path, names: list[str] | None = None) -> Path:
    """Write the distribution `gw-test-endpoints` with the endpoint entry points `names`
    (all by default), and the no-op general plugin, into `site`."""
    chosen = names if names is not None else list(ENTRY_POINTS)
    entry_points = {name: f"{MODULE}:{ENTRY_POINTS[name]}" for name in chosen}
    return write_dist(site, "gw-test-endpoints", {
        ENDPOINT_PLUGINS_GROUP: entry_points,
        GENERAL_PLUGINS_GROUP: {GENERAL_NAME: f"{MODULE}:general"},
    }, {MODULE: SOURCE})
