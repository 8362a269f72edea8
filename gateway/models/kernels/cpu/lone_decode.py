"""A lone decode in one C call (lone_decode.c), run by the worker's model runner: one
sequence's next token through every layer of the decoder (models/archs/decoder.py), on the
CPU, when the model's projections run in the gateway's kernels (weights kept quantized,
`Float32QuantWeight` or `BlockQuantWeight`, or float32 or bfloat16 weights kept transposed,
cpu_linear's `PackedLinear`): the torch forward's operations in the same order without an
op dispatch between them, its threads meeting at a spinning barrier of its own
(docs/cpu-performance.md). It also runs one sequence's verify step of speculative decoding
(its last token and drafts, each row as a lone decode computes it, the weights read once).
Which models and steps it serves: `LoneDecode`; the rest, and GATEWAY_CPU_LONE_DECODE=0,
run the torch forward."""

from __future__ import annotations

import ctypes
from typing import Any, cast

import numpy as np
import torch

from gateway import envs
from gateway.models.archs.decoder import DecoderForCausalLM
from gateway.models.info.decoder_config import DecoderConfig
from gateway.models.kernels.cpu.library import load
from gateway.models.kernels.cpu.quant_weight import BlockQuantWeight, Float32QuantWeight
from gateway.models.layers.attention import AttentionMetadata
from gateway.models.layers.cpu_linear import PackedLinear
from gateway.models.layers.quant_linear import QuantLinear

#: The longest context the one call attends over (its attention is one dot product a
#: key); longer contexts run the torch forward, whose attention is matrix products.
MAX_CONTEXT = 4096
#: The most tokens of one sequence one call runs (a verify step: the last token and up to
#: 15 drafts); more run the torch forward.
MAX_ROWS = 16

_i64 = ctypes.c_int64


class _Matrix(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("minimums", ctypes.c_void_p), ("rows", _i64), ("cols", _i64), ("bits", _i64),
                ("blocked", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("qkv", _Matrix), ("o", _Matrix), ("gate_up", _Matrix), ("down", _Matrix),
                ("kv_cache", ctypes.c_void_p)]


class _Dims(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
                ("intermediate", _i64), ("num_slots", _i64), ("block_size", _i64),
                ("eps", ctypes.c_double), ("cache_bf16", _i64), ("rows_bf16", _i64)]

#: The precision of a dense projection's transposed weight -> its `bits` for the call.
_DENSE_BITS = {torch.float32: 32, torch.bfloat16: 16}


def _matrix(module: Any) -> _Matrix | None:
    """The C view of a projection, or None where it is neither a bias-free float32-kernel
    one nor a bias-free float32 or bfloat16 one that keeps its weight transposed for single
    rows."""
    if isinstance(module, PackedLinear) and module.bias is None:
        weight_t = module.row_weight_t
        if (weight_t is None or weight_t.dtype not in _DENSE_BITS
                or not weight_t.is_contiguous()):
            return None
        return _Matrix(weight_t.data_ptr(), None, None, module.out_features,
                       module.in_features, _DENSE_BITS[weight_t.dtype],
                       int(module.row_weight_blocked))
    if not isinstance(module, QuantLinear) or module.bias is not None:
        return None
    weight = module.weight_q
    if isinstance(weight, BlockQuantWeight):  # its parts' C record (kquant.h), as bits 1
        return _Matrix(weight.address, None, None, *weight.shape, 1, 0)
    if not isinstance(weight, Float32QuantWeight):
        return None
    rows, cols = weight.shape
    return _Matrix(weight.codes.data_ptr(), weight.scales.data_ptr(),
                   weight.minimums.data_ptr(), rows, cols, weight.bits, 0)


def runs_shape_of(config: DecoderConfig) -> bool:
    """Whether the call computes what the decoder computes for `config`: Llama's shape (see
    `LoneDecode`); sliding windows are left to `applies`."""
    return (not (config.qkv_bias or config.o_bias or config.mlp_bias or config.qk_norm
                 or config.sandwich_norms)
            and config.moe is None  # the experts run in torch (layers/moe.py)
            and config.norm_weight_offset == 0.0 and config.hidden_act == "silu"
            and config.rotary_dim in (None, config.head_dim)
            and config.embedding_scale is None and config.attention_scale is None
            and config.local_rope_theta is None and config.final_logit_softcapping is None
            and config.head_dim % 2 == 0
            and config.num_attention_heads % config.num_key_value_heads == 0)


def _floats(weight: torch.Tensor) -> torch.Tensor:
    return weight.detach().to(torch.float32).contiguous()


class LoneDecode:
    """Runs a lone decode step of one model; `build` says whether the model can.

    Decided in `may_run` from the class and the config, then in `build` from the loaded
    layers, and per step in `applies`. The call runs Llama's shape (`runs_shape_of`): RMSNorm,
    q/k/v and the MLP without biases, rope over the whole head, no q/k norm, SiLU, no scale of
    the embeddings, the queries or the logits: Llama, SmolLM, Mistral, Phi-3 with full rotary;
    not Qwen2's q/k/v biases, Qwen3's q/k norms, Gemma 3, partial rotary. A model with sliding
    windows takes it while the context fits in its smallest window. It also needs our own
    class (not a plugin's subclass), one rank, float32 or bfloat16, every projection a
    quantized weight of the gateway's kernels (`Float32QuantWeight`, `BlockQuantWeight`) or
    a `PackedLinear` holding its transposed weight, and a step of one decode token with at
    most `MAX_CONTEXT` tokens of context, or of one sequence's 2 to `MAX_ROWS` tokens
    verifying drafts (the runner says when a step is that: `one_sequence`). In float32 the
    call and the torch forward agree to float32 rounding; in bfloat16 the call computes in
    float32 between its products where torch rounds every op to bfloat16, so they agree to
    bfloat16 rounding (the tests compare them). A verify step's rows equal lone decodes of
    its tokens bit for bit, except a bfloat16 model's dense rows on an AVX512-BF16 CPU,
    which take bfloat16 products (lone_decode.c).
    """

    def __init__(self, model: DecoderForCausalLM, library: ctypes.CDLL,
                 matrices: list[tuple[_Matrix, ...]], head: _Matrix | None,
                 dtype: torch.dtype) -> None:
        self.model, self.library, self.dtype = model, library, dtype
        #: The output layer, where the call computes the logits too (None: compute_logits).
        self.head = head
        config, inner = model.config, cast(Any, model.model)
        self.dims = _Dims(config.hidden_size, config.num_attention_heads,
                          config.num_key_value_heads, config.head_dim,
                          config.intermediate_size, 0, 0, config.rms_norm_eps, 0,
                          int(dtype == torch.bfloat16))
        self.matrices = matrices
        # The norms' weights as the call reads them, float32 (copies for a bfloat16 model:
        # a few KiB a layer).
        self.norms: list[tuple[torch.Tensor, torch.Tensor]] = [
            (_floats(layer.input_layernorm.weight), _floats(layer.post_attention_layernorm.weight))
            for layer in inner.layers]
        self.final_norm = _floats(inner.norm.weight)
        #: The longest context a step may have here: MAX_CONTEXT, and within every
        #: sliding window (the call attends over the whole context).
        self.max_context = min([MAX_CONTEXT, *(w for w in config.layer_windows if w)])
        floats = library.gw_lone_scratch_floats(ctypes.byref(self.dims), MAX_ROWS)
        self.scratch = torch.empty(floats, dtype=torch.float32)
        #: The call's threads: the worker's, taken here since a lone step runs the rest of
        #: its work on one (model_runner.py).
        self.threads = torch.get_num_threads()
        self._layers: Any = None
        self._caches_of: tuple[int, ...] = ()

    @staticmethod
    def may_run(model: Any, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether the call can serve `model` at all, as far as its class, config, device,
        dtype and ranks tell (build also checks its layers): what the loader asks before it
        keeps bfloat16 weights transposed, which only the call reads."""
        return (type(model).__module__ == DecoderForCausalLM.__module__  # not a plugin's
                and isinstance(model, DecoderForCausalLM) and runs_shape_of(model.config)
                and device.type == "cpu"
                and dtype in _DENSE_BITS and model.tp.size == 1 and envs.cpu_lone_decode())

    @classmethod
    def build(cls, model: Any, device: torch.device, dtype: torch.dtype) -> LoneDecode | None:
        """The one-call step for `model`, or None where it does not apply."""
        if not cls.may_run(model, device, dtype):
            return None
        library = load()
        if library is None:
            return None
        matrices, modules = [], cast(Any, model)
        for layer in modules.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            found = [_matrix(m) for m in (attn.qkv_proj, attn.o_proj,
                                          mlp.gate_up_proj, mlp.down_proj)]
            kept = tuple(m for m in found if m is not None)
            if len(kept) != len(found):
                return None
            matrices.append(kept)
        return cls(model, library, matrices, _matrix(modules.lm_head), dtype)

    def applies(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                one_sequence: bool = False) -> bool:
        """A lone decode token; or, where `one_sequence` (the step's tokens are one
        sequence's, at consecutive positions), up to MAX_ROWS tokens each a decode query."""
        num_tokens = input_ids.shape[0]
        if meta.prefills or meta.decode_context_len > self.max_context:
            return False
        if num_tokens == 1:
            return meta.num_decode_tokens == 1 and meta.decode_block_ids is not None
        return (one_sequence and num_tokens <= MAX_ROWS
                and meta.num_decode_tokens == num_tokens
                and meta.decode_block_table is not None)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[torch.Tensor], meta: AttentionMetadata
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As the model's forward, for a step `applies` accepts: hidden states [R, E] in the
        model's dtype, and the model's compute_logits of them [R, V] (float32) where the
        call computes those too (`head`; else None)."""
        inner = cast(Any, self.model.model)
        x = inner.embed_tokens(input_ids).to(torch.float32).contiguous()  # [R, E]
        cos, sin = inner.rotary_emb(positions, torch.float32)  # [R, 1, D] each
        cos, sin = cos.contiguous(), sin.contiguous()
        num_rows = x.shape[0]
        if num_rows == 1:
            assert meta.decode_block_ids is not None
            block_ids = np.ascontiguousarray(meta.decode_block_ids, dtype=np.int64)
        else:  # each row's table is the sequence's: the last row's covers them all
            assert meta.decode_block_table is not None
            block_ids = meta.decode_block_table[-1].numpy().astype(np.int64)
        out = torch.empty_like(x)
        head, logits = self.head, None
        if head is not None:
            logits = torch.empty(num_rows, head.rows, dtype=torch.float32)
        status = self.library.gw_lone_decode(
            ctypes.byref(self.dims), self._layer_array(kv_caches, meta.block_size),
            len(self.matrices), self.final_norm.data_ptr(),
            None if head is None else ctypes.byref(head), x.data_ptr(), cos.data_ptr(),
            sin.data_ptr(), block_ids.ctypes.data, meta.decode_context_len, num_rows,
            self.scratch.data_ptr(), out.data_ptr(),
            None if logits is None else logits.data_ptr(), self.threads)
        if status != 0:
            raise MemoryError("the lone decode kernel could not allocate its buffers")
        return out.to(self.dtype), logits

    def _layer_array(self, kv_caches: list[torch.Tensor], block_size: int) -> Any:
        """The layers' C records, built again only when the caches change."""
        key = tuple(cache.data_ptr() for cache in kv_caches)
        if self._layers is None or key != self._caches_of:
            if any(cache.dtype not in _DENSE_BITS or cache.dtype != kv_caches[0].dtype
                   or not cache.is_contiguous() for cache in kv_caches):
                raise ValueError("the lone decode needs contiguous float32 or bfloat16 KV "
                                 "caches")
            self.dims.num_slots, self.dims.block_size = kv_caches[0].shape[2], block_size
            self.dims.cache_bf16 = int(kv_caches[0].dtype == torch.bfloat16)
            records = (_Layer * len(self.matrices))()
            for record, (qkv, o, gate_up, down), (first, second), cache in zip(
                    records, self.matrices, self.norms, kv_caches, strict=True):
                record.input_norm, record.post_norm = first.data_ptr(), second.data_ptr()
                record.qkv, record.o, record.gate_up, record.down = qkv, o, gate_up, down
                record.kv_cache = cache.data_ptr()
            self._layers, self._caches_of = records, key
        return self._layers
