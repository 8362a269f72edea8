"""Whether the gateway can serve a model, decided from its config alone (torch-free).

`check_supported(info)` runs in the front end before the engine core starts, and again in
the worker before the model is built: an architecture that is not registered, a config
field that changes the math and is not implemented (rope scaling kinds, attention
soft-capping, mixture-of-experts fields of dense families, ...), a GGUF tensor of a type
that cannot be read, missing, or of another shape than its metadata implies, an expert
tensor missing from an HF folder's safetensors headers, or a GGUF tokenizer that cannot be
built stops start-up with one line naming the model, the field and what is supported.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import NoReturn

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from gateway.gguf_tokenizer import unsupported_tokenizer
from gateway.models.info.decoder_config import (
    DECODER_READERS,
    DecoderConfig,
    UnsupportedConfigError,
    read_decoder_config,
)
from gateway.models.info.gguf_file import GGUFFile
from gateway.models.info.gguf_layout import GGUF_DECODERS, LONGROPE_TENSORS, layout_mismatch
from gateway.models.info.paths import ModelInfo
from gateway.models.info.registry import ModelRegistry

# general.architecture values whose GGUF tensors gguf_layout names.
GGUF_WEIGHT_ARCHITECTURES = tuple(GGUF_DECODERS)


_MULTIMODAL = "a multimodal architecture: only text models are served"
_MLA = "DeepSeek's multi-head latent attention is not implemented"
# Architectures people often try, and why each is refused (the line says it).
_KNOWN_REFUSALS = {
    **dict.fromkeys(("Gemma3ForConditionalGeneration", "LlavaForConditionalGeneration",
                     "LlavaNextForConditionalGeneration", "Qwen2VLForConditionalGeneration",
                     "Qwen2_5_VLForConditionalGeneration", "Mistral3ForConditionalGeneration",
                     "MllamaForConditionalGeneration", "Llama4ForConditionalGeneration",
                     "PaliGemmaForConditionalGeneration", "Phi3VForCausalLM",
                     "Phi4MMForCausalLM"), _MULTIMODAL),
    **dict.fromkeys(("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"), _MLA),
    "GptOssForCausalLM": "gpt-oss's attention sinks and mixture of experts are not implemented",
}


class UnsupportedModelError(ValueError):
    """The model cannot be served; the message is one line naming the model and why."""


def check_supported(info: ModelInfo) -> None:
    """Raise UnsupportedModelError when `info`'s model cannot be served (no weights read)."""
    gguf = _check_gguf(info) if info.format == "gguf" else None
    arch = ModelRegistry.first_registered(info.architectures)
    if arch is None:
        why = next((f" ({_KNOWN_REFUSALS[name]})" for name in info.architectures
                    if name in _KNOWN_REFUSALS), "")
        _refuse(info, f"architectures {info.architectures} are not supported{why}. Registered "
                      f"architectures: {', '.join(ModelRegistry.get_supported_archs())}")
    if arch in DECODER_READERS and ModelRegistry.is_builtin(arch):
        try:
            config = read_decoder_config(arch, info.hf_config)
        except UnsupportedConfigError as exc:
            _refuse(info, f"{arch}: {exc}")
        mismatch = None if gguf is None else layout_mismatch(gguf, config)
        if mismatch is None and gguf is None and config.moe is not None:
            mismatch = _missing_expert_tensor(info.path, config)
        if mismatch is not None:
            _refuse(info, mismatch)


def _missing_expert_tensor(folder: Path, config: DecoderConfig) -> str | None:
    """The first router or expert tensor the config implies that `folder`'s safetensors
    files lack (their headers read, no weight), named; None: all there (or no files,
    which the loader reports)."""
    names = safetensors_names(folder)
    if not names:
        return None
    assert config.moe is not None
    for layer in range(config.num_hidden_layers):
        if not config.is_moe_layer(layer):
            continue
        for name in config.moe.checkpoint_names(layer):
            if name not in names:
                return (f"tensor {name!r} is missing from its safetensors files (the "
                        f"config's {config.moe.num_experts} experts in layer {layer} imply it)")
    return None


def safetensors_names(folder: Path) -> set[str]:
    """The tensor names of every *.safetensors file in `folder`, from their JSON headers."""
    names: set[str] = set()
    for file in sorted(folder.glob("*.safetensors")):
        with file.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            try:
                header = json.loads(handle.read(size))
            except ValueError as exc:
                raise UnsupportedModelError(f"{file} is not a safetensors file: its header "
                                            f"cannot be read ({exc})") from exc
        names.update(name for name in header if name != "__metadata__")
    return names


def _check_gguf(info: ModelInfo) -> GGUFFile:
    gguf = GGUFFile(info.path)
    arch = gguf.get("general.architecture")
    if arch not in GGUF_WEIGHT_ARCHITECTURES:
        _refuse(info, f"GGUF general.architecture {arch!r} is not supported (supported: "
                      f"{', '.join(GGUF_WEIGHT_ARCHITECTURES)}; other families load from HF "
                      f"folders)")
    readable = readable_gguf_types()
    for tensor in gguf.tensors.values():
        if tensor.qtype not in readable:
            names = ", ".join(qtype.name for qtype in sorted(readable))
            _refuse(info, f"tensor {tensor.name!r} has GGUF type {tensor.qtype.name}, which "
                          f"cannot be read (supported: {names})")
    for name in LONGROPE_TENSORS:
        if name in gguf.tensors:
            _refuse(info, f"tensor {name!r} holds longrope factors, which are not read from a "
                          f"GGUF file (serve the model's HF folder, whose longrope is supported)")
    problem = unsupported_tokenizer(gguf)
    if problem is not None:
        _refuse(info, problem)
    return gguf


@functools.cache
def readable_gguf_types() -> frozenset[GGMLQuantizationType]:
    """The tensor types the `gguf` package dequantizes (models/gguf_file.py reads with it),
    found by dequantizing one zero block of each."""
    readable = set()
    for qtype in GGMLQuantizationType:
        _, type_size = GGML_QUANT_SIZES[qtype]
        try:
            gguf_quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
        except (NotImplementedError, ValueError, TypeError):
            continue
        readable.add(qtype)
    return frozenset(readable)


def _refuse(info: ModelInfo, reason: str) -> NoReturn:
    raise UnsupportedModelError(f"Model {info.path} cannot be served: {reason}")
