"""The model registry: architecture name -> model class (rule 11).

Entries are classes or lazy "module:Class" strings, imported only when the architecture is
first resolved. General plugins register out-of-tree architectures here; because every
worker loads the general plugins itself, such a model runs in the workers.
"""

from __future__ import annotations

import importlib
from typing import Any

from gateway.logger import init_logger

logger = init_logger(__name__)

# Built-in architectures, by the `architectures` name in a model's config. Every decoder
# family is the one decoder (archs/decoder.py), under a subclass named as HF names it.
_BUILTIN_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "gateway.models.archs.decoder:LlamaForCausalLM",
    "MistralForCausalLM": "gateway.models.archs.decoder:MistralForCausalLM",
    "Qwen2ForCausalLM": "gateway.models.archs.decoder:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "gateway.models.archs.decoder:Qwen3ForCausalLM",
    "Gemma3ForCausalLM": "gateway.models.archs.decoder:Gemma3ForCausalLM",
    "Phi3ForCausalLM": "gateway.models.archs.decoder:Phi3ForCausalLM",
    "Qwen3MoeForCausalLM": "gateway.models.archs.decoder:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "gateway.models.archs.decoder:MixtralForCausalLM",
    "BertModel": "gateway.models.archs.bert:BertModel",
    "RobertaModel": "gateway.models.archs.roberta:RobertaModel",
    "XLMRobertaModel": "gateway.models.archs.roberta:XLMRobertaModel",
    "BertForSequenceClassification":
        "gateway.models.archs.classifier:BertForSequenceClassification",
    "RobertaForSequenceClassification":
        "gateway.models.archs.classifier:RobertaForSequenceClassification",
    "XLMRobertaForSequenceClassification":
        "gateway.models.archs.classifier:XLMRobertaForSequenceClassification",
}


class _ModelRegistry:
    def __init__(self, entries: dict[str, Any]) -> None:
        self._entries: dict[str, Any] = dict(entries)

    def register_model(self, arch: str, model_cls: type | str) -> None:
        """Register `model_cls` (a class or "module:Class") under `arch`.

        A second registration of the same name replaces the first, with a log line.
        """
        if not isinstance(arch, str) or not arch:
            raise ValueError(f"architecture name must be a non-empty string, got {arch!r}")
        if isinstance(model_cls, str) and ":" not in model_cls:
            raise ValueError(f"lazy model {model_cls!r} for {arch!r} must be 'module:Class'")
        if arch in self._entries:
            logger.warning("Model architecture %s is already registered (%s); "
                           "it is replaced by %s.", arch, _describe(self._entries[arch]),
                           _describe(model_cls))
        self._entries[arch] = model_cls

    def get_supported_archs(self) -> list[str]:
        return sorted(self._entries)

    def is_registered(self, arch: str) -> bool:
        return arch in self._entries

    def is_builtin(self, arch: str) -> bool:
        """Whether `arch` is served by the gateway's own class (not replaced by a plugin)."""
        entry, builtin = self._entries.get(arch), _BUILTIN_MODELS.get(arch)
        return builtin is not None and entry is not None and _describe(entry) == builtin

    def first_registered(self, archs: list[str]) -> str | None:
        """The first of `archs` that is registered (the one resolve_model_cls would load)."""
        return next((arch for arch in archs if arch in self._entries), None)

    def resolve_model_cls(self, archs: str | list[str]) -> tuple[type, str]:
        """Return (class, arch) for the first of `archs` that is registered.

        Raises ValueError listing the registered architectures when none is.
        """
        names = [archs] if isinstance(archs, str) else list(archs)
        for arch in names:
            if arch in self._entries:
                return self._load(arch), arch
        raise ValueError(f"Model architectures {names} are not supported. "
                         f"Registered architectures: {', '.join(self.get_supported_archs())}")

    def _load(self, arch: str) -> type:
        entry = self._entries[arch]
        if isinstance(entry, str):
            module_name, _, attr = entry.partition(":")
            try:
                entry = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError) as exc:
                raise ValueError(f"Model architecture {arch!r} is registered as "
                                 f"{self._entries[arch]!r}, which cannot be imported: {exc}"
                                 ) from exc
            self._entries[arch] = entry  # resolved once per process
        return entry


def _describe(entry: Any) -> str:
    return entry if isinstance(entry, str) else f"{entry.__module__}:{entry.__qualname__}"


ModelRegistry = _ModelRegistry(_BUILTIN_MODELS)
