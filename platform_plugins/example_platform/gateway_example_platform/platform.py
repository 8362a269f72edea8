"""The platform class: what the gateway asks of a device (docs/plugins.md,
"vllm.platform_plugins"). `current_platform` is an instance of it."""

from __future__ import annotations

from typing import ClassVar

from gateway.platforms import Platform


class ExamplePlatform(Platform):
    device_type: ClassVar[str] = "cpu"         # the torch device the worker uses
    device_name: ClassVar[str] = "example-cpu"  # in the logs and in /v1/plugins
    dist_backend: ClassVar[str] = "gloo"       # torch.distributed backend for -tp N
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")
