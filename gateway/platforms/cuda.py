"""The built-in CUDA platform (any process that reads `current_platform`): nccl for the
ranks' collectives, float32, bfloat16 and float16 weights. It activates when the CUDA
driver reports a device, asked without importing torch.
"""

from __future__ import annotations

import ctypes

from gateway.platforms.interface import Platform


class CudaPlatform(Platform):
    device_type = "cuda"
    device_name = "cuda"
    dist_backend = "nccl"
    supported_dtypes = ("float32", "bfloat16", "float16")


def cuda_platform_plugin() -> str | None:
    """Activate when the CUDA driver reports at least one device.

    Asks the driver library directly, so detection does not import torch (the front end
    reads the platform too and must stay light).
    """
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        if libcuda.cuInit(0) != 0:
            return None
        count = ctypes.c_int(0)
        if libcuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
            return None
    except OSError:
        return None
    return "gateway.platforms.cuda.CudaPlatform"
