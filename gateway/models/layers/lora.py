"""LoRA on the decoder's projections (worker process): each of q/k/v, o, gate/up and down
gets the adapters of a step on top of its base output, whatever the base layer is (dense,
quantized CPU kernels, tensor-parallel part). `wrap_lora_targets` puts a `LoRALinear`
around each projection; the worker's lora_manager.py fills the slots and picks, each
step, every token's slot. Shapes: N tokens, S slots (--max-loras), P parts of a fused
projection (q, k, v: 3), R --max-lora-rank; a slot holds one adapter, zero-padded to R.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gateway.models.layers.parallel import Slice, rank_slice, shard_heads


class LoRAStep:
    """The step's slot selection, shared by every LoRA layer of a model: `mask` [N, S] is
    1 where token n runs slot s (a token of the base model has a zero row); None: no
    token of the step runs an adapter, and the layers run their base alone."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None


class LoRALinear(nn.Module):
    """y = base(x) + sum over slots s of mask[n, s] * x A_s^T B_s^T, as products over every
    slot at once: x [N, in] times the stacked A [P S R, in] gives [N, P S R]; the mask
    keeps each row's own slot; then, per part p of a fused projection, its [N, S R] times
    its stacked B [S R, out_p], added to its output columns. The scaling is folded into B
    at load."""

    def __init__(self, base: nn.Module, in_features: int, out_sizes: tuple[int, ...],
                 max_loras: int, max_rank: int, step: LoRAStep, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.base, self.step = base, step
        self.num_slots, self.max_rank, self.out_sizes = max_loras, max_rank, out_sizes
        rows = max_loras * max_rank
        # Plain tensors, not parameters or buffers: the checkpoint never names them.
        self.lora_a = torch.zeros(len(out_sizes) * rows, in_features, dtype=dtype,
                                  device=device)
        self.lora_b = [torch.zeros(rows, size, dtype=dtype, device=device)
                       for size in out_sizes]

    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]
                 ) -> None:
        """Fill `slot` with one (A [r, in], B scaled [out_p, r]) per part, None where the
        adapter leaves that part alone."""
        rank_rows, part_rows = self.max_rank, self.num_slots * self.max_rank
        row = slot * rank_rows
        for index, (b_stack, weights) in enumerate(zip(self.lora_b, parts, strict=True)):
            a_rows = self.lora_a[index * part_rows + row:index * part_rows + row + rank_rows]
            b_rows = b_stack[row:row + rank_rows]
            a_rows.zero_()
            b_rows.zero_()
            if weights is not None:
                a, b = weights
                a_rows[:a.shape[0]].copy_(a)
                b_rows[:a.shape[0]].copy_(b.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # [N, out]
        mask = self.step.mask
        if mask is None:
            return y
        num_tokens, part_rows = x.shape[0], self.num_slots * self.max_rank
        shrunk = F.linear(x, self.lora_a)  # [N, P S R]
        shrunk.view(num_tokens, len(self.out_sizes), self.num_slots, -1).mul_(
            mask.view(num_tokens, 1, -1, 1))
        if len(self.lora_b) == 1:
            return y.addmm_(shrunk, self.lora_b[0])
        column = 0
        for index, (size, b_stack) in enumerate(zip(self.out_sizes, self.lora_b, strict=True)):
            part = shrunk[:, index * part_rows:(index + 1) * part_rows]  # [N, S R]
            y[:, column:column + size].addmm_(part, b_stack)
            column += size
        return y


@dataclass(frozen=True)
class LoRATarget:
    """One wrapped projection: which checkpoint parts it holds and which of their rows
    (column-parallel: `out_slices`) or input columns (row-parallel: `in_slice`) this rank
    keeps; A of a column-parallel layer and B of a row-parallel one are held whole."""

    layer: int
    parts: tuple[str, ...]  # PEFT's module names, in the fused output's order
    out_slices: tuple[Slice, ...]
    in_slice: Slice | None
    module: LoRALinear


def wrap_lora_targets(model: Any, max_loras: int, max_rank: int, step: LoRAStep,
                      dtype: torch.dtype, device: torch.device) -> list[LoRATarget]:
    """Wrap the projections of the decoder `model` (models/archs/decoder.py) in place."""
    config, tp = model.config, model.tp
    dim, hidden = config.head_dim, config.hidden_size
    heads = shard_heads(config.num_attention_heads, config.num_key_value_heads, tp)
    q = Slice(heads.q_heads.start * dim, heads.q_heads.size * dim)
    kv = Slice(heads.kv_heads.start * dim, heads.kv_heads.size * dim)
    mlp_part = rank_slice(config.intermediate_size, tp)
    whole = Slice(0, hidden)
    targets = []
    for index, layer in enumerate(model.model.layers):
        specs = [(layer.self_attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"), (q, kv, kv),
                  None, hidden),
                 (layer.self_attn, "o_proj", ("o_proj",), (whole,), q, q.size),
                 (layer.mlp, "gate_up_proj", ("gate_proj", "up_proj"), (mlp_part, mlp_part),
                  None, hidden),
                 (layer.mlp, "down_proj", ("down_proj",), (whole,), mlp_part, mlp_part.size)]
        for owner, attr, parts, out_slices, in_slice, in_features in specs:
            if not hasattr(owner, attr):
                continue  # (a layer without that projection: none of its parts adapt)
            module = LoRALinear(getattr(owner, attr), in_features,
                                tuple(s.size for s in out_slices), max_loras, max_rank, step,
                                dtype, device)
            setattr(owner, attr, module)
            targets.append(LoRATarget(index, parts, out_slices, in_slice, module))
    return targets
