"""Logits processors where the sampler is built (docs/plugins.md, "vllm.logits_processors").

The group's rules (sources, order, CUDA hidden at import, a failure stopping start-up) are
gateway.plugins.groups'; this module keeps the classes this process loaded, so that the
engine core, which validates each new request's parameters, uses the classes its in-process
worker loaded (`uni` executor) instead of importing them a second time.
"""

from __future__ import annotations

from gateway.config import ModelConfig
from gateway.plugins.contracts import LogitsProcessor
from gateway.plugins.groups import COMMAND_LINE
from gateway.plugins.groups import load_logits_processor_classes as _load
from gateway.plugins.loader import LOGITS_PROCESSORS_GROUP
from gateway.plugins.process import load_report, this_process
from gateway.sampling_params import InvalidParameterError, SamplingParams

__all__ = ["COMMAND_LINE", "class_name", "load_logits_processor_classes",
           "processor_classes_for_validation", "validate_request"]

def load_logits_processor_classes(model_config: ModelConfig) -> list[type[LogitsProcessor]]:
    """The classes a sampler runs: plugins first, then `--logits-processors`, each once.

    Raises PluginError or TypeError naming the processor and this process (rule 10)."""
    classes = _load(model_config.logits_processors)
    this_process().sampler_logits_processors[tuple(model_config.logits_processors)] = classes
    return classes


def processor_classes_for_validation(model_config: ModelConfig) -> list[type[LogitsProcessor]]:
    """The classes whose `validate_params` the engine core runs on each new request: the
    ones a sampler in this process loaded, else (the workers are other processes) the same
    classes loaded here for their classmethods alone, with CUDA hidden as always."""
    cached = this_process().sampler_logits_processors.get(tuple(model_config.logits_processors))
    if cached is not None:
        return list(cached)
    classes = _load(model_config.logits_processors)
    for rec in load_report().records(LOGITS_PROCESSORS_GROUP):
        if rec.outcome == "loaded":
            rec.detail = "for validate_params only (the sampler is in the worker processes)"
    return classes


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
