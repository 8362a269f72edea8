"""The kernels' instruction-set level (isa.c) against Python's check of the CPU
(gateway/platforms/cpu_isa.py): the AVX-512 bfloat16 kernels run exactly where it finds
AVX512-BF16, and not once the level or the tests forbid them."""

from __future__ import annotations

import pytest

from gateway.models.kernels.cpu.library import load
from gateway.platforms.cpu_isa import IsaLevel, cpu_isa
from tests.models.kernels.cpu.wide_rows import wide_bf16_rows

pytestmark = pytest.mark.isa  # the CPU's instruction set decides the paths


def test_the_kernels_run_where_the_cpu_has_avx2_fma_and_f16c():
    library = load()
    assert library is not None, "the kernels must build on the test machine (cc, AVX2)"
    assert library.gw_supported() == 1


def test_the_avx512_kernels_follow_the_level_python_allows():
    with wide_bf16_rows(True) as wide:
        assert wide == cpu_isa().has_native_bf16
    with wide_bf16_rows(False) as wide:
        assert not wide
    library = load()
    assert library is not None
    try:
        library.gw_set_isa_level(int(IsaLevel.AVX2))
        assert not library.gw_wide_bf16_rows(1) and not library.gw_bf16_products()
    finally:
        library.gw_set_isa_level(int(cpu_isa().level))
    assert bool(library.gw_bf16_products()) == cpu_isa().has_native_bf16
