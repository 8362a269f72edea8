"""The CPU's instruction-set level as the gateway's own kernels and path choices see it (any
process): the one check the product and the tests share.

The level is read from the CPU's feature flags, then capped by GATEWAY_CPU_ISA, so that an
AVX-512 machine can run the gateway (and its test suite) as an AVX2-only machine would.
The cap applies to the gateway's choices only; torch's own kernels follow their own
settings (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA), which `scripts/test` caps alongside.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import platform
from pathlib import Path

from gateway import envs


class IsaLevel(enum.IntEnum):
    """Each level includes the ones below it."""
    BASELINE = 0     # no AVX2 (or not x86-64): torch's kernels only
    AVX2 = 1         # AVX2, FMA, F16C: the gateway's C kernels
    AVX512 = 2       # AVX-512 F, BW, VL, DQ: oneDNN's bfloat16 products
    AVX512_BF16 = 3  # and AVX512_BF16: bfloat16 computed natively, the bfloat16 C kernels
    AMX = 4          # and AMX tiles (bfloat16)


# The /proc/cpuinfo flags each level needs beyond the levels below it.
_LEVEL_FLAGS: dict[IsaLevel, tuple[str, ...]] = {
    IsaLevel.AVX2: ("avx2", "fma", "f16c"),
    IsaLevel.AVX512: ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    IsaLevel.AVX512_BF16: ("avx512_bf16",),
    IsaLevel.AMX: ("amx_tile", "amx_bf16"),
}


@dataclasses.dataclass(frozen=True)
class CpuIsa:
    """`level`: what the gateway may use; `native`: what the CPU has; `has_avx_ne_convert`:
    the AVX2-class bfloat16 conversions that oneDNN's bfloat16 path also runs on;
    `has_avx512_vnni`: AVX-512 VNNI's integer dot products, within the level allowed."""
    level: IsaLevel
    native: IsaLevel
    has_avx_ne_convert: bool = False
    has_avx512_vnni: bool = False

    @property
    def is_capped(self) -> bool:
        return self.level < self.native

    @property
    def runs_gateway_kernels(self) -> bool:
        """The gateway's C kernels (quantized products, attention, elementwise, sampling)."""
        return self.level >= IsaLevel.AVX2

    @property
    def has_native_bf16(self) -> bool:
        """bfloat16 products computed natively: where `--dtype auto` picks bfloat16, and
        where the gateway's bfloat16 kernels run."""
        return self.level >= IsaLevel.AVX512_BF16

    @property
    def has_onednn_bf16(self) -> bool:
        """oneDNN's packed bfloat16 linear layers (it refuses them on plain AVX2)."""
        return self.level >= IsaLevel.AVX512 or self.has_avx_ne_convert

    def describe(self) -> str:
        name = self.level.name.lower()
        return f"{name} (capped by GATEWAY_CPU_ISA from {self.native.name.lower()})" \
            if self.is_capped else name


def level_of(flags: set[str]) -> IsaLevel:
    """The highest level whose flags, and those of every level below, are all in `flags`."""
    level = IsaLevel.BASELINE
    for candidate, needed in _LEVEL_FLAGS.items():
        if not set(needed) <= flags:
            break
        level = candidate
    return level


def parse_cap(value: str | None) -> IsaLevel | None:
    """GATEWAY_CPU_ISA's value as a level (None: unset or `native`); ValueError naming the
    value and the choices otherwise."""
    if value is None or value.strip().lower() in ("", "native"):
        return None
    try:
        return IsaLevel[value.strip().upper()]
    except KeyError:
        choices = ", ".join(level.name.lower() for level in IsaLevel)
        raise ValueError(f"GATEWAY_CPU_ISA={value!r} is not a level; use native, "
                         f"{choices}") from None


@functools.cache
def cpu_isa() -> CpuIsa:
    """This CPU's level, capped by GATEWAY_CPU_ISA (read once per process)."""
    flags = _cpu_flags()
    native = level_of(flags)
    cap = parse_cap(envs.cpu_isa_cap())
    level = native if cap is None else min(native, cap)
    has_ne_convert = "avx_ne_convert" in flags and level >= IsaLevel.AVX2 and (
        cap is None or cap >= native)
    has_vnni = "avx512_vnni" in flags and level >= IsaLevel.AVX512
    return CpuIsa(level, native, has_ne_convert, has_vnni)


def _cpu_flags() -> set[str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return _flags_from_torch()


def _flags_from_torch() -> set[str]:
    """Where /proc/cpuinfo is not there: torch's own CPU checks, as flags."""
    import torch

    checks = {"_is_avx2_supported": _LEVEL_FLAGS[IsaLevel.AVX2],
              "_is_avx512_supported": _LEVEL_FLAGS[IsaLevel.AVX512],
              "_is_avx512_bf16_supported": _LEVEL_FLAGS[IsaLevel.AVX512_BF16],
              "_is_amx_tile_supported": _LEVEL_FLAGS[IsaLevel.AMX]}
    return {flag for check, flags in checks.items()
            if getattr(torch.cpu, check, lambda: False)() for flag in flags}
