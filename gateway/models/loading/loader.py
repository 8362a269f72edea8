"""Build the served model and load its weights (worker process).

The model class comes from the registry by the config's architecture; it is built on the
meta device (no random init), materialised on the target device, then filled from the
GGUF file or the safetensors files, in the configured dtype. Fused parameters (qkv_proj,
gate_up_proj) are filled shard by shard through `packed_modules_mapping`; every parameter
must be loaded, or the error names the tensor. A GGUF's Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 and
K-quant weights stay quantized on the CPU (quantization "gguf"; the dtype is then the
activations'), and so do stacked experts where one rank holds them whole; other types,
"none", tensor parallelism's experts and the GPU dequantize.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from gateway.logger import init_logger
from gateway.models.info.gguf_file import GGUFFile
from gateway.models.info.paths import ModelInfo
from gateway.models.info.registry import ModelRegistry
from gateway.models.info.support import check_supported
from gateway.models.kernels.cpu import library as cpu_kernels
from gateway.models.kernels.cpu import quant_weight
from gateway.models.kernels.cpu.lone_decode import LoneDecode
from gateway.models.layers.cpu_linear import can_pack, pack_linear_layers
from gateway.models.layers.gguf_quant import (
    BLOCK_KEPT_TYPES,
    KEPT_TYPES,
    BlockWeight,
    KeptWeight,
    QuantWeight,
    StackedExperts,
)
from gateway.models.layers.moe import FusedExperts
from gateway.models.layers.parallel import TensorParallel
from gateway.models.layers.quant_linear import can_run as can_run_int4
from gateway.models.loading.gguf_weights import iter_gguf_weights
from gateway.models.loading.quantized import QuantizedParams, weight_bytes
from gateway.platforms.cpu_isa import cpu_isa
from gateway.platforms.interface import Platform

logger = init_logger(__name__)

_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}
_DENSE_TYPES = frozenset({"F32", "F16", "BF16", "F64"})
QUANTIZATIONS = ("gguf", "none")  # --quantization (None: gguf for a quantized GGUF file)
_PROGRESS_STEP = 0.25  # log a line each time this fraction of the weights is loaded...
_PROGRESS_MIN_BYTES = 64 * 1024**2  # ...of weights at least this large


def resolve_dtype(name: str, platform: type[Platform]) -> torch.dtype:
    """The torch dtype for ModelConfig.dtype on `platform`; "auto": bfloat16 where the
    device computes it natively (CUDA, CPUs with AVX512-BF16 or AMX), else float32."""
    if name == "auto":
        name = "bfloat16" if _has_native_bf16(platform) else "float32"
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not known; use auto, {', '.join(_DTYPES)}")
    dtype = _DTYPES[name]
    platform.check_dtype(str(dtype).removeprefix("torch."))
    return dtype


def resolve_model_dtype(name: str, platform: type[Platform], info: ModelInfo,
                        quantization: str | None = None) -> torch.dtype:
    """resolve_dtype for the model `info` served at --quantization `quantization`. "auto"
    keeps float32:
    - for a pooling (embedding, classification) model whose checkpoint is float32 or names
      no dtype, as vLLM does: bfloat16 is faster on CPUs with native bf16, but moves
      MiniLM's embeddings ~5e-5 in cosine distance from float32's, close to what embedding
      comparisons tolerate;
    - for a GGUF file whose weights stay quantized in the gateway's kernels,
      on a CPU without AVX512-BF16 products (gw_quant_matmul_bf16): there they compute in
      float32 whatever the activations are, so bfloat16 would only add a conversion each
      way at every product. Where the CPU has them (AVX512-BF16), steps of
      many rows run faster in bfloat16 (docs/quantization.md), and a lone decode is one C
      call in either.
    An explicit dtype is honoured."""
    if name == "auto" and info.is_pooling:
        checkpoint_dtype = info.hf_config.get("torch_dtype") or info.hf_config.get("dtype")
        if checkpoint_dtype in (None, "float32"):
            name = "float32"
    if name == "auto" and _kept_in_gateway_kernels(info, platform, quantization) \
            and not quant_weight.has_bf16_products():
        name = "float32"
    return resolve_dtype(name, platform)


def _kept_in_gateway_kernels(info: ModelInfo, platform: type[Platform],
                             quantization: str | None) -> bool:
    """Whether some of `info`'s weights stay quantized in the gateway's kernels."""
    if (info.format != "gguf" or quantization not in (None, "gguf") or not platform.is_cpu()
            or cpu_kernels.load() is None):
        return False
    stat = os.stat(info.path)
    return _holds_kept_types(str(info.path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _holds_kept_types(path: str, mtime_ns: int, size: int) -> bool:
    """Whether the GGUF file at `path` holds tensors kept quantized (Q4_0, Q4_1, Q8_0, the
    5-bit and K-quant types): its header read once per version of the file (the dtype's
    choice and its log line both ask)."""
    del mtime_ns, size  # the cache's key only
    return any(tensor.qtype in KEPT_TYPES | BLOCK_KEPT_TYPES
               for tensor in GGUFFile(path).tensors.values())


def _holds_block_types(path: str) -> bool:
    """Whether the GGUF file at `path` holds types only the float32 block kernels run."""
    return any(tensor.qtype in BLOCK_KEPT_TYPES for tensor in GGUFFile(path).tensors.values())


def explain_dtype(name: str, platform: type[Platform], info: ModelInfo,
                  quantization: str | None = None) -> str:
    """Why resolve_model_dtype picks what it picks, for the start-up log."""
    if name != "auto":
        return f"--dtype {name}"
    if info.is_pooling and resolve_model_dtype(name, platform, info) == \
            torch.float32:
        return "auto: float32 for a pooling model with a float32 checkpoint"
    if _has_native_bf16(platform) and _kept_in_gateway_kernels(info, platform, quantization):
        if not quant_weight.has_bf16_products():
            return ("auto: float32, since the GGUF's quantized weights run in the gateway's "
                    "float32 kernels (bfloat16 activations would only add conversions)")
        return ("auto: bfloat16, which this CPU computes natively; the GGUF's quantized "
                "weights run in the gateway's AVX512-BF16 kernels"
                + (" (its K-quant and 5-bit ones in float32 kernels, their rows converted)"
                   if _holds_block_types(str(info.path)) else ""))
    if _has_native_bf16(platform):
        return f"auto: bfloat16, which this {platform.device_name} computes natively"
    if platform.is_cpu():
        return (f"auto: float32, since this CPU ({cpu_isa().describe()}) has no native "
                "bfloat16 (no AVX512-BF16 or AMX), where bfloat16 would be emulated and "
                "several times slower")
    return f"auto: float32, since this {platform.device_name} has no native bfloat16"


def _has_native_bf16(platform: type[Platform]) -> bool:
    if "bfloat16" not in platform.supported_dtypes:
        return False
    if platform.is_cuda():
        return bool(torch.cuda.is_bf16_supported())
    if platform.is_cpu():
        return cpu_isa().has_native_bf16
    return True


def resolve_quantization(name: str | None, info: ModelInfo, device: torch.device) -> str:
    """"gguf" (keep a GGUF file's quantized weights of the kept types) or "none" for the
    --quantization value `name`. None: gguf for a GGUF file where the gateway's float32
    kernels run (as vLLM serves a GGUF quantized), else none (dequantized: torch's int4
    kernel computes in bfloat16, which flips near-tied greedy answers). Raises ValueError
    naming a value that cannot apply."""
    if name not in (None, *QUANTIZATIONS):
        raise ValueError(f"quantization {name!r} is not supported (supported: "
                         f"{', '.join(QUANTIZATIONS)})")
    on_cpu = device.type == "cpu"
    if name == "gguf":
        if info.format != "gguf":
            raise ValueError(f"quantization 'gguf' needs a .gguf model file, not {info.path}")
        if not (on_cpu and (cpu_kernels.load() is not None or can_run_int4())):
            raise ValueError(f"quantization 'gguf' runs on the CPU (the gateway's kernels or "
                             f"torch's int4 kernels); the device is {device}")
    if name is None:
        name = ("gguf" if info.format == "gguf" and on_cpu
                and cpu_kernels.load() is not None else "none")
    return name


def load_model(info: ModelInfo, device: torch.device, dtype: torch.dtype,
               tp: TensorParallel | None = None, quantization: str | None = None) -> nn.Module:
    """Build the registered model class for `info` on `device` and load its weights (with
    `tp` of several ranks: this rank's part of them; `quantization` as --quantization)."""
    check_supported(info)  # what the front end checked: here too for in-process workers
    model_cls, arch = ModelRegistry.resolve_model_cls(info.architectures)
    start = time.perf_counter()
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = _build(model_cls, arch, info, tp)
    finally:
        torch.set_default_dtype(previous_dtype)
    model = model.to_empty(device=device)
    if callable(getattr(model, "tie_weights", None)):
        model.tie_weights()
    quantization = resolve_quantization(quantization, info, device)
    quantized = None
    if quantization == "gguf" and not callable(getattr(model, "load_weights", None)):
        quantized = QuantizedParams(model, dtype)
    loaded = load_weights(model, _iter_weights(info, quantized is not None), quantized)
    missing = [name for name in expected_weight_names(model) if name not in loaded]
    if missing:
        raise ValueError(f"{info.path} lacks tensor {missing[0]!r} needed by {arch}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    num_quantized = 0 if quantized is None else quantized.install()
    if info.format == "gguf":
        _log_dequantized_experts(model, device, quantization, tp)
    if can_pack(device, dtype):
        pack_linear_layers(model, dtype, lone_decode=LoneDecode.may_run(model, device, dtype))
    logger.info("Loaded %s (%s) from %s in %.1f s, %s on %s; weights %.1f MiB%s", arch,
                model_cls.__name__, info.path, time.perf_counter() - start, dtype, device,
                weight_bytes(model) / 2**20,
                f", {num_quantized} kept quantized (gguf, {_kernel_name()})"
                if num_quantized else "")
    return model.eval()


def _log_dequantized_experts(model: nn.Module, device: torch.device, quantization: str,
                             tp: TensorParallel | None) -> None:
    """One line where a GGUF's experts were dequantized, and why."""
    num_layers = sum(isinstance(module, FusedExperts) for module in model.modules())
    if not num_layers:
        return
    why = (f"on {device.type}" if device.type != "cpu" else
           "--quantization none" if quantization != "gguf" else
           "tensor parallelism" if tp is not None and tp.size > 1 else
           "their types or the kernels, as logged above")
    logger.info("The experts of %d layers are dequantized (%s): a GGUF's experts stay "
                "quantized only on the CPU, with one rank", num_layers, why)


def _kernel_name() -> str:
    if cpu_kernels.load() is not None:
        return "the gateway's float32 kernels"
    return "torch's int4 kernel, bfloat16"


def _build(model_cls: type, arch: str, info: ModelInfo, tp: TensorParallel | None) -> Any:
    if tp is None or tp.size == 1:
        return model_cls(info.hf_config)
    if not getattr(model_cls, "supports_tensor_parallel", False):
        raise ValueError(f"{arch} ({model_cls.__module__}.{model_cls.__qualname__}) does not "
                         f"support tensor parallelism; serve it with --tensor-parallel-size 1")
    return model_cls(info.hf_config, tp=tp)


def _packed_mapping(model: nn.Module) -> dict[str, tuple[str, int]]:
    return dict(getattr(model, "packed_modules_mapping", {}))


def _expert_mapping(model: nn.Module) -> dict[str, tuple[str, int | None, int | None]]:
    """A mixture of experts' checkpoint name -> (parameter, expert, shard): each expert's
    tensors are rows of the parameters holding every expert (`expert_weights_mapping`)."""
    return dict(getattr(model, "expert_weights_mapping", {}))


Weight = torch.Tensor | QuantWeight | BlockWeight | StackedExperts


def load_weights(model: nn.Module, weights: Iterable[tuple[str, Weight]],
                 quantized: QuantizedParams | None = None) -> set[str]:
    """Copy checkpoint tensors into the model's parameters (QuantWeights to `quantized`,
    which installs them afterwards); returns the names loaded.

    A model class may define its own `load_weights(weights) -> set[str]` instead (which
    may rename the tensors and hand them on to `copy_weights`); it gets dense tensors.
    """
    custom = getattr(model, "load_weights", None)
    if callable(custom):
        return set(custom(weights))
    return copy_weights(model, weights, quantized)


def copy_weights(model: nn.Module, weights: Iterable[tuple[str, Weight]],
                 quantized: QuantizedParams | None = None) -> set[str]:
    """The plain copy by parameter name (and `packed_modules_mapping` for fused ones); a
    QuantWeight goes to `quantized` (None: it is dequantized and copied)."""
    params = dict(model.named_parameters())
    packed = _packed_mapping(model)
    experts = _expert_mapping(model)
    stands_for = _stacked_experts(experts)
    loaded: set[str] = set()
    for name, tensor in weights:
        target: str | None
        expert: int | None = None
        if name in experts:  # an expert's own tensor goes to its row of the fused ones
            target, expert, shard = experts[name]
        else:
            target, shard = _param_for(name, params, packed)
        if target is None:
            logger.debug("Checkpoint tensor %s is not used by the model", name)
            continue
        param = params[target] if expert is None else params[target][expert]
        # A module holding part of the tensor (tensor parallelism) says which part.
        module_name, _, param_name = target.rpartition(".")
        part: Any = getattr(model.get_submodule(module_name), "checkpoint_part", None)
        if isinstance(tensor, StackedExperts):
            if quantized and _keeps_experts(model.get_submodule(module_name), name):
                quantized.add_experts(target, shard, tensor)
                loaded.add(name)
                loaded.update(stands_for.get(name, ()))
                continue
            tensor = tensor.dequantize()
        if isinstance(tensor, (QuantWeight, BlockWeight)):
            kept = _quantized_part(tensor, part, param_name, shard, name) \
                if quantized and expert is None else None  # experts: dequantized
            if kept is not None:
                assert quantized is not None
                quantized.add(target, shard, kept)
                loaded.add(name)
                continue
            tensor = tensor.dequantize()
        if part is not None:
            tensor = part(param_name, shard, tensor)
        if shard is None:
            _copy(param, tensor, name)
        else:
            # The fused module names its shards' row counts (e.g. q, k, v); rows are the
            # second dim of a stack of experts.
            fused = model.get_submodule(target.rpartition(".")[0])
            sizes = cast(tuple[int, ...], fused.shard_sizes)
            offset = sum(sizes[:shard])
            _copy(param.narrow(max(param.dim() - 2, 0), offset, sizes[shard]), tensor, name)
        loaded.add(name)
        loaded.update(stands_for.get(name, ()))
    return loaded


def _stacked_experts(experts: dict[str, tuple[str, int | None, int | None]],
                     ) -> dict[str, list[str]]:
    """A stacked experts tensor's name (a GGUF's) -> the names of each expert's own."""
    own: dict[tuple[str, int | None], list[str]] = {}
    for name, (param, expert, shard) in experts.items():
        if expert is not None:
            own.setdefault((param, shard), []).append(name)
    return {name: own.get((param, shard), []) for name, (param, expert, shard)
            in experts.items() if expert is None and param.endswith("_proj")}


def _keeps_experts(module: nn.Module, name: str) -> bool:
    """Whether the stacked experts `name` stay quantized in `module` (FusedExperts): where
    it holds them whole (one rank)."""
    if getattr(module, "num_ranks", 1) == 1:
        return True
    logger.info("%s stays dequantized: tensor parallelism splits each expert's intermediate "
                "size, which the quantized experts' kernel does not", name)
    return False


def _quantized_part(tensor: KeptWeight, part: Any, param_name: str, shard: int | None,
                    name: str) -> KeptWeight | None:
    """The module's part of a quantized tensor (None: it cannot be cut quantized)."""
    if part is None:
        return tensor
    try:
        return cast(KeptWeight, part(param_name, shard, tensor))
    except (ValueError, AttributeError) as exc:  # off the groups; a cut that pads with zeros
        logger.info("%s stays dequantized: this rank's part of it %s", name,
                    exc if isinstance(exc, ValueError) else "needs padding")
        return None


def _param_for(name: str, params: dict[str, nn.Parameter],
               packed: dict[str, tuple[str, int]]) -> tuple[str | None, int | None]:
    if name in params:
        return name, None
    for part, (fused, shard) in packed.items():
        if f".{part}." in name:
            fused_name = name.replace(f".{part}.", f".{fused}.")
            if fused_name in params:
                return fused_name, shard
    return None, None


def expected_weight_names(model: nn.Module) -> list[str]:
    """Checkpoint names that must be present: fused parameters expand to their shards."""
    by_fused: dict[str, list[tuple[int, str]]] = {}
    for part, (fused, shard) in _packed_mapping(model).items():
        by_fused.setdefault(fused, []).append((shard, part))
    by_expert_param: dict[str, list[str]] = {}
    experts = _expert_mapping(model)
    stacked = _stacked_experts(experts)
    for checkpoint_name, (param, _, _) in experts.items():
        if checkpoint_name not in stacked:  # each expert's own names stand for them
            by_expert_param.setdefault(param, []).append(checkpoint_name)
    names = []
    for name, _ in model.named_parameters():
        if name in by_expert_param:
            names += by_expert_param[name]
            continue
        module = next((f for f in by_fused if f".{f}." in name), None)
        if module is None:
            names.append(name)
        else:
            names += [name.replace(f".{module}.", f".{part}.")
                      for _, part in sorted(by_fused[module])]
    return names


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"Checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                         f"but the model expects {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)


# ------------------------------------------------------------------ weight sources
def _iter_weights(info: ModelInfo, keep_quantized: bool) -> Iterator[tuple[str, Weight]]:
    if info.format == "gguf":
        return _gguf_weights(info.path, keep_quantized)
    return _safetensors_weights(info.path)


def _gguf_weights(path: Path, keep_quantized: bool) -> Iterator[tuple[str, Weight]]:
    gguf = GGUFFile(path)
    progress = _Progress(path, sum(info.num_bytes for info in gguf.tensors.values()))
    unkept: set[str] = set()
    for name, info, array in iter_gguf_weights(gguf, keep_quantized):
        if isinstance(array, (QuantWeight, BlockWeight, StackedExperts)):
            yield name, array
        else:  # float32 tensors are views of the read-only memory map: copy those
            if keep_quantized and info.qtype.name not in _DENSE_TYPES:
                unkept.add(info.qtype.name)
            yield name, torch.from_numpy(array if array.flags.writeable else array.copy())
        progress.advance(info.num_bytes)
    if unkept:
        logger.info("%s: weights of type %s are dequantized (no int4 kernel fits them)",
                    path, ", ".join(sorted(unkept)))


def _safetensors_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"Model folder {folder} has no *.safetensors files")
    progress = _Progress(folder, sum(f.stat().st_size for f in files))
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                    tensor = handle.get_tensor(name)
                    yield name, tensor
                    progress.advance(tensor.numel() * tensor.element_size())
        except SafetensorError as exc:
            raise ValueError(f"Cannot read weights from {file}: {exc}") from exc


class _Progress:
    """Log a line each time another quarter of the weights is in (long loads)."""

    def __init__(self, source: Any, total_bytes: int) -> None:
        self.source, self.total = source, max(total_bytes, 1)
        self.done, self.next_report = 0, _PROGRESS_STEP

    def advance(self, num_bytes: int) -> None:
        self.done += num_bytes
        if self.total >= _PROGRESS_MIN_BYTES and self.done / self.total >= self.next_report:
            logger.info("Loading weights from %s: %d%%", self.source, 100 * self.done // self.total)
            while self.next_report <= self.done / self.total:
                self.next_report += _PROGRESS_STEP
