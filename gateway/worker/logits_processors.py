"""Loading and validating logits-processor classes (DESIGN.md rule 10).

Two sources, in this order: the `vllm.logits_processors` entry points (never filtered by
VLLM_PLUGINS) and the "module:Class" names of `ModelConfig.logits_processors` (the command
line). Unlike the other groups, a processor that fails to load stops start-up: serving
without it would silently change outputs. The worker loads the classes when it builds its
sampler; the engine core loads them too, to validate each new request's parameters.
"""

from __future__ import annotations

import importlib
import os
import time
from typing import Any

from gateway.config import ModelConfig
from gateway.plugins import discovery, loader
from gateway.plugins.contracts import LogitsProcessor
from gateway.plugins.loader import LOGITS_PROCESSORS_GROUP, PluginError
from gateway.plugins.load_report import FAILED_OUTCOMES, process_role
from gateway.sampling_params import InvalidParameterError, SamplingParams

# The load report's distribution for processors named on the command line.
COMMAND_LINE = "<command line>"


def load_logits_processor_classes(model_config: ModelConfig) -> list[type[LogitsProcessor]]:
    """Every logits-processor class to run, plugins first, each class once.

    Raises PluginError when a plugin or named class fails to import, and TypeError when an
    object is not a `LogitsProcessor` subclass; both messages name it and this process.
    """
    classes = _load_plugin_classes()
    for qualname in model_config.logits_processors:
        classes.append(_load_named_class(qualname))
    return list(dict.fromkeys(classes))  # the same class named twice runs once


def validate_request(processor_classes: list[type[LogitsProcessor]], params: SamplingParams,
                     vocab_size: int | None = None) -> None:
    """Run each processor's `validate_params` on a new request's parameters.

    A ValueError becomes an InvalidParameterError (HTTP 400) naming the parameter: the
    processor's own when it raised InvalidParameterError, else `extra_args`, where
    processors read their per-request arguments. Given `vocab_size`, the token ids of
    `logit_bias` are checked too (else the worker fails such a request with a 500).
    """
    if vocab_size is not None:
        _check_logit_bias(params, vocab_size)
    for cls in processor_classes:
        try:
            cls.validate_params(params)
        except InvalidParameterError:
            raise
        except ValueError as exc:
            raise InvalidParameterError(
                "extra_args", f"{exc} (rejected by logits processor {class_name(cls)})"
            ) from exc


def _check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    for token_id in params.logit_bias or {}:
        if not 0 <= token_id < vocab_size:
            raise InvalidParameterError("logit_bias", f"logit_bias names token id {token_id}, "
                                        f"outside the vocabulary [0, {vocab_size})")


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _load_plugin_classes() -> list[type[LogitsProcessor]]:
    loaded = loader.load_plugins_by_group(LOGITS_PROCESSORS_GROUP)
    failed = [r for r in loader.report.records(LOGITS_PROCESSORS_GROUP)
              if r.outcome in FAILED_OUTCOMES and r.distribution != COMMAND_LINE]
    if failed:
        raise PluginError("; ".join(
            f"Logits processor plugin {r.name!r} (group {r.group}, distribution "
            f"{r.distribution}) failed to load in process {r.process_role} (pid {r.pid}): "
            f"{r.outcome}: {r.error}" for r in failed)
            + ". A logits processor that does not load stops start-up (it would change "
              "outputs silently).")
    classes = []
    for name, obj in loaded.items():
        if not _is_processor_class(obj):
            plugin = _discovered(name)
            problem = f"{obj!r} is not a subclass of gateway.plugins.LogitsProcessor"
            loader.record(LOGITS_PROCESSORS_GROUP, name, "invalid-plugin", error=problem)
            raise TypeError(f"Logits processor {loader.where(plugin)}: {problem}.")
        classes.append(obj)
    return classes


def _load_named_class(qualname: str) -> type[LogitsProcessor]:
    """Import "module:Class" (or "module.Class") named by `--logits-processors`."""
    module_name, sep, attr = qualname.partition(":")
    if not sep:
        module_name, _, attr = qualname.rpartition(".")
    here = f"in process {process_role()} (pid {os.getpid()})"
    if not module_name or not attr:
        raise PluginError(f"Logits processor {qualname!r} named by --logits-processors is "
                          f"not of the form 'module:Class' ({here}).")
    start = time.perf_counter()
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a SystemExit at import must name the class too
        error = f"{type(exc).__name__}: {exc}"
        _record_named(qualname, "import-failed", error=error)
        raise PluginError(f"Logits processor {qualname!r} named by --logits-processors "
                          f"failed to load {here}: {error}") from exc
    if not _is_processor_class(obj):
        problem = f"{obj!r} is not a subclass of gateway.plugins.LogitsProcessor"
        _record_named(qualname, "invalid-plugin", error=problem)
        raise TypeError(f"Logits processor {qualname!r} named by --logits-processors "
                        f"{here}: {problem}.")
    _record_named(qualname, "loaded", load_time_s=time.perf_counter() - start)
    return obj  # type: ignore[no-any-return]


def _is_processor_class(obj: object) -> bool:
    return isinstance(obj, type) and issubclass(obj, LogitsProcessor)


def _discovered(name: str) -> discovery.DiscoveredPlugin:
    for plugin in discovery.discover(LOGITS_PROCESSORS_GROUP):
        if plugin.name == name:
            return plugin
    return discovery.DiscoveredPlugin(LOGITS_PROCESSORS_GROUP, name, "", "<not installed>")


def _record_named(qualname: str, outcome: str, **kwargs: Any) -> None:
    loader.report.record(LOGITS_PROCESSORS_GROUP, qualname, qualname, COMMAND_LINE, outcome,
                         **kwargs)
