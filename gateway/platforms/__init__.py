"""The current platform, resolved lazily the first time `current_platform` is read (rule 7).

`VLLM_TARGET_DEVICE=cpu` (or `cuda`) selects that built-in before the platform plugin group
is even loaded. Otherwise the built-in detectors and the allowed `vllm.platform_plugins`
run; one activated out-of-tree platform wins over the built-ins; two or more are an error.
"""

from __future__ import annotations

import importlib
from typing import Any

from gateway import envs
from gateway.logger import init_logger
from gateway.platforms.cpu import cpu_platform_plugin
from gateway.platforms.cuda import cuda_platform_plugin
from gateway.platforms.interface import Platform
from gateway.plugins.loader import PLATFORM_PLUGINS_GROUP, PluginError, load_plugins_by_group
from gateway.plugins.loader import record as record_outcome

logger = init_logger(__name__)

_FORCED = {"cpu": "gateway.platforms.cpu.CpuPlatform",
           "cuda": "gateway.platforms.cuda.CudaPlatform"}

_current: type[Platform] | None = None


def resolve_platform_qualname() -> str:
    forced = envs.target_device()
    if forced is not None:
        if forced not in _FORCED:
            raise ValueError(f"VLLM_TARGET_DEVICE={forced!r} is not a known device; "
                             f"use one of {', '.join(_FORCED)}")
        return _FORCED[forced]
    activated: dict[str, str] = {}
    for name, detector in load_plugins_by_group(PLATFORM_PLUGINS_GROUP).items():
        try:
            qualname = detector()
        except Exception as exc:
            record_outcome(PLATFORM_PLUGINS_GROUP, name, "call-failed", error=repr(exc))
            raise PluginError(f"Platform plugin {name!r} raised while detecting: {exc!r}") from exc
        record_outcome(PLATFORM_PLUGINS_GROUP, name, "active" if qualname else "inactive",
                       detail=qualname)
        if qualname:
            activated[name] = qualname
    if len(activated) > 1:
        raise PluginError("Only one out-of-tree platform may be active, but these activated: "
                          + ", ".join(f"{n} ({q})" for n, q in activated.items()))
    if activated:
        return next(iter(activated.values()))
    return cuda_platform_plugin() or cpu_platform_plugin()


def _import_qualname(qualname: str) -> type[Platform]:
    module_name, _, cls_name = qualname.rpartition(".")
    cls = getattr(importlib.import_module(module_name), cls_name)
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        raise PluginError(f"Platform {qualname} is not a subclass of gateway's Platform")
    return cls


def get_current_platform() -> type[Platform]:
    global _current
    if _current is None:
        _current = _import_qualname(resolve_platform_qualname())
        logger.debug("Platform: %s", _current.device_name)
    return _current


def __getattr__(name: str) -> Any:
    if name == "current_platform":
        return get_current_platform()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def reset_for_tests() -> None:
    global _current
    _current = None


__all__ = ["Platform", "current_platform", "get_current_platform"]
