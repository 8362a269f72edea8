"""What a platform tells the rest of the gateway about its device (any process)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch


class Platform:
    """A device kind. Subclass it in a platform plugin and return its qualname."""

    device_type: ClassVar[str] = "unknown"   # torch device type: "cpu", "cuda", ...
    device_name: ClassVar[str] = "unknown"   # for humans and the load report
    dist_backend: ClassVar[str] = "gloo"     # torch.distributed backend for this device
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32",)

    @classmethod
    def is_cpu(cls) -> bool:
        return cls.device_type == "cpu"

    @classmethod
    def is_cuda(cls) -> bool:
        return cls.device_type == "cuda"

    @classmethod
    def torch_device(cls, index: int = 0) -> torch.device:
        import torch
        return torch.device(cls.device_type if cls.is_cpu() else f"{cls.device_type}:{index}")

    @classmethod
    def check_dtype(cls, dtype: str) -> None:
        """Raise ValueError when this device cannot run `dtype`."""
        if dtype not in cls.supported_dtypes:
            raise ValueError(f"dtype {dtype!r} is not supported on {cls.device_name}; "
                             f"supported: {', '.join(cls.supported_dtypes)}")
