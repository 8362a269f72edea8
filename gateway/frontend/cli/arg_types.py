"""argparse `type=` converters shared by the CLI's argument groups (front-end process).

A bad value is an `argparse.ArgumentTypeError`, so argparse names the flag and exits 2.
"""

from __future__ import annotations

import argparse
import re
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


# vLLM's byte counts: k, m, g, t are powers of 1000 (decimals allowed); K, M, G, T and
# Ki, Mi, Gi, Ti (with or without a trailing B) powers of 1024 (whole numbers only).
_BYTES_RE = re.compile(r"(?P<num>\d+(?:\.\d+)?)\s*(?:(?P<si>[kmgt])|(?P<iec>[KMGT])(?:iB?)?)?")
_BYTE_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4}


def byte_count(text: str) -> int:
    """A positive number of bytes: 1073741824, 1G or 1GiB (2**30), 1g (10**9), 25.6k."""
    match = _BYTES_RE.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: give bytes, or a number with k, m, g, t (powers of "
            "1000) or K, M, G, T, KiB, MiB, GiB, TiB (powers of 1024)")
    number, si, iec = match.group("num"), match.group("si"), match.group("iec")
    if iec and "." in number:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: a power-of-1024 unit takes a whole number "
            f"(or write {number}{iec.lower()} for powers of 1000)")
    if si:
        value = int(float(number) * 1000 ** _BYTE_POWERS[si])
    elif iec:
        value = int(number) * 1024 ** _BYTE_POWERS[iec.lower()]
    elif "." in number:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: bytes are a whole number")
    else:
        value = int(number)
    if value < 1:
        raise argparse.ArgumentTypeError(f"the size must be positive, got {text!r}")
    return value


def fraction_of_one(text: str) -> float:
    """A number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value
