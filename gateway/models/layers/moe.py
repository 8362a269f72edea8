"""The mixture-of-experts layer of the worker's decoder, in place of its MLP where the
config says so (Qwen3-MoE, Mixtral): a router picks each token's top-k experts, each a
gated MLP, and the token's output is their outputs weighted by the router.

The experts run as two grouped products (torch's grouped_mm on the CPU, and on CUDA in
bfloat16; batched products otherwise): the (token, expert) pairs sorted by expert, each
expert's rows times its weight, so a step reads only the experts its tokens chose, with
no Python work per expert. With tensor parallelism each rank holds a slice of every
expert's intermediate size (gate/up by rows, down by columns) and all-reduces once. A
GGUF's experts stay quantized on the CPU with one rank instead (quant_experts.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gateway.models.info.decoder_config import DecoderConfig, MoEConfig
from gateway.models.layers.mlp import GATED_ACTIVATIONS
from gateway.models.layers.parallel import TensorParallel, rank_slice


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [N, experts] -> (weights [N, k] float32, experts [N, k]): the softmax
    over all experts in float32, its top k, renormalised to sum 1 when asked (Mixtral,
    Qwen3-MoE's norm_topk_prob), as transformers routes."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, experts


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                   row_experts: torch.Tensor) -> torch.Tensor:
    """rows [M, in] sorted by expert, weight [experts, out, in], offsets [experts] int32 (the
    end of each expert's rows), row_experts [M] (each row's expert) -> [M, out]: each
    expert's rows times its weight, transposed, in one grouped product. Where grouped_mm
    does not run (CUDA in another dtype than bfloat16; sizes off its 16-byte strides, as a
    rank's odd slice of a tiny model) a few rows multiply their own expert's weight
    gathered, many rows all experts' weights in one batched product of padded groups."""
    if _grouped_mm_runs(rows, weight):
        return F.grouped_mm(rows, weight.transpose(1, 2), offs=offsets)
    if rows.shape[0] <= weight.shape[0]:  # at most one weight's worth of rows gathered
        return gathered_linear(rows, weight, row_experts)
    return padded_linear(rows, weight, offsets, row_experts)


def gathered_linear(rows: torch.Tensor, weight: torch.Tensor,
                    row_experts: torch.Tensor) -> torch.Tensor:
    """grouped_linear as one batched product of each row's own expert's weight."""
    chosen = weight.index_select(0, row_experts)  # [M, out, in]
    return torch.bmm(chosen, rows.unsqueeze(2)).squeeze(2)


def padded_linear(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                  row_experts: torch.Tensor) -> torch.Tensor:
    """grouped_linear as one batched product over every expert, each expert's rows padded
    with zeros to the largest group's count (one read of each weight)."""
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    starts = (offsets - counts).long()
    slots = torch.arange(rows.shape[0], device=rows.device) - starts.index_select(0, row_experts)
    padded = rows.new_zeros(weight.shape[0], int(counts.max()), rows.shape[1])
    padded[row_experts, slots] = rows
    out = torch.bmm(padded, weight.transpose(1, 2))  # [experts, largest count, out]
    return out[row_experts, slots]


def _grouped_mm_runs(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    if rows.device.type == "cuda":
        if rows.dtype != torch.bfloat16 or torch.cuda.get_device_capability(rows.device) < (8, 0):
            return False
    elif rows.device.type != "cpu":
        return False
    size = rows.element_size()
    return all(stride * size % 16 == 0 for stride in (*rows.stride()[:-1], *weight.stride()[:-1]))


class FusedExperts(nn.Module):
    """Every expert's weights in two tensors: gate_up_proj [experts, 2 I, E] (gate rows,
    then up) and down_proj [experts, E, I], I the rank's part of the intermediate size.
    The checkpoint stores each expert's projections apart; the loader fills them one by
    one (`checkpoint_part` cuts the rank's part)."""

    def __init__(self, config: MoEConfig, hidden_size: int, act: str,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.num_experts, self.num_ranks = config.num_experts, tp.size
        self.part = rank_slice(config.intermediate_size, tp)
        size = self.part.size
        self.gate_up_proj = nn.Parameter(torch.empty(config.num_experts, 2 * size, hidden_size),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(config.num_experts, hidden_size, size),
                                      requires_grad=False)
        #: rows of gate_up_proj per checkpoint shard (gate, up), for the loader.
        self.shard_sizes = (size, size)
        self.act_mul = GATED_ACTIVATIONS[act]

    def checkpoint_part(self, param_name: str, shard: int | None,
                        tensor: torch.Tensor) -> torch.Tensor:
        """One expert's gate or up [I, E] -> the rank's rows; its down [E, I] -> columns."""
        if self.num_ranks == 1:
            return tensor
        dim = -2 if param_name == "gate_up_proj" else -1
        return tensor.narrow(dim, self.part.start, self.part.size)

    def forward(self, x: torch.Tensor, weights: torch.Tensor,
                experts: torch.Tensor) -> torch.Tensor:
        """x [N, E], weights and experts [N, k] -> [N, E] (this rank's partial sum)."""
        groups = ExpertGroups.of(experts, self.num_experts)
        gate_up = grouped_linear(x.index_select(0, groups.tokens), self.gate_up_proj,
                                 groups.offsets, groups.row_experts)  # [N k, 2 I]
        out = grouped_linear(self.act_mul(gate_up), self.down_proj, groups.offsets,
                             groups.row_experts)
        return groups.combine(out, weights, x)


@dataclass(frozen=True)
class ExpertGroups:
    """A step's (token, expert) pairs sorted by expert: `order` [N k] (pair p is token
    p // k's slot p % k), each sorted pair's token and expert [N k], and `offsets` [experts]
    int32, the end of each expert's pairs."""

    order: torch.Tensor
    tokens: torch.Tensor
    row_experts: torch.Tensor
    offsets: torch.Tensor

    @classmethod
    def of(cls, experts: torch.Tensor, num_experts: int) -> ExpertGroups:
        """experts [N, k] (the router's choices) -> their groups."""
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)
        offsets = torch.bincount(flat, minlength=num_experts).cumsum(0).to(torch.int32)
        return cls(order, order // experts.shape[1], flat.index_select(0, order), offsets)

    def combine(self, out: torch.Tensor, weights: torch.Tensor,
                x: torch.Tensor) -> torch.Tensor:
        """The sorted pairs' outputs [N k, E] weighted by the router's `weights` [N, k] and
        summed per token -> [N, E] in x's dtype (`out` is scaled in place)."""
        out *= weights.reshape(-1).index_select(0, self.order).unsqueeze(1).to(out.dtype)
        return torch.zeros_like(x).index_add_(0, self.tokens, out.to(x.dtype))


class SparseMoE(nn.Module):
    """The router (`gate`, [experts, E], whole on every rank) and the experts."""

    def __init__(self, config: MoEConfig, hidden_size: int, act: str,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, config.num_experts, bias=False)
        self.experts = FusedExperts(config, hidden_size, act, tp)
        self.top_k, self.renormalize = config.top_k, config.renormalize
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.top_k, self.renormalize)  # [N, k]
        return self.tp.all_reduce(self.experts(x, weights, experts))


ExpertMapping = dict[str, tuple[str, int | None, int | None]]


def expert_weights_mapping(config: DecoderConfig) -> ExpertMapping:
    """Checkpoint name of each expert's tensor and each router -> (our parameter, expert,
    shard): gate and up are rows of experts.gate_up_proj[expert] (shards 0 and 1), down is
    experts.down_proj[expert]; a router is the layer's mlp.gate.weight. A GGUF's experts,
    stacked, are named without the expert (expert None: all of them)."""
    if config.moe is None:
        return {}
    moe, mapping = config.moe, ExpertMapping()
    gate, up, down = moe.projections
    targets = {gate: ("gate_up_proj", 0), up: ("gate_up_proj", 1), down: ("down_proj", None)}
    for layer in range(config.num_hidden_layers):
        if not config.is_moe_layer(layer):
            continue
        ours, theirs = f"model.layers.{layer}.mlp", f"model.layers.{layer}.{moe.module}"
        mapping[f"{theirs}.gate.weight"] = (f"{ours}.gate.weight", None, None)
        for expert in range(moe.num_experts):
            for projection, (param, shard) in targets.items():
                mapping[f"{theirs}.experts.{expert}.{projection}.weight"] = (
                    f"{ours}.experts.{param}", expert, shard)
        for projection, (param, shard) in targets.items():
            mapping[f"{theirs}.experts.{projection}.weight"] = (f"{ours}.experts.{param}",
                                                                None, shard)
    return mapping
