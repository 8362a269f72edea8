"""Host-to-device copies that never wait for the device (worker process).

A step's inputs are laid out in numpy on the host; on a CUDA device each array goes
through a pinned (page-locked) buffer from torch's caching host allocator and is copied
with non_blocking=True, so the host goes on preparing while the copy queues behind the
device's work. A copy from ordinary pageable memory could make the host wait. On the CPU
the array itself becomes the tensor, with no copy.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cpu":
        return tensor
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
