"""Install quantized GGUF weights in a loaded model (worker process): the loader hands each
QuantWeight or BlockWeight here instead of copying it, and `install` swaps the modules that
hold them for QuantLinear / QuantEmbedding (a tied lm_head shares the embedding's weight);
a mixture of experts' stacked experts (StackedExperts) swap its FusedExperts for
QuantExperts where the gateway's kernels run.

What cannot stay quantized (a fused module with a shard of an unkept type, a tensor-parallel
cut off the groups of 32, a shape the kernel does not take, a model class with its own
`load_weights`) is dequantized into the module's own parameter, with a log line naming it.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from gateway.logger import init_logger
from gateway.models.kernels.cpu import library as cpu_kernels
from gateway.models.kernels.cpu.quant_weight import BlockQuantWeight, Float32QuantWeight
from gateway.models.layers.gguf_quant import BlockWeight, KeptWeight, QuantWeight, StackedExperts
from gateway.models.layers.moe import FusedExperts
from gateway.models.layers.parallel import SINGLE_RANK, VocabParallelEmbedding
from gateway.models.layers.quant_experts import QuantExperts
from gateway.models.layers.quant_linear import Int4Weight, QuantEmbedding, QuantLinear, QuantMatrix

logger = init_logger(__name__)


class QuantizedParams:
    """The quantized checkpoint tensors of a model's parameters, collected while loading."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype
        self.shards: dict[str, dict[int | None, KeptWeight]] = {}
        #: experts module -> (parameter, shard) -> its stacked experts
        self.experts: dict[str, dict[tuple[str, int | None], StackedExperts]] = {}

    def add(self, param_name: str, shard: int | None, weight: KeptWeight) -> None:
        self.shards.setdefault(param_name, {})[shard] = weight

    def add_experts(self, param_name: str, shard: int | None, stack: StackedExperts) -> None:
        module_name, _, param = param_name.rpartition(".")
        self.experts.setdefault(module_name, {})[(param, shard)] = stack

    def install(self) -> int:
        """Swap in the quantized modules; returns how many. Call after every copy."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        installed = 0
        for name, shards in self.shards.items():
            module_name = name.rpartition(".")[0]
            module = self.model.get_submodule(module_name)
            try:
                weight = _whole(module, shards)
                self._swap(module_name, module, _kernel_weight(weight), params[name])
                installed += 1
            except ValueError as exc:
                logger.info("%s stays dequantized: %s", name, exc)
                self._copy_dequantized(module, params[name], shards)
        return installed + sum(self._install_experts(name, stacks)
                               for name, stacks in self.experts.items())

    def _install_experts(self, module_name: str,
                         stacks: dict[tuple[str, int | None], StackedExperts]) -> int:
        """Swap a FusedExperts for QuantExperts over its gate, up and down stacks (1), or
        copy them dequantized into its parameters where that cannot be (0)."""
        module = self.model.get_submodule(module_name)
        assert isinstance(module, FusedExperts)  # the parameters expert_weights_mapping names
        gate, up, down = (stacks.get(key) for key in _EXPERT_STACKS)
        library = cpu_kernels.load()
        why = "the gateway's kernels do not run here"
        if gate is None or up is None or down is None:
            why = "some of their stacks are stored in a type kept dequantized"
        elif library is not None:
            try:
                _replace(self.model, module_name,
                         QuantExperts(gate, up, down, module.act_mul, library))
                return 1
            except ValueError as exc:
                why = str(exc)
        logger.info("%s stay dequantized: %s", module_name, why)
        sizes = module.shard_sizes
        with torch.no_grad():
            for (param_name, shard), stack in stacks.items():
                target = getattr(module, param_name)
                if shard is not None:
                    target = target.narrow(1, sum(sizes[:shard]), sizes[shard])
                target.copy_(stack.dequantize())
        return 0

    def _swap(self, module_name: str, module: nn.Module, quant: QuantMatrix,
              param: torch.Tensor) -> None:
        if isinstance(module, nn.Embedding):
            shard = module.shard if isinstance(module, VocabParallelEmbedding) else None
            tp = getattr(module, "tp", SINGLE_RANK)
            _replace(self.model, module_name, QuantEmbedding(quant, self.dtype, shard, tp))
            # a tied output layer (lm_head.weight is the embedding's parameter) follows
            for tied_name, tied in list(self.model.named_modules()):
                if isinstance(tied, nn.Linear) and tied.weight is param:
                    _replace(self.model, tied_name, QuantLinear(quant, tied.bias))
        elif isinstance(module, nn.Linear):
            _replace(self.model, module_name, QuantLinear(quant, module.bias))
        else:
            raise ValueError(f"{type(module).__name__} has no quantized counterpart")

    def _copy_dequantized(self, module: nn.Module, param: torch.Tensor,
                          shards: dict[int | None, KeptWeight]) -> None:
        sizes = cast(tuple[int, ...], getattr(module, "shard_sizes", ()))
        with torch.no_grad():
            for shard, weight in shards.items():
                target = param if shard is None else param.narrow(
                    0, sum(sizes[:shard]), sizes[shard])
                target.copy_(weight.dequantize())


# FusedExperts' (parameter, shard) of gate, up and down
_EXPERT_STACKS = (("gate_up_proj", 0), ("gate_up_proj", 1), ("down_proj", None))


def _kernel_weight(weight: KeptWeight) -> QuantMatrix:
    """The weight for the gateway's float32 kernels where they run here, else for torch's
    int4 kernel (ValueError: for neither)."""
    library = cpu_kernels.load()
    if isinstance(weight, BlockWeight):
        if library is None:
            raise ValueError("its block types run only in the gateway's float32 kernels, "
                             "which do not run here")
        return BlockQuantWeight(weight, library)
    if library is not None:
        try:
            return Float32QuantWeight(weight, library)
        except ValueError as exc:
            logger.info("A weight runs with torch's int4 kernel: %s", exc)
    return Int4Weight(weight)


def _whole(module: nn.Module, shards: dict[int | None, KeptWeight]) -> KeptWeight:
    """The module's weight from its checkpoint shards (all of a fused module's)."""
    if None in shards:
        return shards[None]
    sizes = cast(tuple[int, ...], getattr(module, "shard_sizes", ()))
    if set(shards) != set(range(len(sizes))):
        raise ValueError("some of its fused shards are stored in a type kept dequantized")
    parts = [shards[shard] for shard in range(len(sizes))]
    if all(isinstance(part, QuantWeight) for part in parts):
        return QuantWeight.cat_rows(cast(list[QuantWeight], parts))
    if all(isinstance(part, BlockWeight) for part in parts):
        return BlockWeight.cat_rows(cast(list[BlockWeight], parts))
    raise ValueError("its fused shards mix Q4_0/Q4_1/Q8_0 with block types "
                     f"({', '.join(_type_name(part) for part in parts)})")


def _type_name(weight: KeptWeight) -> str:
    if isinstance(weight, BlockWeight):
        return "+".join(part.qtype.name for part in weight.parts)
    return f"{weight.bits}-bit"


def _replace(model: nn.Module, module_name: str, new: nn.Module) -> None:
    parent_name, _, child_name = module_name.rpartition(".")
    setattr(model.get_submodule(parent_name), child_name, new)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as held: parameters, buffers, quantized weights and the
    packed (and transposed) copies of cpu_linear's layers (a shared one counted once)."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    for module in model.modules():
        for name in ("packed_weight", "row_weight_t"):  # cpu_linear.PackedLinear's
            held = getattr(module, name, None)
            if isinstance(held, torch.Tensor) and id(held) not in seen:
                seen.add(id(held))
                total += held.numel() * held.element_size()
        if isinstance(module, QuantExperts):
            total += module.num_bytes()
        quant = getattr(module, "weight_q", None)
        if isinstance(quant, (Float32QuantWeight, BlockQuantWeight, Int4Weight)) \
                and id(quant) not in seen:
            seen.add(id(quant))
            total += quant.num_bytes()
    return total
