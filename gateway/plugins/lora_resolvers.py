"""The LoRA resolver registry (vLLM's `LoRAResolverRegistry`), in every process: general
plugins register `LoRAResolver`s here by name; the API server asks them, in registration
order, about a model name it does not know (frontend/openai/lora.py). Each registration
is a record of group `lora_resolvers` in this process's load report (/v1/plugins), under
the distribution of the general plugin that made it; a resolver that fails while serving
counts a runtime error there. Guide: docs/plugins.md, "LoRA resolvers".
"""

from __future__ import annotations

from gateway.logger import init_logger
from gateway.plugins.contracts import LoRAResolver
from gateway.plugins.process import load_report, this_process

logger = init_logger(__name__)

#: The load report's group for registered resolvers (a registry, not an entry-point group).
LORA_RESOLVERS_GROUP = "lora_resolvers"


class _LoRAResolverRegistry:
    """A view of this process's resolvers (held by its PluginProcess, so a new process,
    or a test's reset, starts with none)."""

    def register_resolver(self, resolver_name: str, resolver: LoRAResolver) -> None:
        """Called by a general plugin, at start-up of each process it runs in. A second
        registration of a name replaces the first, with a WARNING."""
        if not isinstance(resolver, LoRAResolver):
            raise TypeError(f"LoRA resolver {resolver_name!r}: {resolver!r} is not a "
                            "LoRAResolver")
        resolvers = this_process().lora_resolvers
        if resolver_name in resolvers:
            logger.warning("LoRA resolver %r is registered again; the new one replaces it.",
                           resolver_name)
        resolvers[resolver_name] = resolver
        plugin = this_process().calling_general_plugin
        kind = type(resolver)
        load_report().record(
            LORA_RESOLVERS_GROUP, resolver_name, f"{kind.__module__}:{kind.__qualname__}",
            plugin.distribution if plugin is not None else "<not a general plugin>",
            "registered", detail=None if plugin is None
            else f"registered by general plugin {plugin.name!r}")

    def get_supported_resolvers(self) -> list[str]:
        """The registered names, in registration order."""
        return list(this_process().lora_resolvers)

    def get_resolver(self, resolver_name: str) -> LoRAResolver:
        resolvers = this_process().lora_resolvers
        if resolver_name not in resolvers:
            raise KeyError(f"No LoRA resolver {resolver_name!r} is registered; registered: "
                           f"{', '.join(resolvers) or 'none'}")
        resolver: LoRAResolver = resolvers[resolver_name]
        return resolver

    def note_failure(self, resolver_name: str, error: str) -> None:
        """Count a failure of a resolver while serving, in the load report."""
        load_report().note_runtime_error(LORA_RESOLVERS_GROUP, resolver_name, error)


LoRAResolverRegistry = _LoRAResolverRegistry()
