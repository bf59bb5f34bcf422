"""Deprecated path of `autodist.adapt.policy_interface` (Policy, Control, StepMetrics).

Importing this module warns; every name resolves in `autodist.adapt.policy_interface`.
"""
from __future__ import annotations

import warnings
from typing import Any

import autodist.adapt.policy_interface as _moved

warnings.warn("autodist.adapt.policy is deprecated; import autodist.adapt.policy_interface",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
