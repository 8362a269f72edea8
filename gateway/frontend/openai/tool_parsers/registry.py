"""Tool parsers by name (front-end process): the built-in ones (hermes, json, llama3_json,
mistral, pythonic, qwen3_coder), and the two ways a user adds one: `--tool-parser-plugin
MODULE` (a module, or a .py file, imported at start-up, that calls `register_tool_parser`)
and an entry point in the `vllm.tool_parsers` group naming a `ToolParser` subclass."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from gateway.frontend.openai.tool_parsers.base import ToolParser
from gateway.frontend.openai.tool_parsers.hermes import HermesToolParser
from gateway.frontend.openai.tool_parsers.json_parser import JsonToolParser
from gateway.frontend.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from gateway.frontend.openai.tool_parsers.mistral import MistralToolParser
from gateway.frontend.openai.tool_parsers.pythonic import PythonicToolParser
from gateway.frontend.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from gateway.logger import init_logger
from gateway.plugins import load_plugins_by_group

logger = init_logger(__name__)

#: Entry-point group of tool parsers: name = the parser's name, value = its class. Loaded
#: in the API-server process, when the app is built with a --tool-call-parser.
TOOL_PARSERS_GROUP = "vllm.tool_parsers"

T = TypeVar("T", bound=type[ToolParser])
#: The parsers by name: the built-in ones first, so a later registration may replace one.
_PARSERS: dict[str, type] = {cls.name: cls for cls in (
    HermesToolParser, JsonToolParser, Llama3JsonToolParser, MistralToolParser,
    PythonicToolParser, Qwen3CoderToolParser)}


def register_tool_parser(name: str) -> Callable[[T], T]:
    """Class decorator: make a ToolParser subclass available as `--tool-call-parser NAME`
    (a later registration of the name replaces the earlier one)."""
    def register(cls: T) -> T:
        if name in _PARSERS and _PARSERS[name] is not cls:
            logger.info("Tool parser %r replaced by %s", name, cls)
        _PARSERS[name] = cls
        cls.name = name
        return cls
    return register


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> type:
    """The parser class registered as `name`; ValueError listing the known names."""
    if name not in _PARSERS:
        for entry_name, cls in load_plugins_by_group(TOOL_PARSERS_GROUP).items():
            _PARSERS.setdefault(entry_name, cls)
    if name not in _PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: "
                         f"{', '.join(sorted(_PARSERS))}")
    return _PARSERS[name]


def import_tool_parser_plugin(spec: str) -> None:
    """Import a --tool-parser-plugin: a .py file path or a module name."""
    if spec.endswith(".py"):
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"--tool-parser-plugin {spec!r}: no such file")
        module_spec = importlib.util.spec_from_file_location(f"_tool_parser_{path.stem}", path)
        assert module_spec is not None and module_spec.loader is not None
        module: Any = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module
        module_spec.loader.exec_module(module)
    else:
        importlib.import_module(spec)

