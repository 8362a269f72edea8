"""The current platform (any process that reads it), resolved lazily the first time
`current_platform` is read (rule 7).

`current_platform` is an instance of the chosen Platform class, as in vLLM. How it is
chosen (docs/plugins.md, "vllm.platform_plugins"): `VLLM_TARGET_DEVICE=cpu` selects the
CPU before the platform plugin group is even loaded; any other value (vLLM's default is
"cuda") or none runs detection: the allowed `vllm.platform_plugins` and the built-in
detectors. One activated out-of-tree platform wins over the built-ins; two or more are an
error naming them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway import envs
from gateway.logger import init_logger
from gateway.platforms.cpu import cpu_platform_plugin
from gateway.platforms.cuda import cuda_platform_plugin
from gateway.platforms.interface import Platform
from gateway.plugins.groups import resolve_qualname
from gateway.plugins.loader import PLATFORM_PLUGINS_GROUP, PluginError, load_plugins_by_group
from gateway.plugins.loader import record as record_outcome

logger = init_logger(__name__)

if TYPE_CHECKING:
    current_platform: Platform

_CPU = "gateway.platforms.cpu.CpuPlatform"
_current: Platform | None = None


def resolve_platform_qualname() -> str:
    if envs.target_device() == "cpu":
        return _CPU
    activated: dict[str, str] = {}
    for name, detector in load_plugins_by_group(PLATFORM_PLUGINS_GROUP).items():
        try:
            qualname = detector()
        except Exception as exc:
            record_outcome(PLATFORM_PLUGINS_GROUP, name, "call-failed", error=repr(exc))
            raise PluginError(
                f"Platform plugin {name!r} raised while detecting: {exc!r}. (vLLM would "
                "skip it silently; the gateway stops so that a broken detector cannot pick "
                "the wrong device: see docs/plugins.md, 'Differences from vLLM'.)") from exc
        record_outcome(PLATFORM_PLUGINS_GROUP, name, "active" if qualname else "inactive",
                       detail=qualname)
        if qualname:
            activated[name] = qualname
    if len(activated) > 1:
        raise PluginError("Only one out-of-tree platform may be active, but these activated: "
                          + ", ".join(f"{n} ({q})" for n, q in activated.items()))
    if activated:
        name, qualname = next(iter(activated.items()))
        logger.info("Platform plugin %s is activated", name)
        return qualname
    return cuda_platform_plugin() or cpu_platform_plugin()


def _make_platform(qualname: str) -> Platform:
    cls = resolve_qualname(qualname)
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        raise PluginError(f"Platform {qualname} is not a subclass of gateway's Platform")
    return cls()


def get_current_platform() -> Platform:
    global _current
    if _current is None:
        _current = _make_platform(resolve_platform_qualname())
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
