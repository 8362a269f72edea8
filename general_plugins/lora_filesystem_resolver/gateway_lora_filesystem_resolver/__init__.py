"""A general plugin that registers a LoRA resolver: a request naming a model the server does
not know, say `sql-expert`, is served with the adapter in `$VLLM_LORA_RESOLVER_CACHE_DIR/
sql-expert/` when that folder holds a PEFT LoRA adapter of the served base model (its
adapter_config.json's `base_model_name_or_path` is the served model's name), as vLLM's
filesystem resolver does.

`register_filesystem_resolver` runs in every process the gateway starts; only the API
server asks resolvers, so registering elsewhere costs nothing. With the variable unset it
registers nothing; set to something that is not a folder, it stops start-up.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from gateway.plugins import LoRARequest, LoRAResolver, LoRAResolverRegistry

RESOLVER_NAME = "Filesystem Resolver"


class FilesystemResolver(LoRAResolver):
    def __init__(self, lora_cache_dir: str) -> None:
        self.lora_cache_dir = Path(lora_cache_dir)

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        # A name is one folder below the cache folder, never a path out of it.
        if not lora_name or lora_name in (".", "..") or "/" in lora_name or os.sep in lora_name:
            return None
        folder = self.lora_cache_dir / lora_name
        config = await asyncio.to_thread(_read_config, folder / "adapter_config.json")
        if config is None or config.get("peft_type") != "LORA" \
                or config.get("base_model_name_or_path") != base_model_name:
            return None
        # The server gives the adapter its own id; this one is a placeholder.
        return LoRARequest(lora_name=lora_name, lora_int_id=0, lora_path=str(folder))


def _read_config(path: Path) -> dict[str, object] | None:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def register_filesystem_resolver() -> None:
    lora_cache_dir = os.environ.get("VLLM_LORA_RESOLVER_CACHE_DIR")
    if not lora_cache_dir:
        return
    if not os.path.isdir(lora_cache_dir):
        raise ValueError(f"VLLM_LORA_RESOLVER_CACHE_DIR ({lora_cache_dir!r}) must be a "
                         "folder for the filesystem LoRA resolver")
    if RESOLVER_NAME not in LoRAResolverRegistry.get_supported_resolvers():
        LoRAResolverRegistry.register_resolver(RESOLVER_NAME, FilesystemResolver(lora_cache_dir))
