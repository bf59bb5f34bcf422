"""Names capture gives variables: unique, in the model's order."""
from __future__ import annotations

from typing import Sequence


def keras_variable_names(model) -> tuple[list[str], list[str]]:
    """Names capture gives a Keras model's (trainable, non-trainable) variables, in order."""
    return (unique_names([v.path for v in model.trainable_variables]),
            unique_names([v.path for v in model.variables if not v.trainable]))


def unique_names(names: Sequence[str]) -> list[str]:
    """`names` with repeats suffixed `_1`, `_2`, ... (never clashing with another name)."""
    seen: dict[str, int] = {}
    out = []
    for n in names:
        if n in seen:
            seen[n] += 1
            candidate = f"{n}_{seen[n]}"
            while candidate in seen:
                seen[n] += 1
                candidate = f"{n}_{seen[n]}"
            n = candidate
        seen.setdefault(n, 0)
        out.append(n)
    return out
