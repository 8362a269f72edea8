"""The internet sockets a set of processes holds, read from /proc (Linux): for tests that
assert a server and its children stay on loopback."""

from __future__ import annotations

import contextlib
import ipaddress
import os
from pathlib import Path
from typing import NamedTuple

_TABLES = ("tcp", "tcp6", "udp", "udp6")
_TCP_LISTEN = "0A"


class InetSocket(NamedTuple):
    pid: int
    table: str  # tcp, tcp6, udp, udp6
    local: str  # address:port
    remote: str
    is_listening: bool


def _address(hex_address: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """/proc/net/tcp's `0100007F:1F90` (address in host order words, port big-endian)."""
    raw, port = hex_address.split(":")
    data = bytes.fromhex(raw)
    # each 32-bit word is in the machine's (little-endian) order
    words = b"".join(data[i:i + 4][::-1] for i in range(0, len(data), 4))
    address = ipaddress.ip_address(words)
    return address, int(port, 16)


def _is_loopback(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(int(link[8:-1]))
    return inodes


def inet_sockets(pids: set[int]) -> list[InetSocket]:
    """Every TCP and UDP socket (IPv4 and IPv6) the processes `pids` hold open."""
    found = []
    for pid in pids:
        inodes = _socket_inodes(pid)
        if not inodes:
            continue
        for table in _TABLES:
            with contextlib.suppress(OSError):
                lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
                for line in lines:
                    fields = line.split()
                    if int(fields[9]) not in inodes:
                        continue
                    (local, local_port), (remote, remote_port) = (
                        _address(fields[1]), _address(fields[2]))
                    found.append(InetSocket(
                        pid, table, f"{local}:{local_port}", f"{remote}:{remote_port}",
                        table.startswith("tcp") and fields[3] == _TCP_LISTEN))
    return found


def off_loopback(sockets: list[InetSocket]) -> list[InetSocket]:
    """The sockets bound to an address that is not loopback (a wildcard included: it
    accepts on every interface) or connected to one."""
    bad = []
    for sock in sockets:
        local, _ = _address_of(sock.local)
        remote, remote_port = _address_of(sock.remote)
        connected = not (remote.is_unspecified and remote_port == 0)
        if not _is_loopback(local) or (connected and not _is_loopback(remote)):
            bad.append(sock)
    return bad


def _address_of(text: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    host, _, port = text.rpartition(":")
    return ipaddress.ip_address(host), int(port)
