"""Random LoRA adapters of the tiny test models, saved by PEFT as a user's folder is
(adapter_config.json, adapter_model.safetensors), and PEFT's merged model as the reference.
Built with transformers and peft (torch: tests only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_tiny_lora(model: Path, folder: Path, *, rank: int = 4, alpha: int = 8,
                    targets: tuple[str, ...] = ALL_TARGETS, seed: int = 1,
                    use_rslora: bool = False) -> Path:
    """A random adapter of the HF folder `model` (B random too: PEFT starts it at zero,
    which would make the adapter a no-op), saved into `folder`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
        use_rslora=use_rslora))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    peft_model.save_pretrained(folder)
    return folder


def merged_reference(model: Path, adapter: Path | None) -> Any:
    """transformers' model with the adapter merged in (None: the base model), float32."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    if adapter is None:
        return base.eval()
    from peft import PeftModel

    return PeftModel.from_pretrained(base, adapter).merge_and_unload().eval()
