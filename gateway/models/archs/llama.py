"""A Llama-style decoder (Llama 1-3, Mistral without sliding window, SmolLM), served by the
worker.

One forward runs a flattened batch of tokens from many sequences at different positions,
prefill and decode mixed, reading and writing a paged KV cache (see attention.py).
Parameter names match HF checkpoints, except the fused ones, which
`packed_modules_mapping` maps: q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj.

With tensor parallelism (models/parallel.py) each rank builds the same modules with its
share of the heads, the intermediate size and the vocabulary; H, KV, I and V below are then
the rank's counts, and the forward all-reduces after o_proj and down_proj.

Shapes: N tokens in the step, E hidden size, H query heads, KV kv heads, D head dim.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from gateway.models.info.decoder_config import LlamaConfig
from gateway.models.kernels.cpu import elementwise
from gateway.models.layers.attention import AttentionMetadata, paged_attention
from gateway.models.layers.parallel import (
    SINGLE_RANK,
    ParallelLMHead,
    RowParallelLinear,
    Slice,
    TensorParallel,
    VocabParallelEmbedding,
    gather_logits,
    rank_slice,
    shard_heads,
)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one call instead of HF's seven ops (same sums)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # As HF computes it: normalise in float32, round to the input dtype, then scale.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """x += delta in place (x is the residual stream; no delta: nothing to add), then
        the norm of x: on the CPU in one pass of the gateway's kernels."""
        if type(self) is RMSNorm:  # the kernel's norm is this class's, not a subclass's
            out = elementwise.add_rms_norm(x, delta, self.weight, self.eps)
            if out is not None:
                return out
        return self(x if delta is None else x.add_(delta))


def rope_inverse_frequencies(config: LlamaConfig) -> torch.Tensor:
    """[D / 2] float32 inverse frequencies, with rope scaling ("linear", "llama3")."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta
                      ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        factor = float(scaling["factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    elif rope_type not in ("default", None):
        raise ValueError(f"rope scaling type {rope_type!r} is not supported "
                         f"(supported: none, linear, llama3)")
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos and signed sin tables [max_len, D], built on first use on the model's device."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        # An unsupported rope type fails at load, not later. On the CPU: the model is built
        # on the meta device, where these ops would import torch._dynamo (~2 s).
        with torch.device("cpu"):
            rope_inverse_frequencies(config)
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin [N, 1, D] for `positions` [N]; sin's first half is negated."""
        if self._tables is None or self._tables[0].dtype != dtype:
            inv_freq = rope_inverse_frequencies(self.config).to(positions.device)
            steps = torch.arange(self.config.max_position_embeddings, dtype=torch.float32,
                                 device=positions.device)
            freqs = torch.outer(steps, inv_freq)  # [max_len, D / 2]
            cos, sin = freqs.cos(), freqs.sin()
            self._tables = (torch.cat((cos, cos), dim=-1).to(dtype),
                            torch.cat((-sin, sin), dim=-1).to(dtype))
        cos, sin = self._tables
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] rotated in place in HF's half-split layout: x * cos + rotate_half(x)
    * sin, with rotate_half(x) * sin = [x2, x1] * [-sin, sin] (`sin` comes signed; rolling
    the last dim by D / 2 gives [x2, x1] in one op)."""
    if elementwise.rotary_(x, cos, sin):  # on the CPU: one pass, no copy of x
        return x
    swapped = x.roll(x.shape[-1] // 2, -1)
    return x.mul_(cos).addcmul_(swapped, sin)


class MergedLinear(nn.Linear):
    """Projections of one input fused into one matmul; `shard_sizes` are their output rows
    in checkpoint order (q, k, v or gate, up), which the loader fills one by one. With
    tensor parallelism a rank holds rows [start, start + size) of each checkpoint tensor
    (column-parallel): `row_starts` gives the starts."""

    def __init__(self, in_features: int, shard_sizes: tuple[int, ...], bias: bool,
                 row_starts: tuple[int, ...] | None = None) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes, self.row_starts = shard_sizes, row_starts

    def checkpoint_part(self, param_name: str, shard: int | None,
                        tensor: torch.Tensor) -> torch.Tensor:
        if self.row_starts is None or shard is None:
            return tensor
        return tensor.narrow(0, self.row_starts[shard], self.shard_sizes[shard])


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, tp: TensorParallel) -> None:
        super().__init__()
        heads = shard_heads(config.num_attention_heads, config.num_key_value_heads, tp)
        self.num_heads, self.num_kv_heads = heads.q_heads.size, heads.kv_heads.size
        self.head_dim = dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * dim, self.num_kv_heads * dim
        q_start, kv_start = heads.q_heads.start * dim, heads.kv_heads.start * dim
        self.qkv_proj = MergedLinear(config.hidden_size, (self.q_size, self.kv_size, self.kv_size),
                                     bias=config.attention_bias,
                                     row_starts=(q_start, kv_start, kv_start))
        self.o_proj = RowParallelLinear(Slice(q_start, self.q_size), config.hidden_size,
                                        bias=config.attention_bias, tp=tp)
        self.tp = tp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens, dim = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)  # [N, (H + 2 KV) D]
        # Q and K rotated where they lie; K then V of each token are then already the
        # rows the cache takes, [N, 2 KV, D], with no copy.
        qk_size = self.q_size + self.kv_size
        apply_rotary_(qkv[:, :qk_size].view(num_tokens, -1, dim), cos, sin)
        q = qkv[:, :self.q_size].view(num_tokens, self.num_heads, dim)
        kv = qkv[:, self.q_size:].view(num_tokens, 2 * self.num_kv_heads, dim)
        out = paged_attention(q, kv, kv_cache, meta)  # [N, H, D]
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, self.q_size)))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig, tp: TensorParallel) -> None:
        super().__init__()
        part = rank_slice(config.intermediate_size, tp)
        self.gate_up_proj = MergedLinear(config.hidden_size, (part.size, part.size),
                                         bias=config.mlp_bias, row_starts=(part.start, part.start))
        self.down_proj = RowParallelLinear(part, config.hidden_size, bias=config.mlp_bias, tp=tp)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [N, 2 I]: gate, up
        act = elementwise.silu_mul(gate_up)  # on the CPU: one pass
        if act is None:
            size = gate_up.shape[-1] // 2
            act = F.silu(gate_up[:, :size]).mul_(gate_up[:, size:])
        return self.tp.all_reduce(self.down_proj(act))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                pending: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream `x` (the model's own buffer) is summed in place, each sum in
        the pass of the norm after it: `pending` is the previous layer's MLP output, and the
        return value this layer's, for the next layer (or the final norm) to add."""
        h = self.input_layernorm.add_and_norm(x, pending)
        attn = self.self_attn(h, cos, sin, kv_cache, meta)
        return self.mlp(self.post_attention_layernorm.add_and_norm(x, attn))


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [N, E]
        cos, sin = self.rotary_emb(positions, x.dtype)
        pending = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            pending = layer(x, cos, sin, kv_cache, meta, pending)
        return self.norm.add_and_norm(x, pending)


class LlamaForCausalLM(nn.Module):
    supported_tasks: ClassVar[tuple[str, ...]] = ("generate",)
    #: The loader passes `tp` only to model classes that say they take it.
    supports_tensor_parallel: ClassVar[bool] = True
    # checkpoint module name -> (fused module name, shard index)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, hf_config: dict[str, Any], tp: TensorParallel = SINGLE_RANK) -> None:
        super().__init__()
        self.config = LlamaConfig.from_hf(hf_config)
        self.model = LlamaModel(self.config, tp)
        self.lm_head = ParallelLMHead(self.config.hidden_size, self.config.vocab_size, tp)
        self.tp = tp
        self.num_local_kv_heads = shard_heads(self.config.num_attention_heads,
                                              self.config.num_key_value_heads, tp).kv_heads.size
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when the config ties them (the loader calls this
        again after moving the model off the meta device, which unties them)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def kv_cache_spec(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim): what one token's KV cache holds (on this rank)."""
        cfg = self.config
        return cfg.num_hidden_layers, self.num_local_kv_heads, cfg.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [N] -> hidden states [N, E] (no logits)."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, E] of the rows to sample -> logits [R, vocab] (model dtype), the whole
        vocabulary on every rank."""
        return gather_logits(self.lm_head(hidden), self.config.vocab_size, self.tp)
