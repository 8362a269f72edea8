"""Mixtures of experts (Qwen3-MoE, Mixtral) on the one decoder, beyond the mixed-batch run
that test_decoder_archs gives every family: the router routes as transformers' routers
do, the grouped experts equal one product per expert, each tensor-parallel rank's part of
the experts sums to the whole (and two real ranks generate what one does), a Qwen3-MoE
folder served end to end answers as transformers generates, and a folder missing one
expert tensor stops `gateway serve` in one line naming it, before any weight is loaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from gateway.models.info.decoder_config import MoEConfig
from gateway.models.layers.moe import (
    FusedExperts,
    gathered_linear,
    grouped_linear,
    padded_linear,
    route,
)
from tests.server import serve_cannot_start
from tests.tiny_model import build_tiny_decoder

pytestmark = pytest.mark.isa


@dataclass
class Ranks:
    """A rank of `size`, as the shard arithmetic sees it (no collectives run)."""

    rank: int
    size: int


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_decoder(tmp_path_factory.mktemp("moe") / "qwen3moe",
                              "Qwen3MoeForCausalLM")


@pytest.mark.parametrize(("architecture", "renormalize"), [
    ("Qwen3MoeForCausalLM", False), ("Qwen3MoeForCausalLM", True),
    ("MixtralForCausalLM", True)])
def test_routing_is_transformers_routing(architecture: str, renormalize: bool) -> None:
    """Softmax over all experts, top k, renormalised or not: the same weights and experts
    as the family's transformers router (Mixtral always renormalises)."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    if architecture == "MixtralForCausalLM":
        reference = MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=8,
                                                    num_experts_per_tok=3))
    else:
        reference = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=16, num_experts=8,
                                                      num_experts_per_tok=3,
                                                      norm_topk_prob=renormalize))
    torch.manual_seed(0)
    with torch.no_grad():
        reference.weight.normal_()
        hidden = torch.randn(20, 16)
        _, expected_weights, expected_experts = reference(hidden)
        weights, experts = route(F.linear(hidden, reference.weight), 3, renormalize)
    assert torch.equal(experts, expected_experts)
    torch.testing.assert_close(weights, expected_weights.float(), rtol=0, atol=1e-6)
    assert torch.allclose(weights.sum(-1), torch.ones(20)) == renormalize


def _experts(config: MoEConfig, ranks: Ranks, gate: torch.Tensor, up: torch.Tensor,
             down: torch.Tensor) -> FusedExperts:
    """FusedExperts of rank `ranks`, filled as the loader fills them: expert by expert."""
    experts = FusedExperts(config, gate.shape[2], "silu", ranks)
    size = experts.part.size
    with torch.no_grad():
        for e in range(config.num_experts):
            experts.gate_up_proj[e, :size] = experts.checkpoint_part("gate_up_proj", 0, gate[e])
            experts.gate_up_proj[e, size:] = experts.checkpoint_part("gate_up_proj", 1, up[e])
            experts.down_proj[e] = experts.checkpoint_part("down_proj", None, down[e])
    return experts


def test_grouped_experts_equal_one_product_per_expert_and_ranks_sum_to_the_whole() -> None:
    """Tokens routed unevenly (some experts chosen by none, one by most): the grouped
    products equal the plain per-expert loop; over 3 ranks (intermediate 16 split 6, 5, 5:
    sizes off grouped_mm's strides, which take the batched product) the ranks' partial
    outputs sum to it."""
    config = MoEConfig(num_experts=6, top_k=2, intermediate_size=16, renormalize=True)
    generator = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(6, 16, 12, generator=generator) for _ in range(2))
    down = torch.randn(6, 12, 16, generator=generator)
    x = torch.randn(9, 12, generator=generator)
    experts = torch.tensor([[0, 2], [2, 0], [2, 5], [5, 2], [2, 0], [0, 5], [2, 5], [5, 0],
                            [2, 0]])
    weights = torch.rand(9, 2, generator=generator)
    expected = torch.zeros(9, 12)
    for token in range(9):
        for slot in range(2):
            e = int(experts[token, slot])
            act = F.silu(gate[e] @ x[token]) * (up[e] @ x[token])
            expected[token] += weights[token, slot] * (down[e] @ act)
    whole = _experts(config, Ranks(0, 1), gate, up, down)(x, weights, experts)
    torch.testing.assert_close(whole, expected, rtol=1e-5, atol=1e-5)
    parts = [_experts(config, Ranks(r, 3), gate, up, down) for r in range(3)]
    assert [part.part.size for part in parts] == [6, 5, 5]
    torch.testing.assert_close(sum(part(x, weights, experts) for part in parts), expected,
                               rtol=1e-5, atol=1e-5)
    for part in parts:  # a GGUF's stacked experts are cut as each expert's own tensors
        assert torch.equal(part.checkpoint_part("gate_up_proj", 0, gate),
                           torch.stack([part.checkpoint_part("gate_up_proj", 0, g) for g in gate]))
        assert torch.equal(part.checkpoint_part("down_proj", None, down),
                           torch.stack([part.checkpoint_part("down_proj", None, d) for d in down]))


@pytest.mark.parametrize("num_rows", [5, 40])
def test_the_batched_paths_equal_the_grouped_product(num_rows: int) -> None:
    """Where grouped_mm does not run: each row's expert's weight gathered, or every expert's
    rows padded to the largest group (experts 1 and 6 chosen by none)."""
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(8, 24, 32, generator=generator)
    row_experts = torch.tensor([0, 2, 3, 4, 5, 7] * 8)[:num_rows].sort().values
    rows = torch.randn(num_rows, 32, generator=generator)
    offsets = torch.bincount(row_experts, minlength=8).cumsum(0).to(torch.int32)
    expected = grouped_linear(rows, weight, offsets, row_experts)
    torch.testing.assert_close(expected, torch.cat([weight[e] @ rows[i:i + 1].T for i, e in
                                                     enumerate(row_experts.tolist())], 1).T)
    for path in (gathered_linear(rows, weight, row_experts),
                 padded_linear(rows, weight, offsets, row_experts)):
        torch.testing.assert_close(path, expected, rtol=1e-5, atol=1e-5)


def test_qwen3_moe_on_two_ranks_generates_what_it_does_on_one(qwen3_moe: Path) -> None:
    """Each rank holds half of every expert's intermediate size (and of the dense layer's)."""
    from gateway.executor.mp import MultiprocExecutor
    from tests.executor.test_mp_executor import _config, _generate, _one_rank

    expected = _generate(*_one_rank(_config(qwen3_moe, ranks=1)))
    executor = MultiprocExecutor(_config(qwen3_moe, ranks=2))
    try:
        assert _generate(executor, executor.num_kv_blocks) == expected
    finally:
        executor.shutdown()
    assert all(len(tokens) >= 12 for tokens in expected.values())


@pytest.mark.e2e
def test_a_qwen3_moe_folder_served_end_to_end_answers_as_transformers_generates(
        qwen3_moe: Path, tmp_path: Path) -> None:
    import httpx
    from transformers import AutoModelForCausalLM

    from tests.frontend.conftest import SERVED_NAME, tiny_server

    with tiny_server(qwen3_moe, log_path=tmp_path / "server.log") as server:
        answer = httpx.post(server.url("/v1/completions"), timeout=60, json={
            "model": SERVED_NAME, "prompt": "Once upon a time there was a server",
            "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    prompt = body["choices"][0]["prompt_token_ids"]
    reference = AutoModelForCausalLM.from_pretrained(qwen3_moe, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12,
                                      min_new_tokens=12, do_sample=False)
    assert body["choices"][0]["token_ids"] == expected[0, len(prompt):].tolist()


@pytest.mark.e2e
def test_a_missing_expert_tensor_stops_serve_in_one_line(qwen3_moe: Path,
                                                         tmp_path: Path) -> None:
    """Expert 5's up_proj of layer 0 removed: one `Cannot start:` line names it and the
    folder, from the front end's reading of the headers (the engine never starts)."""
    folder = tmp_path / "partial"
    folder.mkdir()
    for item in qwen3_moe.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    weights = load_file(folder / "model.safetensors")
    missing = "model.layers.0.mlp.experts.5.up_proj.weight"
    del weights[missing]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    line = serve_cannot_start(folder)
    assert f"Model {folder.resolve()} cannot be served: tensor {missing!r} is missing" \
        in line, line


# general.architecture -> (HF architecture, tiny config changes): llama.cpp's qwen3moe has
# no dense layers and no window; a llama file with experts is Mixtral.
GGUF_FAMILIES = {"qwen3moe": ("Qwen3MoeForCausalLM", {"mlp_only_layers": [],
                                                      "use_sliding_window": False}),
                 "llama": ("MixtralForCausalLM", {})}


@pytest.mark.parametrize("arch", sorted(GGUF_FAMILIES))
def test_a_gguf_with_stacked_experts_equals_transformers_on_its_folder(
        tmp_path: Path, arch: str) -> None:
    """The experts stacked in ffn_{gate,up,down}_exps and the router in ffn_gate_inp, the
    expert counts from the metadata: the file serves the logits transformers computes
    from the HF folder it was written from (experts dequantized at load)."""
    from gateway.models.info.paths import read_model_info
    from tests.models.test_decoder_archs import _reference, _short_mixed_run
    from tests.models.tiny_gguf import write_tiny_gguf

    hf_arch, changes = GGUF_FAMILIES[arch]
    folder = build_tiny_decoder(tmp_path / "hf", hf_arch, **changes)
    path = write_tiny_gguf(folder, tmp_path / f"{arch}.gguf", arch=arch,
                           pre="qwen2" if arch == "qwen3moe" else "default")
    info = read_model_info(path)
    assert info.architecture == hf_arch
    assert _short_mixed_run(path, _reference(folder)) > 40


def test_a_gguf_missing_an_expert_stack_is_refused_by_name(tmp_path: Path) -> None:
    from gateway.models.info.paths import read_model_info
    from gateway.models.info.support import UnsupportedModelError, check_supported
    from tests.models.tiny_gguf import write_tiny_gguf

    folder = build_tiny_decoder(tmp_path / "hf", "MixtralForCausalLM")
    path = write_tiny_gguf(folder, tmp_path / "mixtral.gguf", tensors=lambda arrays: {
        name: array for name, array in arrays.items() if name != "blk.1.ffn_up_exps.weight"})
    with pytest.raises(UnsupportedModelError, match=r"tensor 'blk.1.ffn_up_exps.weight' is "
                                                    r"missing \(the llama.\* metadata"):
        check_supported(read_model_info(path))
