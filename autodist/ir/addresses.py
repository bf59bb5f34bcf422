"""Task addresses ("host:port", IPv6 hosts in brackets) and whether a task listens."""
from __future__ import annotations

import socket


def accepts(address: str, timeout_s: float = 1.0) -> bool:
    """Whether something accepts TCP connections at "host:port" within `timeout_s`
    (a task's server, an `autodist serve`); False for a malformed address."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False
