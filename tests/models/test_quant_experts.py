"""A GGUF mixture of experts (Qwen3-MoE, and Mixtral as llama.cpp writes it) with its
stacked experts kept quantized on the CPU (layers/quant_experts.py): the layer equals
FusedExperts on the stacks dequantized, for float32 and bfloat16 tokens; every sampled
row of a mixed batch (prefills, chunks and decodes, a preempted request, a lone decode)
equals transformers' logits on the same file's experts dequantized, within 1e-4 for every
type (the kernels compute in float32 from the very values the dequantizer writes: only
the order of the sums differs), the experts holding about their file's bytes; with
--quantization none or tensor parallelism they are dequantized (each rank its slice) and
the start-up log says why; and a file whose expert stack disagrees with its metadata stops
`gateway serve` in one line."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from gateway.models.info.decoder_config import MoEConfig
from gateway.models.info.gguf_file import GGUFFile
from gateway.models.info.gguf_layout import MIXTRAL, hf_name
from gateway.models.info.paths import read_model_info
from gateway.models.kernels.cpu.library import load
from gateway.models.layers.moe import FusedExperts
from gateway.models.layers.parallel import SINGLE_RANK
from gateway.models.layers.quant_experts import QuantExperts
from gateway.models.loading.loader import load_model
from tests.models.kernels.cpu.test_moe_quant import stacked_experts
from tests.models.test_decoder_archs import _reference, _short_mixed_run
from tests.models.tiny_gguf import write_tiny_gguf
from tests.server import serve_cannot_start
from tests.tiny_model import build_tiny_decoder

pytestmark = pytest.mark.isa  # the CPU's instruction set decides the paths

Q = gguf.GGMLQuantizationType
F32 = Q.F32
# general.architecture -> (HF architecture, tiny config changes): hidden and expert sizes
# of 256, a K-quant block.
FAMILIES = {"qwen3moe": ("Qwen3MoeForCausalLM", {"hidden_size": 256, "mlp_only_layers": [],
                                                 "moe_intermediate_size": 256,
                                                 "use_sliding_window": False}),
            "llama": ("MixtralForCausalLM", {"hidden_size": 256, "intermediate_size": 256})}
# case -> (general.architecture, the types of ffn_gate_exps, ffn_up_exps, ffn_down_exps)
CASES = {"qwen3moe-Q4_K_M": ("qwen3moe", (Q.Q4_K, Q.Q4_K, Q.Q6_K)),
         "qwen3moe-Q8_0": ("qwen3moe", (Q.Q8_0, Q.Q8_0, Q.Q8_0)),
         "mixtral-Q4_0-Q4_1": ("llama", (Q.Q4_0, Q.Q4_0, Q.Q4_1)),
         "mixtral-Q5": ("llama", (Q.Q5_K, Q.Q5_1, Q.Q5_0))}
STACKS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-hf")
    return {arch: build_tiny_decoder(root / arch, hf_arch, **changes)
            for arch, (hf_arch, changes) in FAMILIES.items()}


def _write(folder: Path, path: Path, arch: str, types: tuple[Q, Q, Q]) -> Path:
    """The folder as a GGUF, its expert stacks of `types` and every other tensor F32."""
    by_stack = dict(zip(STACKS, types, strict=True))
    return write_tiny_gguf(folder, path, arch=arch,
                           pre="qwen2" if arch == "qwen3moe" else "default",
                           qtype_of=lambda name: by_stack.get(name.split(".")[-2], F32))


def _dequantized_folder(folder: Path, path: Path, out: Path, arch: str) -> Path:
    """A copy of `folder` whose experts are the GGUF's stacks dequantized (gguf-py)."""
    shutil.copytree(folder, out)
    weights = load_file(out / "model.safetensors")
    gguf_file = GGUFFile(path)
    for info in gguf_file.tensors.values():
        if info.name.split(".")[-2] in STACKS:
            stacked = hf_name(info.name, MIXTRAL if arch == "llama" else arch)
            assert stacked is not None
            for expert, values in enumerate(gguf_file.dequantize(info)):
                name = stacked.replace(".experts.", f".experts.{expert}.")
                assert weights[name].shape == values.shape, name
                weights[name] = torch.from_numpy(values.copy())
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_experts_equal_fused_experts_of_the_stacks_dequantized(
        dtype: torch.dtype) -> None:
    """Tokens routed unevenly (some experts chosen by none), gate, up and down of three
    types; bfloat16 tokens are computed in float32 and rounded once at the end."""
    library = load()
    assert library is not None, "the float32 kernels did not build here (see the log)"
    gate, up, down = (stacked_experts(qtype, 6, 256, 256, seed=seed) for seed, qtype in
                      enumerate((Q.Q4_K, Q.Q4_0, Q.Q6_K)))
    fused = FusedExperts(MoEConfig(num_experts=6, top_k=2, intermediate_size=256,
                                   renormalize=True), 256, "silu", SINGLE_RANK)
    with torch.no_grad():
        fused.gate_up_proj.copy_(torch.cat((gate.dequantize(), up.dequantize()), dim=1))
        fused.down_proj.copy_(down.dequantize())
    kept = QuantExperts(gate, up, down, fused.act_mul, library)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(9, 256, generator=generator)
    experts = torch.tensor([[0, 2], [2, 0], [2, 5], [5, 2], [2, 0], [0, 5], [2, 5], [5, 0],
                            [2, 0]])
    weights = torch.rand(9, 2, generator=generator)
    expected = fused(x.to(dtype).float(), weights, experts)
    out = kept(x.to(dtype), weights, experts)
    assert out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # relative to the largest value
    assert (out.float() - expected).abs().max() < tolerance * expected.abs().max()


@pytest.mark.parametrize("case", sorted(CASES))
def test_kept_experts_equal_the_files_experts_dequantized_in_mixed_batches(
        folders: dict[str, Path], tmp_path: Path, case: str) -> None:
    arch, types = CASES[case]
    path = _write(folders[arch], tmp_path / f"{case}.gguf", arch, types)
    model = load_model(read_model_info(path), torch.device("cpu"), torch.float32)
    kept = [m for m in model.modules() if isinstance(m, QuantExperts)]
    assert len(kept) == 2  # both layers
    file_bytes = sum(info.num_bytes for info in GGUFFile(path).tensors.values()
                     if info.name.split(".")[-2] in STACKS)
    held = sum(experts.num_bytes() for experts in kept) / file_bytes
    # Q4_0 repacked: 20 bytes a block for the file's 18 (gate and up here; down Q4_1: 20)
    assert held == pytest.approx((2 * 20 + 20) / (2 * 18 + 20) if types[0] == Q.Q4_0 else 1.0)
    reference = _reference(_dequantized_folder(folders[arch], path, tmp_path / "dequantized",
                                               arch))
    assert _short_mixed_run(path, reference) > 40


def test_a_layer_with_a_stack_of_a_type_not_kept_is_dequantized_whole(
        folders: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """ffn_up_exps F16 beside Q8_0 gate and down: the layer's experts are all dequantized,
    as --quantization none dequantizes them."""
    path = _write(folders["llama"], tmp_path / "mixed.gguf", "llama", (Q.Q8_0, Q.F16, Q.Q8_0))
    assert GGUFFile(path).tensors["blk.0.ffn_up_exps.weight"].qtype == Q.F16
    info = read_model_info(path)
    with caplog.at_level(logging.INFO, logger="gateway"):
        kept = load_model(info, torch.device("cpu"), torch.float32)
    dense = load_model(info, torch.device("cpu"), torch.float32, quantization="none")
    assert not any(isinstance(module, QuantExperts) for module in kept.modules())
    assert "stay dequantized: some of their stacks are stored in a type kept dequantized" \
        in caplog.text
    for name, param in dense.named_parameters():
        if ".experts." in name:
            assert torch.equal(kept.get_parameter(name), param), name


@dataclass
class Ranks:
    """Rank `rank` of `size`, as loading sees it (no collectives run)."""

    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


@pytest.mark.parametrize(("quantization", "ranks", "why"), [
    ("none", Ranks(0, 1), "--quantization none"), ("gguf", Ranks(1, 2), "tensor parallelism")])
def test_experts_are_dequantized_with_none_or_tensor_parallelism_and_the_log_says_so(
        folders: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture,
        quantization: str, ranks: Ranks, why: str) -> None:
    """Each rank holds its slice of every expert, dequantized, as from an F32 file."""
    path = _write(folders["qwen3moe"], tmp_path / "q8.gguf", "qwen3moe", (Q.Q8_0,) * 3)
    with caplog.at_level(logging.INFO, logger="gateway"):
        model = load_model(read_model_info(path), torch.device("cpu"), torch.float32,
                           tp=ranks, quantization=quantization)
    assert not any(isinstance(module, QuantExperts) for module in model.modules())
    experts = model.get_submodule("model.layers.0.mlp.experts")
    assert isinstance(experts, FusedExperts)
    gguf_file = GGUFFile(path)
    gate = torch.from_numpy(gguf_file.dequantize(gguf_file.tensors["blk.0.ffn_gate_exps.weight"]))
    size = 256 // ranks.size
    assert torch.equal(experts.gate_up_proj[:, :size],
                       gate[:, ranks.rank * size:(ranks.rank + 1) * size])
    assert f"The experts of 2 layers are dequantized ({why})" in caplog.text


@pytest.mark.e2e
def test_a_gguf_whose_expert_stack_disagrees_with_its_metadata_stops_serve_in_one_line(
        folders: dict[str, Path], tmp_path: Path) -> None:
    """A Q4_K ffn_up_exps of 7 experts where the metadata says 8: one `Cannot start:` line
    names the tensor and the file, before any weight is read."""
    path = write_tiny_gguf(
        folders["qwen3moe"], tmp_path / "short.gguf", arch="qwen3moe", pre="qwen2",
        qtype_of=lambda name: Q.Q4_K if "_exps" in name else F32,
        tensors=lambda arrays: {**arrays, "blk.1.ffn_up_exps.weight":
                                arrays["blk.1.ffn_up_exps.weight"][:7]})
    line = serve_cannot_start(path)
    assert f"Model {path.resolve()} cannot be served: tensor 'blk.1.ffn_up_exps.weight' " \
        "has shape [7, 256, 256], but the qwen3moe.* metadata implies [8, 256, 256]" \
        in line, line
