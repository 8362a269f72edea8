"""What every gateway process does first with plugins (any process): the platform, then the
general plugins."""

from __future__ import annotations

from gateway.platforms import get_current_platform
from gateway.plugins.general import load_general_plugins


def load_process_plugins() -> None:
    """Resolve the platform (rule 7: the platform plugins are resolved and recorded in every
    process, as vLLM reads `current_platform` first), then call the general plugins (rule 4,
    once per process). A plugin that raises stops start-up with a PluginError naming it."""
    get_current_platform()
    load_general_plugins()
