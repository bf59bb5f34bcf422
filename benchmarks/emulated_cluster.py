"""An emulated cluster on one host: local task processes with capped links.

Run the benchmarks that use it inside a private network namespace as root
(`unshare -n bash -c 'ip link set lo up && python benchmarks/....py'`): each
task gets a fixed port, and an `htb` class per task on `lo`, matched by the
task's port (source or destination), caps the traffic to and from that
task's server. The spec tells the search the same bandwidth. On the 2-core
development machine every task shares the same two cores, so compute is
contended; the capped links make the communication-bound settings, where
strategies differ.
"""
from __future__ import annotations

import os
import subprocess

BASE_PORT = 23000


def in_private_netns() -> bool:
    """Whether this process runs in its own network namespace."""
    if os.environ.get("AUTODIST_PRIVATE_NETNS") == "1":
        return True
    try:
        return os.readlink("/proc/self/ns/net") != os.readlink("/proc/1/ns/net")
    except OSError:
        return False


def shape_lo(ports: list[int], mbit: float) -> None:
    """One htb class per task port on `lo`, capped at `mbit` Mbit/s."""
    clear_lo()
    run = lambda *a: subprocess.run(list(a), check=True, capture_output=True)  # noqa: E731
    run("tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "99")
    run("tc", "class", "add", "dev", "lo", "parent", "1:", "classid", "1:99", "htb",
        "rate", "100gbit")
    for i, port in enumerate(ports):
        classid = f"1:{10 + i}"
        run("tc", "class", "add", "dev", "lo", "parent", "1:", "classid", classid, "htb",
            "rate", f"{mbit}mbit", "ceil", f"{mbit}mbit")
        for field in ("sport", "dport"):
            run("tc", "filter", "add", "dev", "lo", "protocol", "ip", "parent", "1:", "prio",
                "1", "u32", "match", "ip", field, str(port), "0xffff", "flowid", classid)


def clear_lo() -> None:
    """Removes the caps."""
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)


def capped_spec(workers: int, ps: int, mbit: float, base_port: int = BASE_PORT):
    """A local spec with fixed ports whose nodes report `mbit` of bandwidth; shapes `lo`.

    Returns:
        (the ResourceSpec, the ports of its tasks).
    """
    import autodist  # pylint: disable=import-outside-toplevel

    nodes = workers + ps
    ports = [base_port + i for i in range(nodes)]
    spec = autodist.ResourceSpec.from_dict({"nodes": [
        {"address": "localhost", "port": ports[i], "chief": i == 0, "cpus": [0],
         "roles": ["worker"] if i < workers else ["ps"],
         "network_bandwidth": mbit / 1000} for i in range(nodes)]})
    shape_lo(ports, mbit)
    return spec, ports
