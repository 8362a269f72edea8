"""The general plugins (rules 4 and 6), in every process: every allowed
`vllm.general_plugins` function, called once per process."""

from __future__ import annotations

import time

from gateway.plugins.loader import (
    DEFAULT_PLUGINS_GROUP,
    PluginError,
    discovered,
    error_text,
    load_plugins_by_group,
    record_plugin,
    where,
)
from gateway.plugins.process import this_process


def load_general_plugins() -> None:
    """Call every allowed general plugin; once per process (rule 4). A process's start calls
    it through `gateway.process_start.load_process_plugins`, after the platform.

    The flag is set before any plugin runs, so a plugin that re-enters (or a second call)
    returns at once. A plugin that raises stops start-up (rule 6): PluginError names it.
    """
    state = this_process()
    if state.general_plugins_loaded:
        return
    state.general_plugins_loaded = True
    for name, func in load_plugins_by_group(DEFAULT_PLUGINS_GROUP).items():
        plugin = discovered(DEFAULT_PLUGINS_GROUP, name)
        start = time.perf_counter()
        try:
            if not callable(func):
                raise TypeError(f"the entry point's object {func!r} is not callable")
            state.calling_general_plugin = plugin
            func()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            record_plugin(plugin, "call-failed", error=error_text(exc))
            raise PluginError(f"General {where(plugin)} raised: {error_text(exc)}") from exc
        finally:
            state.calling_general_plugin = None
        record_plugin(plugin, "called", load_time_s=time.perf_counter() - start)
