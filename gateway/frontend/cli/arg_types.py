"""argparse `type=` converters shared by the CLI's argument groups (front-end process).

A bad value is an `argparse.ArgumentTypeError`, so argparse names the flag and exits 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_at_least(minimum: int) -> Callable[[str], int]:
    """A converter to an integer >= `minimum` (1: "a positive integer")."""
    wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {value}")
        return value

    return parse
