"""Deprecated path of `autodist.runtime.local_runner` (the local cluster's LocalRunner).

Importing this module warns; every name resolves in `autodist.runtime.local_runner`.
"""
from __future__ import annotations

import warnings
from typing import Any

import autodist.runtime.local_runner as _moved

warnings.warn("autodist.runtime.runner is deprecated; import autodist.runtime.local_runner",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
