"""Deprecated path of `autodist.search.measurement` (the search's Runner role).

Importing this module warns; every name resolves in `autodist.search.measurement`.
"""
from __future__ import annotations

import warnings
from typing import Any

import autodist.search.measurement as _moved

warnings.warn("autodist.search.runner is deprecated; import autodist.search.measurement",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
