"""One scan of the installed metadata per process, shared by every plugin group.

The reference pattern calls `entry_points(group=...)` for each group at each call, and each
such call reads every installed distribution again. Here the scan runs once, keeps only the
`vllm.*` groups, and reads a distribution's METADATA only when it has such an entry point.
"""

from __future__ import annotations

import importlib.metadata as md
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

_GROUP_PREFIX = "vllm."
# The grammar of an entry point's value: "module.path[:attr.path]" with optional [extras].
_VALUE_RE = re.compile(r"^(?P<module>[\w.]+)\s*(:\s*(?P<attr>[\w.]+)\s*)?(\[[^\]]*\]\s*)?$")


@dataclass(frozen=True)
class DiscoveredPlugin:
    group: str
    name: str
    value: str
    distribution: str

    @property
    def is_well_formed(self) -> bool:
        return _VALUE_RE.match(self.value) is not None and not self.value.startswith(".")

    @property
    def module(self) -> str:
        match = _VALUE_RE.match(self.value)
        assert match is not None
        return match.group("module")

    @property
    def attr(self) -> str | None:
        match = _VALUE_RE.match(self.value)
        assert match is not None
        return match.group("attr")


Discover = Callable[[], dict[str, list[DiscoveredPlugin]]]


def scan_installed(distributions: Iterable[md.Distribution] | None = None,
                   ) -> dict[str, list[DiscoveredPlugin]]:
    """Read every installed distribution once; return the vllm.* entry points by group,
    in sys.path order. A distribution installed twice counts once (the first on the path,
    as Python's import system would pick it)."""
    by_group: dict[str, list[DiscoveredPlugin]] = {}
    seen: set[str] = set()
    for dist in distributions if distributions is not None else md.distributions():
        key = getattr(dist, "_normalized_name", None) or dist.metadata["Name"] or ""
        if key in seen:
            continue
        seen.add(key)
        text = dist.read_text("entry_points.txt")
        if not text or _GROUP_PREFIX not in text:
            continue
        dist_name = dist.metadata["Name"] or key
        for group, name, value in _parse_entry_points(text):
            if group.startswith(_GROUP_PREFIX):
                by_group.setdefault(group, []).append(
                    DiscoveredPlugin(group, name, value, dist_name))
    return by_group


def _parse_entry_points(text: str) -> Iterable[tuple[str, str, str]]:
    """Parse entry_points.txt (an INI file: [group] then `name = value` lines)."""
    group = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            group = line[1:-1].strip()
            continue
        if group is None or "=" not in line:
            continue
        name, _, value = line.partition("=")
        yield group, name.strip(), value.strip()


_cache: dict[str, list[DiscoveredPlugin]] | None = None
_discover: Discover = scan_installed


def discover_all() -> dict[str, list[DiscoveredPlugin]]:
    """Every vllm.* entry point installed, by group; scanned once per process."""
    global _cache
    if _cache is None:
        _cache = _discover()
    return _cache


def discover(group: str) -> list[DiscoveredPlugin]:
    return list(discover_all().get(group, []))


def set_discovery(discover_fn: Discover | None) -> None:
    """Inject another discovery function (tests, benchmarks); None restores the default."""
    global _discover, _cache
    _discover = discover_fn or scan_installed
    _cache = None


def reset_cache() -> None:
    """Forget the scan, so the next call reads the metadata again (tests only)."""
    global _cache
    _cache = None
