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

from typing import Any, ClassVar

import torch
from torch import nn

from gateway.models.info.decoder_config import LlamaConfig
from gateway.models.layers.attention import AttentionMetadata, paged_attention
from gateway.models.layers.mlp import GatedMLP
from gateway.models.layers.norm import RMSNorm
from gateway.models.layers.parallel import (
    SINGLE_RANK,
    MergedLinear,
    ParallelLMHead,
    RowParallelLinear,
    Slice,
    TensorParallel,
    VocabParallelEmbedding,
    gather_logits,
    shard_heads,
)
from gateway.models.layers.rotary import RotaryEmbedding, apply_rotary_


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


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias,
                            "silu", tp)

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
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                          config.rope_theta, config.rope_scaling,
                                          config.rope_freq_factors)

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
