"""A BERT-style encoder (BERT, MiniLM, sentence-transformers' BERT models) for embeddings,
run by the worker. RoBERTa-style encoders reuse these layers (roberta.py); classification
heads sit on top of them (classifier.py).

One forward encodes a packed batch: every sequence's tokens one after the other, no
padding, and no KV cache (an encoder sees the whole prompt in one step). Only the
bidirectional self-attention needs a [sequences, length] layout: each layer scatters its
packed q, k, v into padded groups of similar length, padded keys masked, and gathers the
result back. Shapes: N tokens in the step, S sequences, L a group's longest sequence, E
hidden size, H heads, D head dim, I intermediate size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from gateway.models.layers.parallel import MergedLinear
from gateway.models.loading.loader import copy_weights

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
# Sequences up to this long share one attention group whatever their lengths: attending
# over a little padding costs less than another kernel call per layer.
_SHORT_SEQUENCE = 64


@dataclass
class BertConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> BertConfig:
        position_type = config.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ValueError(f"position_embedding_type {position_type!r} is not supported "
                             f"(absolute)")
        act = config.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported ({', '.join(_ACTIVATIONS)})")
        return cls(
            vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=int(config["num_attention_heads"]),
            max_position_embeddings=int(config.get("max_position_embeddings", 512)),
            type_vocab_size=int(config.get("type_vocab_size", 2)),
            layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)), hidden_act=act)


@dataclass
class AttentionGroup:
    """Consecutive sequences attended together, padded to the longest of them."""

    first_token: int  # packed index of the group's first token
    num_tokens: int
    num_seqs: int
    max_len: int  # L
    pad_index: torch.Tensor | None  # [S * L] packed token of each padded slot; None: no padding
    unpad_index: torch.Tensor | None  # [tokens] padded slot of each of the group's tokens
    key_mask: torch.Tensor | None  # [S, 1, 1, L] bool, True for real keys


def attention_groups(seq_lens: Sequence[int], device: torch.device) -> list[AttentionGroup]:
    """Split the packed sequences (in order) into groups of similar length: a group grows
    while the next sequence is short or at most twice as long as the group's shortest."""
    groups: list[AttentionGroup] = []
    start, first_token, shortest = 0, 0, 0
    for end in range(1, len(seq_lens) + 1):
        shortest = seq_lens[start] if end == start + 1 else min(shortest, seq_lens[end - 1])
        if end < len(seq_lens) and seq_lens[end] <= max(_SHORT_SEQUENCE, 2 * shortest):
            continue
        groups.append(_group(seq_lens[start:end], first_token, device))
        first_token += groups[-1].num_tokens
        start = end
    return groups


def _group(lens: Sequence[int], first_token: int, device: torch.device) -> AttentionGroup:
    num_tokens, max_len = sum(lens), max(lens)
    if all(length == max_len for length in lens):
        return AttentionGroup(first_token, num_tokens, len(lens), max_len, None, None, None)
    lengths = torch.tensor(lens, dtype=torch.int64)
    slots = torch.arange(max_len).expand(len(lens), max_len)
    key_mask = slots < lengths[:, None]  # [S, L]
    offsets = torch.cumsum(lengths, 0) - lengths
    # Padded slots read their sequence's first token (masked as a key, dropped as a query).
    pad_index = first_token + offsets[:, None] + torch.where(key_mask, slots, 0)
    unpad_index = (torch.arange(len(lens))[:, None] * max_len + slots)[key_mask]
    return AttentionGroup(first_token, num_tokens, len(lens), max_len,
                          pad_index.reshape(-1).to(device), unpad_index.to(device),
                          key_mask.view(len(lens), 1, 1, max_len).to(device))


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)  # [N, E]
        if token_type_ids is None:  # one segment per sequence: every token has type 0
            return self.LayerNorm(x + self.token_type_embeddings.weight[0])
        return self.LayerNorm(x + self.token_type_embeddings(token_type_ids))


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        size = config.hidden_size
        self.qkv_proj = MergedLinear(size, (size, size, size), bias=True)

    def forward(self, x: torch.Tensor, groups: list[AttentionGroup]) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [N, 3E]
        outs = [self._attend(qkv.narrow(0, g.first_token, g.num_tokens) if g.pad_index is None
                             else qkv.index_select(0, g.pad_index), g) for g in groups]
        return outs[0] if len(outs) == 1 else torch.cat(outs)  # [N, E]

    def _attend(self, qkv: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
        """qkv [S * L, 3E] of one group -> attention output [tokens, E]."""
        num_seqs, max_len = group.num_seqs, group.max_len
        q, k, v = qkv.view(num_seqs, max_len, 3, self.num_heads, self.head_dim).permute(
            2, 0, 3, 1, 4).unbind(0)  # [S, H, L, D] each
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.key_mask)
        out = out.transpose(1, 2).reshape(num_seqs * max_len, -1)  # [S * L, E]
        return out if group.unpad_index is None else out.index_select(0, group.unpad_index)


class BertSelfOutput(nn.Module):
    """The attention's output projection, residual and post-norm."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, attended: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(attended) + x)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)  # the checkpoint's name: attention.self.*
        self.output = BertSelfOutput(config)

    def forward(self, x: torch.Tensor, groups: list[AttentionGroup]) -> torch.Tensor:
        return self.output(self.self(x, groups), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))  # [N, I]


class BertOutput(nn.Module):
    """The MLP's down projection, residual and post-norm."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden) + x)


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, x: torch.Tensor, groups: list[AttentionGroup]) -> torch.Tensor:
        x = self.attention(x, groups)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor, groups: list[AttentionGroup]) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, groups)
        return x


class BertModel(nn.Module):
    """The encoder. Parameter names match HF checkpoints (with or without the "bert." prefix of
    BertFor* checkpoints); `packed_modules_mapping` fuses query/key/value into one qkv_proj.
    A sentence pair (a cross-encoder's input) may carry token types: 0 for the first text, 1
    for the second; a single text is all type 0.
    """

    supported_tasks: tuple[str, ...] = ("embed",)  # a classifier's depend on its labels
    # checkpoint module name -> (fused module name, shard index)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {
        "query": ("qkv_proj", 0), "key": ("qkv_proj", 1), "value": ("qkv_proj", 2)}
    #: The prefix of the encoder's tensors in a task checkpoint (BertFor*: "bert.").
    checkpoint_prefix: ClassVar[str] = "bert."

    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__()
        self.config = BertConfig.from_hf(hf_config)
        self.num_token_types = self.config.type_vocab_size
        self.embeddings = BertEmbeddings(self.config)
        self.encoder = BertEncoder(self.config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                seq_lens: Sequence[int], token_type_ids: torch.Tensor | None = None,
                ) -> torch.Tensor:
        """input_ids, positions (and token_type_ids, None: all 0) [N] of packed sequences
        of `seq_lens` tokens -> the last hidden states [N, E]."""
        groups = attention_groups(seq_lens, input_ids.device)
        return self.encoder(self.embeddings(input_ids, positions, token_type_ids), groups)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy an HF checkpoint: the encoder's names, or a task checkpoint's under
        `checkpoint_prefix`; a pooler or task head this class lacks is not used."""
        return copy_weights(self, ((_checkpoint_name(name, self.checkpoint_prefix), tensor)
                                   for name, tensor in weights))


def _checkpoint_name(name: str, prefix: str) -> str:
    name = name.removeprefix(prefix)
    # Checkpoints converted from TensorFlow name the LayerNorm parameters gamma and beta.
    if ".LayerNorm." in name:
        name = name.replace(".LayerNorm.gamma", ".LayerNorm.weight")
        name = name.replace(".LayerNorm.beta", ".LayerNorm.bias")
    return name
