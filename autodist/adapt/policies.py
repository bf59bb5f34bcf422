"""Deprecated path of `autodist.adapt.builtin_policies` (the built-in policies).

Importing this module warns; every name resolves in `autodist.adapt.builtin_policies`.
"""
from __future__ import annotations

import warnings
from typing import Any

import autodist.adapt.builtin_policies as _moved

warnings.warn("autodist.adapt.policies is deprecated; import autodist.adapt.builtin_policies",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
