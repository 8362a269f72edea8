"""One scan of the installed metadata per process, shared by every plugin group.

The reference pattern calls `entry_points(group=...)` for each group at each call, and each
such call reads every installed distribution again. Here the scan runs once, keeps only the
`vllm.*` groups, and reads a distribution's METADATA only when it has such an entry point.
"""

from __future__ import annotations

import os
import re
import sys
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


def scan_installed(paths: Iterable[str] | None = None) -> dict[str, list[DiscoveredPlugin]]:
    """Read every installed distribution once; return the vllm.* entry points by group,
    in sys.path order. A distribution installed twice counts once (the first on the path,
    as Python's import system would pick it).

    Walks the `*.dist-info` / `*.egg-info` folders of each sys.path entry with os.scandir
    and plain file reads: the same metadata importlib.metadata reads, without its per-file
    pathlib and e-mail-parser overhead.
    """
    by_group: dict[str, list[DiscoveredPlugin]] = {}
    seen: set[str] = set()
    for info_dir in _metadata_dirs(sys.path if paths is None else paths):
        key = _normalize(os.path.basename(info_dir).rpartition(".")[0].split("-")[0])
        if key in seen:
            continue
        seen.add(key)
        text = _read(info_dir, "entry_points.txt")
        if not text or _GROUP_PREFIX not in text:
            continue
        dist_name = _distribution_name(info_dir) or key
        for group, name, value in _parse_entry_points(text):
            if group.startswith(_GROUP_PREFIX):
                by_group.setdefault(group, []).append(
                    DiscoveredPlugin(group, name, value, dist_name))
    return by_group


def _metadata_dirs(paths: Iterable[str]) -> Iterable[str]:
    for entry in paths:
        try:
            with os.scandir(entry or ".") as it:
                names = sorted(e.name for e in it if e.name.endswith((".dist-info", ".egg-info")))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        for name in names:
            yield os.path.join(entry or ".", name)


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _read(info_dir: str, filename: str) -> str | None:
    try:
        with open(os.path.join(info_dir, filename), encoding="utf-8") as f:
            return f.read()
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
        return None


def _distribution_name(info_dir: str) -> str | None:
    """The Name header of METADATA (PKG-INFO for eggs), read without the e-mail parser."""
    text = _read(info_dir, "METADATA") or _read(info_dir, "PKG-INFO") or ""
    for line in text.splitlines():
        if line.startswith("Name:"):
            return line[5:].strip()
        if not line:
            break
    return None


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
