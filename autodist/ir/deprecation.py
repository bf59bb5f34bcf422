"""Old module-level names kept working after a rename, with a DeprecationWarning."""
from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping


def renamed_names(module: str, namespace: Mapping[str, Any],
                  renames: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` that resolves each old name in `renames` to its new one.

    Example:
        >>> __getattr__ = renamed_names(__name__, globals(), {"Trial": "ScalingTrial"})

    Args:
        module: The module's `__name__` (for the messages).
        namespace: The module's `globals()`, where the new names live.
        renames: Old name -> new name.

    Returns:
        The `__getattr__`: an old name warns (naming the new one) and returns the
        new name's value; any other name raises AttributeError, as Python does.
    """
    def __getattr__(name: str) -> Any:
        if name in renames:
            new = renames[name]
            warnings.warn(f"{module}.{name} is deprecated; use {module}.{new}",
                          DeprecationWarning, stacklevel=2)
            return namespace[new]
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
