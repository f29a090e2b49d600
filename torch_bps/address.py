"""Where a server is: "host:port" strings, and the line `bps-server` prints once it listens.

One reader for every address given to torch_bps (BPS_SERVERS, BPS_REGISTRY, a Client's servers, a registry's
store), and one format for the line its launchers wait for (the embedded server, tests, benchmarks).
May import: the standard library only.
"""

from __future__ import annotations

import re
import socket

# What `listening_line` prints: its groups are the port and the incarnation.
_LISTENING = re.compile(r"port (\d+) incarnation (0x[0-9a-f]+)")


def split_host_port(address: str) -> tuple[str, int]:
    """Return (host, port) of "host:port"; ValueError naming the address if it is not one."""
    host, _, port = str(address).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not host:port (a port in 1-65535)")
    return host, int(port)


def accepts(address: str, timeout: float) -> bool:
    """Whether a TCP connection to `address` opens within `timeout` seconds (then closed, nothing sent): False where
    nothing listens (a server killed) or the host is cut off, which ZeroMQ would retry silently."""
    try:
        socket.create_connection(split_host_port(address), timeout=timeout).close()
        return True
    except OSError:
        return False


def listening_line(address: str, port: int, incarnation: int) -> str:
    return f"bps-server listening on {address} port {port} incarnation {incarnation:#x}"


def parse_listening(line: str) -> tuple[int, int] | None:
    """(port, incarnation) of a `listening_line` in `line`; None if there is none."""
    m = _LISTENING.search(line)
    return (int(m.group(1)), int(m.group(2), 16)) if m else None
