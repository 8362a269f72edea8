"""The decoder of every generative family the gateway serves (Llama, Mistral, Qwen2, Qwen3,
Gemma 3 text, Phi-3, Qwen3-MoE and Mixtral, whose MLPs are experts: layers/moe.py), run by
the worker. What differs between families is data in its `DecoderConfig` (docs/models.md).

One forward runs a flat batch of tokens from many sequences, prefill and decode mixed,
through the paged KV cache (models/layers/attention.py; on the CPU a lone decode may run as
one C call, models/kernels/cpu/lone_decode.py). Parameter names are the HF checkpoints'.
Shapes: N tokens, E hidden size, H query heads, KV kv heads, D head dim. With tensor
parallelism H and KV are the rank's share (the intermediate size and vocabulary too), the
forward all-reduces after o_proj and down_proj, and the per-head q/k norms are held whole.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from gateway.models.info.decoder_config import DecoderConfig, read_decoder_config
from gateway.models.layers.attention import AttentionMetadata, paged_attention
from gateway.models.layers.mlp import GatedMLP
from gateway.models.layers.moe import SparseMoE, expert_weights_mapping
from gateway.models.layers.norm import OffsetRMSNorm, RMSNorm
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
from gateway.models.layers.sliding_window import window_metadata

#: Checkpoint module name -> (our fused module, shard), where the checkpoint stores the
#: parts apart (every family but Phi-3, whose checkpoint names are the fused ones).
SEPARATE_PROJECTIONS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def _norm(config: DecoderConfig, size: int) -> RMSNorm:
    cls = OffsetRMSNorm if config.norm_weight_offset else RMSNorm
    return cls(size, config.rms_norm_eps)


class DecoderAttention(nn.Module):
    def __init__(self, config: DecoderConfig, tp: TensorParallel) -> None:
        super().__init__()
        heads = shard_heads(config.num_attention_heads, config.num_key_value_heads, tp)
        self.num_heads, self.num_kv_heads = heads.q_heads.size, heads.kv_heads.size
        self.head_dim = dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * dim, self.num_kv_heads * dim
        q_start, kv_start = heads.q_heads.start * dim, heads.kv_heads.start * dim
        full_q, full_kv = config.num_attention_heads * dim, config.num_key_value_heads * dim
        self.qkv_proj = MergedLinear(config.hidden_size, (self.q_size, self.kv_size, self.kv_size),
                                     bias=config.qkv_bias, row_starts=(q_start, kv_start, kv_start),
                                     full_sizes=(full_q, full_kv, full_kv))
        self.o_proj = RowParallelLinear(Slice(q_start, self.q_size), config.hidden_size,
                                        bias=config.o_bias, tp=tp)
        if config.qk_norm:
            self.q_norm, self.k_norm = _norm(config, dim), _norm(config, dim)
        self.has_qk_norm = config.qk_norm
        self.rotary_dim = config.rotary_dim or dim
        # paged_attention scales by D ** -0.5; a model's own scale is folded into q.
        self.q_factor = None if config.attention_scale is None else \
            config.attention_scale * dim ** 0.5
        self.tp = tp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens, dim = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)  # [N, (H + 2 KV) D]
        q = qkv[:, :self.q_size].view(num_tokens, self.num_heads, dim)
        qk_size = self.q_size + self.kv_size
        if self.has_qk_norm:  # per head, before rope; written back where q and k lie
            q.copy_(self.q_norm(q))
            k = qkv[:, self.q_size:qk_size].view(num_tokens, self.num_kv_heads, dim)
            k.copy_(self.k_norm(k))
        # Q and K rotated where they lie; K then V of each token are then already the
        # rows the cache takes, [N, 2 KV, D], with no copy.
        qk = qkv[:, :qk_size].view(num_tokens, -1, dim)  # [N, H + KV, D]
        apply_rotary_(qk if self.rotary_dim == dim else qk[..., :self.rotary_dim], cos, sin)
        if self.q_factor is not None:
            q.mul_(self.q_factor)
        kv = qkv[:, self.q_size:].view(num_tokens, 2 * self.num_kv_heads, dim)
        out = paged_attention(q, kv, kv_cache, meta)  # [N, H, D]
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, self.q_size)))


def _mlp(config: DecoderConfig, layer: int, tp: TensorParallel) -> nn.Module:
    """The layer's MLP: the experts where the config makes it an expert layer."""
    if config.moe is not None and config.is_moe_layer(layer):
        return SparseMoE(config.moe, config.hidden_size, config.hidden_act, tp)
    return GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias,
                    config.hidden_act, tp)


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig, tp: TensorParallel, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = _norm(config, config.hidden_size)
        self.self_attn = DecoderAttention(config, tp)
        # Llama: the norm before the MLP; Gemma 3 (sandwich): the norm of attention's output.
        self.post_attention_layernorm = _norm(config, config.hidden_size)
        self.mlp = _mlp(config, layer, tp)
        self.is_sandwich = config.sandwich_norms
        if self.is_sandwich:
            self.pre_feedforward_layernorm = _norm(config, config.hidden_size)
            self.post_feedforward_layernorm = _norm(config, config.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                pending: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream `x` [N, E] (the model's own buffer) is summed in place, each
        sum in the pass of the norm after it: `pending` is the previous layer's output, and
        the return value this layer's, for the next layer (or the final norm) to add."""
        h = self.input_layernorm.add_and_norm(x, pending)
        attn = self.self_attn(h, cos, sin, kv_cache, meta)  # [N, E]
        if not self.is_sandwich:
            return self.mlp(self.post_attention_layernorm.add_and_norm(x, attn))
        h = self.pre_feedforward_layernorm.add_and_norm(x, self.post_attention_layernorm(attn))
        return self.post_feedforward_layernorm(self.mlp(h))


class DecoderModel(nn.Module):
    def __init__(self, config: DecoderConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, tp, layer)
                                    for layer in range(config.num_hidden_layers))
        self.norm = _norm(config, config.hidden_size)
        rotary_dim = config.rotary_dim or config.head_dim
        max_positions = max(config.max_position_embeddings, config.context_length)
        self.rotary_emb = RotaryEmbedding(rotary_dim, max_positions, config.rope_theta,
                                          config.rope_scaling, config.rope_freq_factors)
        # Gemma 3's sliding layers: a rope of their own base, unscaled.
        self.local_rotary_emb = None if config.local_rope_theta is None else \
            RotaryEmbedding(rotary_dim, max_positions, config.local_rope_theta)
        self.embedding_scale = config.embedding_scale
        self.layer_windows = [config.window_of(i) for i in range(config.num_hidden_layers)]
        self.window_sizes = sorted({w for w in self.layer_windows if w is not None})

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [N, E]
        if self.embedding_scale is not None:  # rounded to the dtype first, as HF does
            x.mul_(torch.tensor(self.embedding_scale, dtype=x.dtype))
        rope = self.rotary_emb(positions, x.dtype)  # cos, sin [N, 1, D]
        local_rope = rope if self.local_rotary_emb is None else \
            self.local_rotary_emb(positions, x.dtype)
        metas: dict[int | None, AttentionMetadata] = {None: meta}
        for size in self.window_sizes:  # once per step, read by every layer of that window
            metas[size] = window_metadata(meta, positions, size, kv_caches[0])
        pending = None
        for layer, kv_cache, window in zip(self.layers, kv_caches, self.layer_windows,
                                           strict=True):
            cos, sin = rope if window is None else local_rope
            pending = layer(x, cos, sin, kv_cache, metas[window], pending)
        return self.norm.add_and_norm(x, pending)


class DecoderForCausalLM(nn.Module):
    """The served decoder; the subclasses below name the architecture whose config reader
    applies (a plugin's subclass inherits its parent's)."""

    architecture: ClassVar[str]
    supported_tasks: ClassVar[tuple[str, ...]] = ("generate",)
    #: The loader passes `tp` only to model classes that say they take it.
    supports_tensor_parallel: ClassVar[bool] = True

    def __init__(self, hf_config: dict[str, Any], tp: TensorParallel = SINGLE_RANK) -> None:
        super().__init__()
        self.config = read_decoder_config(self.architecture, hf_config)
        #: Checkpoint module name -> (fused module name, shard index), for the loader.
        self.packed_modules_mapping: dict[str, tuple[str, int]] = (
            {} if self.config.fused_checkpoint else dict(SEPARATE_PROJECTIONS))
        #: Checkpoint expert and router tensor -> (parameter, expert, shard), for the loader.
        self.expert_weights_mapping = expert_weights_mapping(self.config)
        self.model = DecoderModel(self.config, tp)
        self.lm_head = ParallelLMHead(self.config.hidden_size, self.config.vocab_size, tp)
        self.tp = tp
        self.num_local_kv_heads = shard_heads(self.config.num_attention_heads,
                                              self.config.num_key_value_heads, tp).kv_heads.size
        self.tie_weights()

    def fit_context(self, max_model_len: int) -> None:
        """Size the rope tables to the served context (the model runner calls this; it
        also picks longrope's short or long factors, as vLLM does)."""
        for rotary in (self.model.rotary_emb, self.model.local_rotary_emb):
            if rotary is not None:
                rotary.fit_positions(max_model_len)

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when the config ties them (the loader calls this
        again after moving the model off the meta device, which unties them)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def kv_cache_spec(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim): what one token's KV cache holds (on this rank)."""
        return self.config.num_hidden_layers, self.num_local_kv_heads, self.config.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [N] -> hidden states [N, E] (no logits)."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, E] of the rows to sample -> logits [R, vocab] (model dtype), the whole
        vocabulary on every rank."""
        logits = gather_logits(self.lm_head(hidden), self.config.vocab_size, self.tp)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap).mul_(cap)


# ------------------------------------------------------------------ the families, by HF name
class LlamaForCausalLM(DecoderForCausalLM):
    architecture = "LlamaForCausalLM"


class MistralForCausalLM(DecoderForCausalLM):
    architecture = "MistralForCausalLM"


class Qwen2ForCausalLM(DecoderForCausalLM):
    architecture = "Qwen2ForCausalLM"


class Qwen3ForCausalLM(DecoderForCausalLM):
    architecture = "Qwen3ForCausalLM"


class Gemma3ForCausalLM(DecoderForCausalLM):
    architecture = "Gemma3ForCausalLM"


class Phi3ForCausalLM(DecoderForCausalLM):
    architecture = "Phi3ForCausalLM"


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    architecture = "Qwen3MoeForCausalLM"


class MixtralForCausalLM(DecoderForCausalLM):
    architecture = "MixtralForCausalLM"
