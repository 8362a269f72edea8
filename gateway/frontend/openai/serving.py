"""The OpenAI routes' server-wide settings, made once when the app is built: the most
choices a request may ask for, the model's default sampling parameters (its generation
config), and the chat template that replaces the model's.

`--generation-config auto` (the default, vLLM's) reads `generation_config.json` of an HF
folder, or the `general.sampling.*` metadata of a GGUF file (a model shipped on PyPI
without them: its model card's defaults); `vllm` uses the API's own defaults; a folder
path reads that folder's `generation_config.json`. A request's own fields always win.
Front-end process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.frontend.openai.request_templates import DEFAULT_RENDER_TIMEOUT_S
from gateway.frontend.openai.sampling import DEFAULT_MAX_N, DEFAULT_MAX_SEQS_PER_REQUEST
from gateway.frontend.openai.structured_output_limits import SpecLimits
from gateway.frontend.server_config import OpenAIConfig
from gateway.logger import init_logger
from gateway.models.info.gguf_file import GGUFFile
from gateway.models.info.paths import packaged_generation_defaults

logger = init_logger(__name__)

# generation_config.json keys -> request fields (vLLM's selection).
_HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
            "min_p": "min_p", "repetition_penalty": "repetition_penalty"}
# GGUF metadata (llama.cpp's `general.sampling.*`) -> request fields.
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}


@dataclass
class ServingOptions:
    max_n: int = DEFAULT_MAX_N
    #: A request's prompts x n, at most (--max-seqs-per-request).
    max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST
    #: --max-num-queued-reqs: a request needing more sequences could never be admitted.
    max_num_queued_reqs: int | None = None
    #: Defaults for the sampling fields a request leaves out (the model's).
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    #: The --chat-template source, replacing the model's (None: the model's own).
    chat_template: str | None = None
    #: Whether a request may bring its own chat_template (--trust-request-chat-template).
    trust_request_chat_template: bool = False
    #: How long a request's own chat_template may render (None: no limit).
    chat_template_render_timeout_s: float | None = DEFAULT_RENDER_TIMEOUT_S
    #: Size caps of a structured-output constraint (--structured-outputs-max-*).
    spec_limits: SpecLimits = field(default_factory=SpecLimits)


def make_serving_options(config: OpenAIConfig, model_path: Path | None,
                         max_num_queued_reqs: int | None = None) -> ServingOptions:
    """From the server's OpenAI settings, the served model's file or folder, and the queue
    cap (--max-num-queued-reqs)."""
    defaults = read_generation_defaults(model_path, config.generation_config or "auto")
    if defaults:  # vLLM's lines, so an operator who knows vLLM's log finds them
        logger.warning("Default sampling parameters have been overridden by the model's "
                       "generation config recommended from the model creator. If this is "
                       "not intended, please relaunch the server with "
                       "`--generation-config vllm`.")
        source = "model" if config.generation_config in (None, "auto") \
            else config.generation_config
        for route in ("chat", "completion"):
            logger.info("Using default %s sampling params from %s: %s", route, source,
                        defaults)
    return ServingOptions(max_n=config.max_n, sampling_defaults=defaults,
                          max_seqs_per_request=config.max_seqs_per_request,
                          max_num_queued_reqs=max_num_queued_reqs,
                          chat_template=load_chat_template(config.chat_template),
                          trust_request_chat_template=config.trust_request_chat_template,
                          chat_template_render_timeout_s=config.chat_template_render_timeout_s,
                          spec_limits=config.spec_limits)


def read_generation_defaults(model_path: Path | None, mode: str) -> dict[str, float]:
    """The sampling defaults of the model (`mode` auto), of a folder (`mode` a path), or
    none (`mode` vllm)."""
    if mode == "vllm" or model_path is None:
        return {}
    if mode != "auto":
        model_path = Path(mode)
        if not (model_path / "generation_config.json").is_file():
            raise FileNotFoundError(f"--generation-config {mode}: no generation_config.json "
                                    "there")
    if model_path.is_dir():
        return _from_json(model_path / "generation_config.json")
    if model_path.suffix == ".gguf":
        gguf = GGUFFile(model_path)
        defaults = _numbers({name: gguf.get(key) for key, name in _GGUF_KEYS.items()})
        return defaults or packaged_generation_defaults(model_path)
    return {}


def _from_json(path: Path) -> dict[str, float]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        logger.warning("Ignoring %s: %s", path, exc)
        return {}
    if not isinstance(config, dict):
        return {}
    return _numbers({name: config.get(key) for key, name in _HF_KEYS.items()})


def _numbers(values: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's path, or the template itself (vLLM's rule: a value that
    names no file but holds template syntax is the template)."""
    if value is None:
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:
        pass
    if any(mark in value for mark in ("{{", "{%", "{#")):
        return value
    raise FileNotFoundError(f"--chat-template {value!r}: no such file, and not a template")
