"""The CPU's instruction-set level (platforms/cpu_isa.py): read from the CPU's flags, capped
by GATEWAY_CPU_ISA, and followed by every path choice that depends on it (the dtype `auto`
picks, oneDNN's bfloat16 packing, the gateway's C kernels and their bfloat16 variants)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gateway.platforms import cpu_isa as isa_module
from gateway.platforms.cpu_isa import IsaLevel, cpu_isa, level_of, parse_cap

pytestmark = pytest.mark.isa

AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}


@pytest.mark.parametrize(("flags", "level"), [
    (set(), IsaLevel.BASELINE),
    ({"avx", "avx2", "fma"}, IsaLevel.BASELINE),  # no F16C: the kernels need all three
    (AVX2, IsaLevel.AVX2),
    (AVX2 | {"avx512f", "avx512bw"}, IsaLevel.AVX2),  # no VL and DQ
    (AVX512, IsaLevel.AVX512),
    (AVX2 | {"avx512_bf16"}, IsaLevel.AVX2),  # BF16 without the AVX-512 below it
    (AVX512 | {"avx512_bf16"}, IsaLevel.AVX512_BF16),
    (AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"}, IsaLevel.AMX),
])
def test_the_level_is_the_highest_whose_flags_and_those_below_are_all_there(flags, level):
    assert level_of(flags) == level


@pytest.mark.parametrize(("value", "level"), [
    (None, None), ("", None), ("native", None), ("avx2", IsaLevel.AVX2),
    (" AVX512_BF16 ", IsaLevel.AVX512_BF16), ("baseline", IsaLevel.BASELINE)])
def test_the_cap_is_read_by_name(value, level):
    assert parse_cap(value) == level


def test_a_cap_that_is_not_a_level_is_refused_naming_it_and_the_choices():
    with pytest.raises(ValueError, match=r"GATEWAY_CPU_ISA='avx3'.*native, baseline, avx2"):
        parse_cap("avx3")


@pytest.mark.parametrize("cap", list(IsaLevel))
def test_the_cap_lowers_the_level_and_never_raises_it(monkeypatch, cap):
    native = cpu_isa().native
    monkeypatch.setenv("GATEWAY_CPU_ISA", cap.name.lower())
    isa_module.cpu_isa.cache_clear()
    try:
        capped = cpu_isa()
        assert capped.native == native
        assert capped.level == min(native, cap)
        assert capped.is_capped == (cap < native)
        assert capped.has_native_bf16 == (capped.level >= IsaLevel.AVX512_BF16)
        if cap < IsaLevel.AVX512:
            assert not capped.has_onednn_bf16
        assert ("capped by GATEWAY_CPU_ISA" in capped.describe()) == capped.is_capped
    finally:
        isa_module.cpu_isa.cache_clear()


_CHOICES = """
import json, torch
from gateway.models.kernels.cpu.library import load
from gateway.models.kernels.cpu.quant_weight import has_bf16_products
from gateway.models.layers.cpu_linear import can_pack
from gateway.models.loading.loader import resolve_dtype
from gateway.platforms.cpu import CpuPlatform
from gateway.platforms.cpu_isa import cpu_isa
library = load()
print(json.dumps({
    "level": cpu_isa().level.name, "auto": str(resolve_dtype("auto", CpuPlatform)),
    "packs_bf16": can_pack(torch.device("cpu"), torch.bfloat16),
    "kernels": library is not None, "bf16_products": has_bf16_products(),
    "wide_rows": bool(library is not None and library.gw_wide_bf16_rows(1)),
}))
"""


def _choices(cap: str) -> dict[str, object]:
    env = {**os.environ, "GATEWAY_CPU_ISA": cap}
    done = subprocess.run([sys.executable, "-c", _CHOICES], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_capped_to_avx2_every_path_choice_is_an_avx2_machines():
    choices = _choices("avx2")
    expected_level = min(cpu_isa().native, IsaLevel.AVX2).name
    assert choices == {"level": expected_level, "auto": "torch.float32", "packs_bf16": False,
                       "kernels": expected_level == "AVX2", "bf16_products": False,
                       "wide_rows": False}


def test_capped_to_baseline_the_c_kernels_stay_unloaded():
    choices = _choices("baseline")
    assert choices["level"] == "BASELINE" and choices["kernels"] is False
    assert choices["auto"] == "torch.float32" and choices["bf16_products"] is False


def test_native_choices_follow_the_cpus_own_level():
    choices = _choices("native")
    native = cpu_isa().native  # the CPU's own, whatever this process's cap
    has_native_bf16 = native >= IsaLevel.AVX512_BF16
    assert choices["level"] == native.name
    assert choices["auto"] == ("torch.bfloat16" if has_native_bf16 else "torch.float32")
    assert choices["bf16_products"] == choices["wide_rows"] == has_native_bf16
    assert choices["kernels"] == (native >= IsaLevel.AVX2)


def test_serve_refuses_a_cap_that_is_not_a_level_before_loading_anything():
    gateway = os.path.join(os.path.dirname(sys.executable), "gateway")
    done = subprocess.run([gateway, "serve", "--port", "1"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "GATEWAY_CPU_ISA": "avx1024"})
    assert done.returncode == 2
    assert "GATEWAY_CPU_ISA='avx1024' is not a level" in done.stderr
