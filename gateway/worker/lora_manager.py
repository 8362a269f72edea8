"""LoRA adapters in the worker: which adapter holds which of the --max-loras slots of the
model's LoRA layers (models/layers/lora.py), the --max-cpu-loras adapters kept read in
host memory, both least recently used out, and each step's per-token slot selection.
The scheduler never sends more distinct adapters in one step than there are slots.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from gateway.config import LoRAConfig
from gateway.lora_request import LoRARequest
from gateway.models.info.lora_adapter import (
    WEIGHTS_FILE,
    AdapterError,
    adapter_tensors,
    read_adapter_config,
)
from gateway.models.layers.lora import LoRAStep, LoRATarget, wrap_lora_targets

#: An adapter as the worker knows it: a name loaded again gets a new id.
_Key = tuple[int, str]
#: Per target, per part: (A [r, in_rank], B scaled [out_rank, r]), or None.
_Weights = list[list[tuple[torch.Tensor, torch.Tensor] | None]]


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, device: torch.device,
                 dtype: torch.dtype) -> None:
        if not all(hasattr(model, name) for name in ("config", "tp", "model")):
            raise ValueError(f"--enable-lora: the model class {type(model).__name__} is not "
                             "the gateway's decoder, whose projections LoRA adapts")
        self.config, self.device, self.dtype = config, device, dtype
        self.step = LoRAStep()
        self.targets: list[LoRATarget] = wrap_lora_targets(
            model, config.max_loras, config.max_lora_rank, self.step, dtype, device)
        self._host: OrderedDict[_Key, _Weights] = OrderedDict()  # LRU, oldest first
        self._slots: OrderedDict[_Key, int] = OrderedDict()  # LRU, oldest first

    @property
    def is_active(self) -> bool:
        """Whether the current step runs any adapter."""
        return self.step.mask is not None

    def select(self, loras: list[LoRARequest | None], counts: np.ndarray) -> dict[int, str]:
        """Set the step's mask: request i (counts[i] tokens, in flat order) runs loras[i].
        Returns {i: why} for the requests whose adapter could not be read (its folder
        changed since the API server checked it): their rows run no adapter, and the
        runner fails them."""
        keys = [None if lora is None else (lora.lora_int_id, lora.lora_path)
                for lora in loras]
        wanted: dict[_Key, LoRARequest] = {}
        for key, lora in zip(keys, loras, strict=True):
            if key is not None and lora is not None:
                wanted[key] = lora
        if not wanted:
            self.step.mask = None
            return {}
        if len(wanted) > self.config.max_loras:
            raise ValueError(f"{len(wanted)} adapters in one step; --max-loras is "
                             f"{self.config.max_loras}")
        slot_of: dict[_Key, int] = {}
        errors: dict[_Key, str] = {}
        for key, lora in wanted.items():
            try:
                slot_of[key] = self._slot(key, lora, set(wanted))
            except (AdapterError, OSError, ValueError, KeyError) as exc:
                errors[key] = f"LoRA adapter {lora.lora_name!r} could not be read: {exc}"
        token_slots = np.repeat(np.array([slot_of.get(key, -1) if key is not None else -1
                                          for key in keys], dtype=np.int64), counts)
        slots = torch.from_numpy(token_slots).to(self.device)
        columns = torch.arange(self.config.max_loras, device=self.device)
        self.step.mask = (slots.unsqueeze(1) == columns).to(self.dtype)  # [N, S]
        return {i: errors[key] for i, key in enumerate(keys) if key in errors}

    def clear(self) -> None:
        self.step.mask = None

    # ------------------------------------------------------------------ slots and cache
    def _slot(self, key: _Key, lora: LoRARequest, in_step: set[_Key]) -> int:
        if key in self._slots:
            self._slots.move_to_end(key)
            return self._slots[key]
        weights = self._host_weights(key, lora)
        used = set(self._slots.values())
        free = [slot for slot in range(self.config.max_loras) if slot not in used]
        if free:
            slot = free[0]
        else:  # the least recently used adapter that this step does not run
            victim = next(old for old in self._slots if old not in in_step)
            slot = self._slots.pop(victim)
        for target, parts in zip(self.targets, weights, strict=True):
            target.module.set_slot(slot, parts)
        self._slots[key] = slot
        return slot

    def _host_weights(self, key: _Key, lora: LoRARequest) -> _Weights:
        if key in self._host:
            self._host.move_to_end(key)
            return self._host[key]
        weights = self._read(lora)
        self._host[key] = weights
        while len(self._host) > self.config.num_cpu_loras:
            self._host.popitem(last=False)
        return weights

    def _read(self, lora: LoRARequest) -> _Weights:
        """The adapter's tensors as this rank's parts of each target, scaling in B."""
        config = read_adapter_config(lora.lora_path)
        if config.rank > self.config.max_lora_rank:
            raise AdapterError(f"LoRA adapter {lora.lora_name!r}: its rank {config.rank} "
                               f"exceeds --max-lora-rank {self.config.max_lora_rank}")
        names = adapter_tensors(lora.lora_path)
        tensors = load_file(str(Path(lora.lora_path) / WEIGHTS_FILE))
        by_part = {(layer, projection, part): tensors[name]
                   for name, (layer, projection, part) in names.items()}
        weights: _Weights = []
        for target in self.targets:
            parts: list[tuple[torch.Tensor, torch.Tensor] | None] = []
            for name, rows in zip(target.parts, target.out_slices, strict=True):
                a = by_part.get((target.layer, name, "A"))
                b = by_part.get((target.layer, name, "B"))
                if a is None or b is None:
                    parts.append(None)
                    continue
                if target.in_slice is not None:  # row-parallel: this rank's input columns
                    a = a.narrow(1, target.in_slice.start, target.in_slice.size)
                else:  # column-parallel: this rank's output rows
                    b = b.narrow(0, rows.start, rows.size)
                parts.append((a.to(self.dtype).contiguous(),
                              (b.float() * config.scaling).to(self.dtype).contiguous()))
            weights.append(parts)
        return weights
