"""Choosing and making the IO processor (rule 8), in the front end, before the engine
starts: a named plugin that is missing stops start-up without waiting for a model load."""

from __future__ import annotations

from typing import Any

from gateway.config import EngineConfig
from gateway.models.info.paths import ModelInfo, read_model_info
from gateway.plugins import IO_PROCESSOR_PLUGINS_GROUP, IOProcessor, PluginError
from gateway.plugins.groups import load_io_processor
from gateway.plugins.loader import record


def io_processor_name(config: EngineConfig, model_info: ModelInfo | None = None) -> str | None:
    """`--io-processor-plugin`, else the model config's `io_processor_plugin` (read from
    `model_info`, or from the model when not given), else None."""
    if config.model.io_processor_plugin:
        return config.model.io_processor_plugin
    info = model_info if model_info is not None else read_model_info(config.model.model)
    return info.io_processor_plugin


def make_io_processor(config: EngineConfig, model_info: ModelInfo | None = None,
                      ) -> IOProcessor[Any, Any] | None:
    """The IO processor the config names, made with the engine config; None when none is
    named. Raises PluginError when the named one cannot be loaded or made."""
    name = io_processor_name(config, model_info)
    cls = load_io_processor(name)
    if cls is None or name is None:
        return None
    try:
        return cls(config)
    except Exception as exc:
        record(IO_PROCESSOR_PLUGINS_GROUP, name, "init-failed",
               error=f"{type(exc).__name__}: {exc}")
        raise PluginError(f"IO processor plugin {name!r} ({cls.__module__}."
                          f"{cls.__qualname__}) failed to initialise: "
                          f"{type(exc).__name__}: {exc}") from exc
