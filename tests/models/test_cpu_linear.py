"""The oneDNN-packed linear layer: the same output as nn.Linear at every row count, run at
a small set of padded row counts (so oneDNN's per-shape caches stay small)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gateway.models.info.paths import read_model_info
from gateway.models.layers.cpu_linear import PackedLinear, can_pack, pack_linear_layers, padded_rows
from gateway.models.loading.loader import load_model
from gateway.platforms.cpu_isa import cpu_isa
from tests.tiny_model import build_tiny_llama

pytestmark = pytest.mark.isa  # the CPU's instruction set decides the paths


def test_small_row_counts_run_unpadded():
    assert [padded_rows(n) for n in range(1, 17)] == list(range(1, 17))


def test_padding_adds_at_most_an_eighth_and_gives_few_sizes():
    sizes = set()
    for num_rows in range(1, 4097):
        rows = padded_rows(num_rows)
        assert num_rows <= rows <= num_rows * 1.125, num_rows
        sizes.add(rows)
    assert padded_rows(2048) == 2048 and padded_rows(2049) == 2304
    assert len(sizes) <= 16 + 8 * 8  # exact up to 16, then 8 sizes per power of two


@pytest.mark.parametrize("num_rows", [1, 5, 16, 17, 33, 100, 257, 1000])
def test_packed_linear_equals_nn_linear_at_any_row_count(num_rows):
    assert can_pack(torch.device("cpu"), torch.float32)
    torch.manual_seed(num_rows)
    linear = nn.Linear(48, 40)
    packed = PackedLinear(linear)
    x = torch.randn(num_rows, 48)
    with torch.inference_mode():
        expected, actual = linear(x), packed(x)
    assert actual.shape == (num_rows, 40)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("out_features", "block", "blocked"), [
    (40, False, False), (40, True, False), (64, True, True)])  # blocks need 32 | out
@pytest.mark.parametrize("num_rows", [1, 2, 17])
def test_kept_row_weight_serves_single_rows_with_the_same_output(num_rows, out_features,
                                                                  block, blocked):
    torch.manual_seed(num_rows)
    linear = nn.Linear(48, out_features)
    packed = PackedLinear(linear, keep_row_weight=True, block_row_weight=block)
    assert packed.row_weight_t is not None and packed.row_weight_blocked == blocked
    expected_shape = (out_features // 32, 48, 32) if blocked else (48, out_features)
    assert packed.row_weight_t.shape == expected_shape
    x = torch.randn(num_rows, 48)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("setting", "kept"), [(None, True), ("1", True), ("0", False)])
def test_single_row_weights_are_kept_unless_told_not_to(monkeypatch, tmp_path, setting, kept,
                                                        dtype):
    """float32 and bfloat16 alike where oneDNN packs the dtype (bfloat16's copy is read by
    the lone decode's one call). Where it does not (bfloat16 below AVX-512), the loader
    keeps the plain layers."""
    if setting is None:
        monkeypatch.delenv("GATEWAY_CPU_SINGLE_ROW_WEIGHTS", raising=False)
    else:
        monkeypatch.setenv("GATEWAY_CPU_SINGLE_ROW_WEIGHTS", setting)
    cpu = torch.device("cpu")
    if not can_pack(cpu, dtype):
        assert dtype == torch.bfloat16 and not cpu_isa().has_onednn_bf16
        model = load_model(read_model_info(str(build_tiny_llama(tmp_path / "tiny"))), cpu,
                           dtype)
        assert not any(isinstance(module, PackedLinear) for module in model.modules())
        assert any(isinstance(module, nn.Linear) for module in model.modules())
        return
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)).to(dtype)
    assert pack_linear_layers(model, dtype) == 2
    assert all((layer.row_weight_t is not None) == kept for layer in model)
    assert all(layer.row_weight_t.dtype == dtype for layer in model if kept)
