"""The checks every ResourceSpec passes, whatever built it."""
from __future__ import annotations

import math
from typing import Sequence

from autodist.ir.errors import ResourceSpecError, short_repr
from autodist.ir.resource_spec_parsing import (MAX_ADDRESS_CHARS, MAX_DEVICES_PER_NODE, MAX_NODES,
                                               VALID_ROLES)
from autodist.proto import resource_spec_pb2


def check_nodes(nodes: Sequence[resource_spec_pb2.Node]) -> None:
    """Raises ResourceSpecError unless `nodes` make a cluster: addresses, ports, roles,
    devices, bandwidths and memory valid; a worker; exactly one chief, a worker.
    """
    if not nodes:
        raise ResourceSpecError("a resource spec needs at least one node. Received: 0 nodes")
    if len(nodes) > MAX_NODES:
        raise ResourceSpecError(f"a resource spec has at most {MAX_NODES} nodes. "
                                f"Received: {len(nodes)}")
    seen: dict[tuple[str, int], int] = {}
    for i, n in enumerate(nodes):
        if not n.address:
            raise ResourceSpecError(f"nodes[{i}].address is empty")
        if len(n.address) > MAX_ADDRESS_CHARS:
            raise ResourceSpecError(f"nodes[{i}].address is longer than {MAX_ADDRESS_CHARS} "
                                    f"characters. Received: {short_repr(n.address)}")
        where = f"nodes[{i}] ({n.address})"
        if not 0 <= n.port <= 65535:
            raise ResourceSpecError(f"{where}.port must be in 0..65535. Received: {n.port}")
        if not n.roles:
            raise ResourceSpecError(f"{where}.roles is empty; expected worker and/or ps")
        for r in n.roles:
            if r not in VALID_ROLES:
                raise ResourceSpecError(f"{where}.roles: unknown role {short_repr(r)}; "
                                        f"expected one of {VALID_ROLES}")
        if not n.cpus:
            raise ResourceSpecError(f"{where}.cpus is empty; every task has a CPU")
        for field in ("cpus", "gpus"):
            values = getattr(n, field)
            if len(values) > MAX_DEVICES_PER_NODE:
                raise ResourceSpecError(f"{where}.{field} lists {len(values)} devices, more "
                                        f"than {MAX_DEVICES_PER_NODE}")
            values = list(values)
            if any(v < 0 for v in values) or len(set(values)) != len(values):
                raise ResourceSpecError(f"{where}.{field} must be distinct indices >= 0. "
                                        f"Received: {short_repr(values)}")
        if n.gpus and "worker" not in n.roles:
            raise ResourceSpecError(
                f"{where} has GPUs {list(n.gpus)} but no 'worker' role to use them")
        if not n.network_bandwidth_gbps >= 0 or math.isinf(n.network_bandwidth_gbps):
            raise ResourceSpecError(
                f"{where}.network_bandwidth must be finite and >= 0 Gbit/s. "
                f"Received: {n.network_bandwidth_gbps}")
        if n.gpu_memory_bytes and not n.gpus:
            raise ResourceSpecError(
                f"{where}.gpu_memory is {n.gpu_memory_bytes} bytes but the node has no "
                "gpus")
        if n.port:
            key = (n.address, n.port)
            if key in seen:
                raise ResourceSpecError(
                    f"{where} repeats {n.address}:{n.port} of nodes[{seen[key]}]")
            seen[key] = i
    if not any("worker" in n.roles for n in nodes):
        raise ResourceSpecError("no node has the 'worker' role: nothing can compute. "
                                f"Received roles: {short_repr([list(n.roles) for n in nodes])}")
    chiefs = [i for i, n in enumerate(nodes) if n.chief]
    if len(chiefs) != 1:
        raise ResourceSpecError(f"exactly one node must be the chief. Received: chief on "
                                f"nodes {short_repr(chiefs)}")
    if "worker" not in nodes[chiefs[0]].roles:
        raise ResourceSpecError(
            f"the chief (node {chiefs[0]}, {nodes[chiefs[0]].address}) must have the "
            f"'worker' role. Received roles: {list(nodes[chiefs[0]].roles)}")
