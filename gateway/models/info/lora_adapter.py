"""A LoRA adapter's PEFT folder, read and checked without torch (the front end checks an
adapter before a request may name it; the worker reads its tensors, lora_manager.py).

The folder holds adapter_config.json (`r`, `lora_alpha`, `target_modules`, optional
`use_rslora`) and adapter_model.safetensors, whose tensors are named
`...layers.<i>.<self_attn|mlp>.<projection>.lora_<A|B>.weight`: A [r, in], B [out, r].
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The projections of the decoder a LoRA adapter may target (PEFT's module names).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_TENSOR_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
_MAX_HEADER_BYTES = 100 << 20


class AdapterError(ValueError):
    """An adapter the server cannot serve; the message says why, in one line."""


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    target_modules: frozenset[str]


@dataclass(frozen=True)
class ModelDims:
    """The sizes an adapter's tensors must fit (the whole model, before any split)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    q_size: int  # query heads x head dim
    kv_size: int  # key-value heads x head dim

    def shape_of(self, projection: str, rank: int, part: str) -> tuple[int, int]:
        """The [rows, cols] a projection's lora_A (part "A") or lora_B must have."""
        out_in = {"q_proj": (self.q_size, self.hidden_size),
                  "k_proj": (self.kv_size, self.hidden_size),
                  "v_proj": (self.kv_size, self.hidden_size),
                  "o_proj": (self.hidden_size, self.q_size),
                  "gate_proj": (self.intermediate_size, self.hidden_size),
                  "up_proj": (self.intermediate_size, self.hidden_size),
                  "down_proj": (self.hidden_size, self.intermediate_size)}[projection]
        return (rank, out_in[1]) if part == "A" else (out_in[0], rank)


def read_adapter_config(path: str | Path) -> AdapterConfig:
    folder = Path(path)
    try:
        raw = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise AdapterError(f"its folder {str(folder)!r} has no readable {CONFIG_FILE}") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"its {CONFIG_FILE} cannot be read: {exc}") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"its {CONFIG_FILE} is not a JSON object")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise AdapterError(f"its {CONFIG_FILE} needs a positive integer `r` and a number "
                           f"`lora_alpha`, got r={rank!r}, lora_alpha={alpha!r}")
    for field, allowed in (("use_dora", (False, None)), ("modules_to_save", (None, [])),
                           ("bias", ("none", None))):
        if raw.get(field) not in allowed:
            raise AdapterError(f"its {CONFIG_FILE} sets {field}={raw[field]!r}, which the "
                               f"server does not support")
    scaling = alpha / (math.sqrt(rank) if raw.get("use_rslora") else rank)
    return AdapterConfig(rank, float(scaling), _targets(raw.get("target_modules")))


def _targets(value: Any) -> frozenset[str]:
    """The projections named; a regular expression or "all-linear" names them all (the
    tensors in the weights file then say which are adapted)."""
    if isinstance(value, str):
        return frozenset(PROJECTIONS)
    if not isinstance(value, list) or not value:
        raise AdapterError(f"its {CONFIG_FILE} has no target_modules")
    names = {str(name).rsplit(".", 1)[-1] for name in value}
    lacking = sorted(names - set(PROJECTIONS))
    if lacking:
        raise AdapterError(f"it targets module(s) {', '.join(lacking)}, which the model lacks "
                           f"(a LoRA adapter may target {', '.join(PROJECTIONS)})")
    return frozenset(names)


def adapter_tensors(path: str | Path) -> dict[str, tuple[int, str, str]]:
    """Tensor name -> (layer, projection, "A" | "B") of every tensor in the weights file,
    read from its header alone."""
    header = _safetensors_header(Path(path) / WEIGHTS_FILE)
    found = {}
    for name in header:
        if name == "__metadata__":
            continue
        match = _TENSOR_NAME.search(name)
        if match is None or match.group(2) not in PROJECTIONS:
            raise AdapterError(f"its tensor {name!r} adapts a module the model lacks (a LoRA "
                               f"adapter may target {', '.join(PROJECTIONS)})")
        found[name] = (int(match.group(1)), match.group(2), match.group(3))
    return found


def check_adapter(path: str | Path, max_lora_rank: int, dims: ModelDims) -> AdapterConfig:
    """The adapter's config, once its rank, targets and tensor shapes fit the model and
    the server; AdapterError (one line) otherwise."""
    config = read_adapter_config(path)
    if config.rank > max_lora_rank:
        raise AdapterError(f"its rank {config.rank} exceeds --max-lora-rank {max_lora_rank}")
    header = _safetensors_header(Path(path) / WEIGHTS_FILE)
    tensors = adapter_tensors(path)
    if not tensors:
        raise AdapterError(f"its {WEIGHTS_FILE} holds no LoRA tensors")
    for name, (layer, projection, part) in tensors.items():
        if layer >= dims.num_layers:
            raise AdapterError(f"its tensor {name!r} is for layer {layer}; the model has "
                               f"{dims.num_layers}")
        want = dims.shape_of(projection, config.rank, part)
        shape = tuple(header[name].get("shape", ()))
        if shape != want:
            raise AdapterError(f"its tensor {name!r} has shape {list(shape)}; the model and "
                               f"r={config.rank} need {list(want)}")
    return config


def _safetensors_header(file: Path) -> dict[str, Any]:
    try:
        with file.open("rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            if size > _MAX_HEADER_BYTES:
                raise AdapterError(f"its {WEIGHTS_FILE} is not a safetensors file")
            header = json.loads(handle.read(size))
    except FileNotFoundError:
        raise AdapterError(f"its folder has no {WEIGHTS_FILE}") from None
    except (OSError, ValueError, struct.error) as exc:
        raise AdapterError(f"its {WEIGHTS_FILE} cannot be read: {exc}") from None
    if not isinstance(header, dict):
        raise AdapterError(f"its {WEIGHTS_FILE} is not a safetensors file")
    return header
