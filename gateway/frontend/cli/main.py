"""The `gateway` command: `gateway plugins`, `gateway serve`, `gateway generate`,
`gateway chat`, `gateway complete`.

General plugins are loaded before the argument parser is built (rule: a plugin may add
choices), so every subcommand runs in a process whose general plugins already ran.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import gateway
from gateway.logger import init_logger
from gateway.plugins import PluginError, start_process
from gateway.process_start import load_process_plugins

logger = init_logger("gateway.cli")

# Subcommand name -> module with `add_parser(subparsers)` and `run(args) -> int`.
SUBCOMMANDS = {
    "plugins": "gateway.frontend.cli.plugins",
    "serve": "gateway.frontend.cli.serve",
    "generate": "gateway.frontend.cli.generate",
    "chat": "gateway.frontend.cli.chat",
    "complete": "gateway.frontend.cli.complete",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway", description=__doc__.splitlines()[0])
    parser.add_argument("-V", "--version", action="version",
                        version=f"gateway {gateway.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module_name in SUBCOMMANDS.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # a subcommand this build does not ship yet
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["--version"], ["-V"]):  # answered without loading any plugin
        print(f"gateway {gateway.__version__}")
        return 0
    role = "api-server" if argv[:1] == ["serve"] else "cli"
    if role == "api-server" and "--headless" in argv:
        role = "headless"  # runs worker ranks, not the server
    start_process(role)
    general_error: PluginError | None = None
    try:
        load_process_plugins()
    except PluginError as exc:
        if argv[:1] != ["plugins"]:  # the preflight reports it in its table instead
            logger.error("%s", exc)
            return 1
        general_error = exc
    args = build_parser().parse_args(argv)
    args.general_plugin_error = general_error
    module = importlib.import_module(SUBCOMMANDS[args.command])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
