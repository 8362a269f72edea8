"""A LoRA adapter a request runs with (vLLM's `LoRARequest`): plain data shared by every
process. The front end resolves a request's `model` to one and sends it inside the
request's `SamplingParams`; the engine core schedules by it and the worker loads it.
"""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, kw_only=True):
    lora_name: str  # what clients put in `model`
    #: The front end's number for this adapter: a fresh one each time a name is loaded, so
    #: the engine never mixes an adapter with a later one of the same name (prefix cache,
    #: the worker's adapter cache).
    lora_int_id: int
    lora_path: str  # the PEFT folder: adapter_config.json, adapter_model.safetensors
    base_model_name: str | None = None
