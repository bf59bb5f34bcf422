"""An emulated cluster on one host: local task processes with capped links.

Runs need a private network namespace and root (`tc` shapes `lo`):
`unshare -n bash -c 'ip link set lo up && autodist bench'`. Each task gets a
fixed port and an `htb` class on `lo`, matched by the task's port (source or
destination), that caps the traffic to and from that task's server. The spec
tells the search the same bandwidth. On a small machine every task shares the
same cores, so compute is contended; the capped links make the
communication-bound settings, where strategies differ.
"""
from __future__ import annotations

import os
import subprocess

from autodist.ir.errors import InvalidArgumentError
from autodist.launch.netns_holder import exposed_interfaces

BASE_PORT = 23000


def in_private_netns() -> bool:
    """Whether this process's network namespace has no interface up but loopback.

    The test a local cluster uses too (`autodist.launch.private_network.is_private`):
    true inside ``unshare -n`` after ``ip link set lo up``, whatever
    `/proc/1` allows to be read; then shaping `lo` touches nothing but the
    emulated cluster.
    """
    return not exposed_interfaces()


def can_shape() -> bool:
    """Whether this process may shape `lo`: root in a private network namespace."""
    return in_private_netns() and hasattr(os, "geteuid") and os.geteuid() == 0


def shape_lo(ports: list[int], mbit: float) -> None:
    """One htb class per task port on `lo`, capped at `mbit` Mbit/s.

    Raises:
        ValueError: `mbit` is not positive.
        subprocess.CalledProcessError: `tc` failed (not root, no htb).
    """
    if mbit <= 0:
        raise InvalidArgumentError(f"bandwidth must be positive Mbit/s. Received: {mbit!r}")
    clear_lo()

    def tc(*args: str) -> None:
        subprocess.run(["tc", *args], check=True, capture_output=True)

    tc("qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "99")
    tc("class", "add", "dev", "lo", "parent", "1:", "classid", "1:99", "htb", "rate", "100gbit")
    for i, port in enumerate(ports):
        classid = f"1:{10 + i}"
        tc("class", "add", "dev", "lo", "parent", "1:", "classid", classid, "htb",
           "rate", f"{mbit}mbit", "ceil", f"{mbit}mbit")
        for field in ("sport", "dport"):
            tc("filter", "add", "dev", "lo", "protocol", "ip", "parent", "1:", "prio", "1",
               "u32", "match", "ip", field, str(port), "0xffff", "flowid", classid)


def clear_lo() -> None:
    """Removes the caps (no error if there are none)."""
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True,
                   check=False)


def capped_spec(workers: int, ps: int, mbit: float, base_port: int = BASE_PORT,
                shape: bool = True):
    """A local spec with fixed ports whose nodes report `mbit` of bandwidth; shapes `lo`.

    Worker tasks get ports `base_port + i` (i < workers), PS tasks the next
    ones; a process that serves on a worker's port later (e.g. a baseline's
    worker) falls under that worker's cap.

    Args:
        workers: Worker tasks (>= 1).
        ps: Parameter-server tasks (>= 0).
        mbit: Per-task bandwidth, Mbit/s.
        base_port: The first task's port.
        shape: Apply the caps with `tc` (False: only build the spec).

    Returns:
        (the ResourceSpec, the ports of its tasks).
    """
    from autodist.ir.resource_spec import ResourceSpec

    if workers < 1 or ps < 0:
        raise InvalidArgumentError(f"need >= 1 worker and >= 0 PS. Received: workers={workers!r}, "
                                   f"ps={ps!r}")
    nodes = workers + ps
    ports = [base_port + i for i in range(nodes)]
    spec = ResourceSpec.from_dict({"nodes": [
        {"address": "localhost", "port": ports[i], "chief": i == 0, "cpus": [0],
         "roles": ["worker"] if i < workers else ["ps"],
         "network_bandwidth": mbit / 1000} for i in range(nodes)]})
    if shape:
        shape_lo(ports, mbit)
    return spec, ports
