"""An emulated cluster on one host: local task processes with capped links.

The implementation moved into the package (`autodist.bench.capped_links`) so that
the installed `autodist bench` works without this checkout; the benchmark
scripts here keep importing it under this name.

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

from autodist.bench.capped_links import (BASE_PORT, capped_spec, clear_lo,
                                  in_private_netns, shape_lo)

__all__ = ["BASE_PORT", "capped_spec", "clear_lo", "in_private_netns", "shape_lo"]
