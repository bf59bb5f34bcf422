"""Deprecated path of `autodist.launch.private_network` (a private network namespace).

Importing this module warns; every name resolves in `autodist.launch.private_network`.
"""
from __future__ import annotations

import warnings
from typing import Any

import autodist.launch.private_network as _moved

warnings.warn("autodist.launch.netns is deprecated; import autodist.launch.private_network",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
