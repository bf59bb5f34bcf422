"""autodist: automatic distribution of TensorFlow training.

Importing the package does no work: TensorFlow is loaded only when a name that
needs it (``capture``) is first used.

Example:
    >>> import autodist
    >>> spec = autodist.ResourceSpec.local(workers=2, ps=1)
    >>> gi = autodist.capture(model)                           # doctest: +SKIP
    >>> s = autodist.builders.PSLoadBalancing().build(gi, spec)  # doctest: +SKIP
"""
from __future__ import annotations

import importlib
from typing import Any

from autodist.ir.errors import AutodistError, CaptureError, ResourceSpecError, StrategyError
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy

__version__ = "0.1.0"  # the one version source: setup.py parses this line

# Names resolved on first use, so that `import autodist` stays cheap.
_LAZY = {
    "capture": ("autodist.ir.capture", "capture"),
    "builders": ("autodist.search.builders", None),
    "distribute": ("autodist.api", "distribute"),
    "optimize": ("autodist.api", "optimize"),
    "Plan": ("autodist.api", "Plan"),
    "models": ("autodist.models", None),
    "restore_keras_weights": ("autodist.runtime.checkpoint", "restore_keras_weights"),
    "load_checkpoint": ("autodist.runtime.checkpoint", "load"),
    "policies": ("autodist.adapt.builtin_policies", None),
    "autoscaler": ("autodist.adapt.autoscaler", None),
    "ShardedDataset": ("autodist.runtime.sharded_input", "ShardedDataset"),
    "InputShard": ("autodist.runtime.sharded_input", "InputShard"),
}

__all__ = ["AutodistError", "CaptureError", "GraphItem", "InputShard", "ResourceSpec",
           "ResourceSpecError", "Plan", "ShardedDataset", "Strategy", "StrategyError",
           "autoscaler", "builders", "capture",
           "distribute", "load_checkpoint", "models", "optimize", "policies",
           "restore_keras_weights"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'autodist' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    return module if attr is None else getattr(module, attr)


def __dir__() -> list[str]:
    return sorted(__all__)
