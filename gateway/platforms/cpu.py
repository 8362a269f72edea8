"""The built-in CPU platform (any process that reads `current_platform`): gloo for the
ranks' collectives, float32 and bfloat16 weights. Its detector always activates, so it is
the fallback when no other platform does.
"""

from __future__ import annotations

from gateway.platforms.interface import Platform


class CpuPlatform(Platform):
    device_type = "cpu"
    device_name = "cpu"
    dist_backend = "gloo"
    supported_dtypes = ("float32", "bfloat16")


def cpu_platform_plugin() -> str:
    """The CPU is always there: the fallback when no other platform activates."""
    return "gateway.platforms.cpu.CpuPlatform"
