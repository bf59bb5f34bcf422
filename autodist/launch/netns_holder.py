"""Network interfaces of this process's namespace, and the process that holds a private one.

Standard library only: `autodist.launch.private_network` runs this file as a script
(``python -I -S netns_holder.py``, inside ``unshare --net``) without importing
the autodist package, whose import costs more than a second. As a script it
is the holder of a local cluster's private network namespace: it brings
loopback up, prints ``ready``, and lives until its launcher closes its
standard input (or dies), so the namespace lives as long as the cluster.
"""
from __future__ import annotations

import fcntl
import socket
import struct
import sys

# Linux <linux/sockios.h>, <net/if.h>; struct ifreq is 40 bytes: a 16-byte
# name, then (here) the short interface flags.
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFREQ = "16sH22x"
IFF_UP = 0x1
IFF_LOOPBACK = 0x8


def interface_flags(sock: socket.socket, name: str) -> int:
    """The flags (IFF_*) of interface `name` of the socket's network namespace."""
    request = struct.pack(_IFREQ, name.encode(), 0)
    return struct.unpack(_IFREQ, fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]


def exposed_interfaces() -> list[str]:
    """Interfaces of this process's network namespace that are up, loopback aside.

    An interface whose flags cannot be read counts as up.
    """
    exposed = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                flags = interface_flags(sock, name)
            except OSError:
                flags = IFF_UP
            if flags & IFF_UP and not flags & IFF_LOOPBACK:
                exposed.append(name)
    return exposed


def bring_up_loopback() -> None:
    """Sets loopback up (which gives it 127.0.0.1 and ::1), as ``ip link set lo up``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        flags = interface_flags(sock, "lo")
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | IFF_UP))


def hold() -> int:
    """The holder's life: loopback up, ``ready`` on stdout, then wait for stdin's end."""
    bring_up_loopback()
    exposed = exposed_interfaces()
    if exposed:  # a namespace of our own has nothing but loopback
        print(f"not a private namespace: interfaces {exposed} are up", file=sys.stderr)
        return 1
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.buffer.read()
    return 0


if __name__ == "__main__":
    sys.exit(hold())
