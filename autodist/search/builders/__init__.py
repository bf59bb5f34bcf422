"""Named strategy presets: each `Builder().build(graph_item, spec) -> Strategy`.

Example:
    >>> s = autodist.builders.PSLoadBalancing().build(gi, spec)   # doctest: +SKIP
"""
from __future__ import annotations

from autodist.ir.deprecation import renamed_names
from autodist.ir.errors import InvalidArgumentError
from autodist.search.builders.all_reduce import AllReduce, PartitionedAR, RandomAxisPartitionAR
from autodist.search.builders.base import Builder
from autodist.search.builders.parallax import Parallax
from autodist.search.builders.ps import PS, PartitionedPS, PSLoadBalancing, UnevenPartitionedPS

# Every builder by name (the CLI and the search look them up here).
STRATEGY_BUILDERS: dict[str, type[Builder]] = {
    cls.name: cls for cls in (PS, PSLoadBalancing, PartitionedPS, UnevenPartitionedPS,
                              AllReduce, PartitionedAR, RandomAxisPartitionAR, Parallax)
}


def get(name: str) -> type[Builder]:
    """The builder class called `name`; ValueError lists the known names."""
    try:
        return STRATEGY_BUILDERS[name]
    except KeyError:
        raise InvalidArgumentError(f"unknown builder {name!r}; known: "
                                   f"{sorted(STRATEGY_BUILDERS)}") from None


__all__ = ["AllReduce", "Builder", "PS", "PSLoadBalancing", "Parallax", "PartitionedAR",
           "PartitionedPS", "RandomAxisPartitionAR", "STRATEGY_BUILDERS", "UnevenPartitionedPS",
           "get"]


# Old names, kept working with a DeprecationWarning that names the new one.
__getattr__ = renamed_names(__name__, globals(), {"BUILDERS": "STRATEGY_BUILDERS"})
