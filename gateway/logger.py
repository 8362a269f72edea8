"""Logging set-up shared by every gateway process."""

from __future__ import annotations

import logging
import sys

from gateway import envs

_FORMAT = "%(levelname)s %(asctime)s [%(name)s pid=%(process)d] %(message)s"
_configured = False


def init_logger(name: str) -> logging.Logger:
    """Return the logger `name`, configuring the `gateway` root logger once per process."""
    global _configured
    if not _configured:
        root = logging.getLogger("gateway")
        if not root.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
            root.addHandler(handler)
        root.setLevel(envs.logging_level())
        root.propagate = True
        _configured = True
    return logging.getLogger(name)
