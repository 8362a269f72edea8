"""A platform plugin: a detector the gateway calls in every process that reads
`gateway.platforms.current_platform` (each process does, before its general plugins).

It returns the platform class's qualname when its device is present, else None. It must be
cheap and must not import torch: the front end runs it too. This example has no device of
its own: it is a CPU under another name, active when GATEWAY_EXAMPLE_PLATFORM=1, so that
installing it changes nothing until you ask.
"""

from __future__ import annotations

import os


def detect() -> str | None:
    if os.environ.get("GATEWAY_EXAMPLE_PLATFORM") != "1":
        return None
    return "gateway_example_platform.platform:ExamplePlatform"
