"""Deprecated path of `autodist.bench.capped_links` (the emulated cluster's capped links).

Importing this module warns; every name resolves in `autodist.bench.capped_links`.
"""
from __future__ import annotations

import warnings
from typing import Any

import autodist.bench.capped_links as _moved

warnings.warn("autodist.bench.netns is deprecated; import autodist.bench.capped_links",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
