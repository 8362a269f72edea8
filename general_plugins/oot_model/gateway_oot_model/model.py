"""The out-of-tree model: a Llama-style decoder whose checkpoint names the architecture
GatewayOotForCausalLM. Worker processes only (it imports torch).

It reuses the gateway's decoder as Llama, so the weights load by name and tensor parallelism
works; a model of your own would define its modules here with the same class attributes
(`supported_tasks`, `supports_tensor_parallel`, `packed_modules_mapping`, `kv_cache_spec`).
"""

from __future__ import annotations

from typing import ClassVar

from gateway.models.archs.decoder import LlamaForCausalLM


class OotForCausalLM(LlamaForCausalLM):
    #: What the server reports at /v1/models and in its start-up log.
    supported_tasks: ClassVar[tuple[str, ...]] = ("generate",)
