"""`gateway plugins`: every discovered entry point, its outcome here, and the preflight.

The table shows each entry point of each group, what the allowlist does to it, and what
happened when this process loaded it. `--check` applies the allowlist, the platform,
stat-logger, IO-processor and endpoint rules without starting the engine, and exits
non-zero on an error; warnings (allowlist names matching nothing, plugins of other groups
excluded by a set VLLM_PLUGINS) do not fail it.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gateway import envs
from gateway.plugins import (
    ALL_GROUPS,
    ENDPOINT_PLUGINS_GROUP,
    LOGITS_PROCESSORS_GROUP,
    PluginError,
    allowlist_warnings,
    discovery,
    load_endpoint_plugins,
    load_io_processor,
    load_logits_processor_classes,
    load_report,
    load_stat_logger_classes,
)
from gateway.plugins.loader import is_allowed, record
from gateway.plugins.records import FAILED_OUTCOMES

_COLUMNS = ("group", "name", "value", "distribution", "allowlist", "outcome", "error")


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("plugins", help="list installed plugins and what loads here",
                            description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the records as JSON")
    parser.add_argument("--check", action="store_true",
                        help="preflight: exit non-zero if the plugin set would stop start-up")
    parser.add_argument("--tasks", default="generate",
                        help="the served model's tasks for endpoint-plugin gating "
                             "(comma-separated; default: generate)")
    parser.add_argument("--io-processor-plugin", default=None,
                        help="check that this IO-processor plugin exists and is allowed")
    parser.add_argument("--logits-processors", nargs="*", default=[], metavar="MODULE:CLASS",
                        help="check that these logits-processor classes load, as `serve "
                             "--logits-processors` would")


def run(args: argparse.Namespace) -> int:
    errors: list[str] = []
    if args.general_plugin_error is not None:
        errors.append(str(args.general_plugin_error))
    warnings = allowlist_warnings()
    errors += _load_everything(args)
    errors = list(dict.fromkeys(errors))  # the platform's error may come twice
    rows = [_row(rec) for rec in _all_records()]
    if args.json:
        print(json.dumps({"records": rows, "warnings": warnings, "errors": errors}, indent=2))
    else:
        _print_table(rows)
        for line in warnings:
            print(f"warning: {line}")
        for line in errors:
            print(f"error: {line}")
    failed = [r for r in rows if r["outcome"] in FAILED_OUTCOMES]
    if args.check and (errors or failed):
        return 1
    return 0


def _load_everything(args: argparse.Namespace) -> list[str]:
    """Load each group through the same functions the serving processes call, collecting
    the errors that would stop start-up."""
    from gateway.platforms import get_current_platform

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if args.io_processor_plugin and "plugin" not in tasks:
        tasks.append("plugin")  # what an active IO processor adds at serve time
    errors = _errors_of(get_current_platform)
    errors += _errors_of(load_stat_logger_classes)
    errors += _errors_of(lambda: load_io_processor(args.io_processor_plugin))
    errors += check_endpoint_routes(tasks)
    errors += _errors_of(lambda: load_logits_processor_classes(args.logits_processors))
    return errors


def _errors_of(load: Any) -> list[str]:
    try:
        load()
    except (PluginError, TypeError, ValueError) as exc:
        return [str(exc)]
    return []


def check_endpoint_routes(tasks: list[str]) -> list[str]:
    """Rules 3 and 5 and the route-conflict rules, on the core app of a model with `tasks`
    (no engine): a plugin replacing a core route is reported, two plugins on one path and
    method are an error."""
    from gateway.frontend.app import create_core_app
    from gateway.frontend.endpoint_plugins import attach_endpoint_plugins
    from gateway.frontend.server_config import HttpConfig

    plugins = load_endpoint_plugins(tasks)
    try:
        attached = attach_endpoint_plugins(create_core_app(HttpConfig(), tasks), plugins)
    except PluginError as exc:
        return [str(exc)]
    for item in attached:  # init_state needs the engine: not called by the preflight
        record(ENDPOINT_PLUGINS_GROUP, item.entry_name, "attached", detail=item.describe())
    return []


def _all_records() -> list[Any]:
    """The report, plus a 'discovered' row for entry points this process never touched."""
    for group in ALL_GROUPS:
        seen = {(r.name, r.distribution) for r in load_report().records(group)}
        for plugin in discovery.discover(group):
            if (plugin.name, plugin.distribution) not in seen:
                load_report().record(group, plugin.name, plugin.value, plugin.distribution,
                              "discovered")
    order = {g: i for i, g in enumerate(ALL_GROUPS)}
    return sorted(load_report().records(), key=lambda r: (order.get(r.group, 99), r.name))


def _row(rec: Any) -> dict[str, Any]:
    row = rec.to_dict()
    row["allowlist"] = ("ignored" if rec.group == LOGITS_PROCESSORS_GROUP else
                        "allowed" if is_allowed(rec.group, rec.name, envs.vllm_plugins())
                        else "excluded")
    return row


def _print_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        print("No plugins installed (no entry points in any vllm.* group).")
        return
    cells = [[str(r.get(c) or "") for c in _COLUMNS] for r in rows]
    widths = [min(48, max(len(c), *(len(row[i]) for row in cells)))
              for i, c in enumerate(_COLUMNS)]
    line = "  ".join(c.upper().ljust(w) for c, w in zip(_COLUMNS, widths))
    print(line.rstrip())
    for row in cells:
        print("  ".join(v[:w].ljust(w) for v, w in zip(row, widths)).rstrip())
    sys.stdout.flush()
