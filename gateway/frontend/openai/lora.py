"""LoRA adapters as the API server knows them (vLLM's serving models): the names a request
may put in `model`, each checked before it is served (--lora-modules at start-up,
/v1/load_lora_adapter, or a resolver plugin's answer), listed by /v1/models with the base
model as parent. A name the server does not know asks the registered LoRA resolvers in
order (each isolated and timed); then 404. docs/lora.md.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass

from gateway import envs
from gateway.config import LoRAConfig
from gateway.frontend.http.errors import OpenAIError
from gateway.logger import init_logger
from gateway.lora_request import LoRARequest
from gateway.models.info.lora_adapter import AdapterError, ModelDims, check_adapter
from gateway.models.info.paths import ModelInfo
from gateway.plugins import LoRAResolverRegistry
from gateway.sampling_params import SamplingParams

logger = init_logger(__name__)


@dataclass(frozen=True)
class LoRAModule:
    """One --lora-modules item: `name=path`, or vLLM's JSON form."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """`name=path` or `{"name": ..., "path": ..., "base_model_name": ...}`; ValueError."""
    if text.lstrip().startswith("{"):
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--lora-modules {text!r} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) \
                or not isinstance(raw.get("path"), str):
            raise ValueError(f"--lora-modules {text!r}: the JSON form needs \"name\" and "
                             "\"path\" strings")
        base = raw.get("base_model_name")
        return LoRAModule(raw["name"], raw["path"], None if base is None else str(base))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r} is neither name=path nor JSON")
    return LoRAModule(name, path)


def model_dims(info: ModelInfo) -> ModelDims:
    return ModelDims(num_layers=info.num_hidden_layers, hidden_size=info.hidden_size,
                     intermediate_size=info.intermediate_size or 0,
                     q_size=info.num_attention_heads * info.head_dim,
                     kv_size=info.num_key_value_heads * info.head_dim)


class LoRAAdapters:
    """The adapters this API server serves, by name (None config: LoRA is off, and every
    other name is a 404 as before)."""

    def __init__(self, config: LoRAConfig | None, base_model_name: str,
                 dims: ModelDims | None) -> None:
        self.config, self.base_model_name, self.dims = config, base_model_name, dims
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._resolving: dict[str, asyncio.Future[LoRARequest | None]] = {}

    @classmethod
    def from_modules(cls, config: LoRAConfig | None, base_model_name: str,
                     info: ModelInfo | None, modules: list[LoRAModule]) -> LoRAAdapters:
        """With --lora-modules checked and added; ValueError, one line naming the module."""
        adapters = cls(config, base_model_name, None if info is None else model_dims(info))
        for module in modules:
            adapters.add(module.name, module.path, module.base_model_name)
        return adapters

    @property
    def is_enabled(self) -> bool:
        return self.config is not None

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check the adapter and serve it under `name`; AdapterError names it and why."""
        if self.config is None:
            raise AdapterError(f"LoRA adapter {name!r}: the server runs without "
                               "--enable-lora")
        if name == self.base_model_name:
            raise AdapterError(f"LoRA adapter {name!r}: the name is the base model's")
        if base_model_name is not None and base_model_name != self.base_model_name:
            raise AdapterError(f"LoRA adapter {name!r}: its base model {base_model_name!r} "
                               f"is not the served {self.base_model_name!r}")
        try:
            if self.dims is not None:
                check_adapter(path, self.config.max_lora_rank, self.dims)
        except AdapterError as exc:
            raise AdapterError(f"LoRA adapter {name!r} ({path}): {exc}") from None
        lora = LoRARequest(lora_name=name, lora_int_id=next(self._ids), lora_path=path,
                           base_model_name=self.base_model_name)
        self.adapters[name] = lora
        return lora

    def remove(self, name: str) -> bool:
        return self.adapters.pop(name, None) is not None

    async def resolve(self, requested: str | None) -> LoRARequest | None:
        """The adapter `requested` names (None: the base model); 404 when it names no
        model this server knows or its resolvers find."""
        if requested is None or requested == self.base_model_name:
            return None
        known = self.adapters.get(requested)
        if known is not None:
            return known
        if self.is_enabled and envs.allow_runtime_lora_updating() \
                and LoRAResolverRegistry.get_supported_resolvers():
            pending = self._resolving.get(requested)
            if pending is None:  # one lookup per name, however many requests wait on it
                pending = asyncio.ensure_future(self._ask_resolvers(requested))
                self._resolving[requested] = pending
                pending.add_done_callback(lambda _: self._resolving.pop(requested, None))
            try:
                found = await asyncio.shield(pending)
            except AdapterError as exc:  # a resolver found it, but it cannot be served
                raise OpenAIError(400, str(exc), param="model") from None
            if found is not None:
                return found
        raise OpenAIError(404, f"The model `{requested}` does not exist. This server serves "
                          f"`{self.base_model_name}`.", param="model", code="model_not_found")

    async def _ask_resolvers(self, name: str) -> LoRARequest | None:
        timeout_s = envs.lora_resolver_timeout_s()
        for resolver_name in LoRAResolverRegistry.get_supported_resolvers():
            resolver = LoRAResolverRegistry.get_resolver(resolver_name)
            try:
                found = await asyncio.wait_for(
                    resolver.resolve_lora(self.base_model_name, name), timeout_s)
            except Exception as exc:
                error = f"took longer than {timeout_s:g} s" if isinstance(
                    exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
                logger.warning("LoRA resolver %r failed for %r: %s", resolver_name, name,
                               error, exc_info=not isinstance(exc, TimeoutError))
                LoRAResolverRegistry.note_failure(resolver_name, error)
                continue
            if found is None:
                continue
            if not isinstance(found, LoRARequest):
                LoRAResolverRegistry.note_failure(
                    resolver_name, f"returned {type(found).__name__}, not a LoRARequest")
                continue
            lora = self.add(name, found.lora_path, found.base_model_name)  # 400 if bad
            logger.info("LoRA resolver %r found adapter %r at %s.", resolver_name, name,
                        lora.lora_path)
            return lora
        return None

    def cards(self, created: int, max_model_len: int) -> list[dict[str, object]]:
        """/v1/models' entries of the adapters (vLLM's shape: the base model as parent)."""
        return [{"id": name, "object": "model", "created": created, "owned_by": "gateway",
                 "root": lora.lora_path, "parent": self.base_model_name,
                 "max_model_len": max_model_len} for name, lora in self.adapters.items()]


def served_name(params: SamplingParams, base_model_name: str) -> str:
    """The `model` a response names: the adapter's where the request ran one (vLLM's)."""
    lora = params.lora_request
    return base_model_name if lora is None else lora.lora_name


def check_lora_modules(config: LoRAConfig | None, info: ModelInfo,
                       modules: tuple[LoRAModule, ...]) -> None:
    """--lora-modules checked before the engine starts, so that a bad one costs no model
    load (AdapterError, one line); their base model names are checked by build_app."""
    probe = LoRAAdapters(config, "", model_dims(info))
    for module in modules:
        probe.add(module.name, module.path)
