"""LightGBM model text, checked in Python before LightGBM's C++ parser sees any of it.

LightGBM trusts its model text: a tree whose child index points outside the
tree, a `tree_sizes` that disagrees with the trees, or a count of a
billion leaves makes `Booster(model_str=...)` abort, crash, hang or allocate
without bound in the caller's process. A cost-model file is user input (a
path passed to `optimize`), so `canonical_model_text` parses the text here,
checks every field a prediction reads (counts, indices, a tree that is a
tree, finite numbers), and writes the model out again in LightGBM's format
from the parsed values alone: LightGBM only ever parses text this module
wrote. Fields neither a prediction nor the feature importances read
(weights, counts, feature ranges, the parameters section) are dropped.

Only what autodist trains is accepted: one model output (`num_class=1`),
numerical splits (no categorical ones), constant leaves (no linear trees), a
regression or lambdarank objective.
"""
from __future__ import annotations

import math
from typing import Sequence

from autodist.search.metrics import CostModelError

# Bounds far above what autodist trains (hundreds of trees of tens of leaves),
# far below what would exhaust memory.
MAX_TREES = 100_000
MAX_LEAVES = 131_072
MAX_FEATURES = 100_000
MAX_TEXT_CHARS = 256 * 1024 * 1024
_OBJECTIVES = ("regression", "lambdarank")
# decision_type bits: 1 categorical (refused), 2 default left, 4 * missing type
# (0 none, 1 zero, 2 NaN).
_DECISION_TYPES = frozenset(default_left + 4 * missing
                            for default_left in (0, 2) for missing in (0, 1, 2))


def canonical_model_text(text: str, num_features: int, source: str = "the model text") -> str:
    """LightGBM model text rebuilt from `text`'s checked values.

    Args:
        text: A model as LightGBM writes it (`Booster.model_to_string`).
        num_features: The features the model must take.
        source: Names the text in errors.

    Returns:
        The same model, in LightGBM's format, holding only what a
        prediction reads: safe to hand to `lightgbm.Booster(model_str=...)`.

    Raises:
        CostModelError: naming the field and the value that is wrong.
    """
    if not isinstance(text, str) or len(text) > MAX_TEXT_CHARS:
        raise CostModelError(f"{source} is not LightGBM model text of at most "
                             f"{MAX_TEXT_CHARS} characters")
    if not 1 <= num_features <= MAX_FEATURES:
        raise CostModelError(f"{source}: a model of {num_features} features; 1 to "
                             f"{MAX_FEATURES} are accepted")
    head, trees = _sections(text, source)
    header = _key_values(head, source, "the header")
    _expect(header, "version", "v4", source)
    _expect(header, "num_class", "1", source)
    _expect(header, "num_tree_per_iteration", "1", source)
    _expect(header, "max_feature_idx", str(num_features - 1), source)
    objective = header.get("objective", "").split(" ")[0]
    if objective not in _OBJECTIVES:
        raise CostModelError(f"{source}: objective must be one of {list(_OBJECTIVES)}. "
                             f"Received: {_short(header.get('objective'))}")
    if len(trees) > MAX_TREES:
        raise CostModelError(f"{source} holds {len(trees)} trees; at most {MAX_TREES}")
    out = ["tree", "version=v4", "num_class=1", "num_tree_per_iteration=1", "label_index=0",
           f"max_feature_idx={num_features - 1}", f"objective={objective}",
           "feature_names=" + " ".join(f"f{i}" for i in range(num_features)),
           "feature_infos=" + " ".join(["none"] * num_features), ""]
    for index, (tree_id, lines) in enumerate(trees):
        if tree_id != f"Tree={index}":
            raise CostModelError(f"{source}: tree {index} is headed {_short(tree_id)}, not "
                                 f"'Tree={index}'")
        out += _canonical_tree(_key_values(lines, source, f"tree {index}"), index,
                               num_features, source)
    out += ["end of trees", "", "pandas_categorical:null", ""]
    return "\n".join(out)


def _sections(text: str, source: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The header's lines and each tree's (heading, lines), up to 'end of trees'."""
    lines = text.split("\n")
    if not lines or lines[0].strip() != "tree":
        raise CostModelError(f"{source} is not LightGBM model text (no 'tree' first line)")
    try:
        end = next(i for i, line in enumerate(lines) if line.strip() == "end of trees")
    except StopIteration:
        raise CostModelError(f"{source} has no 'end of trees' line") from None
    head: list[str] = []
    trees: list[tuple[str, list[str]]] = []
    for line in lines[1:end]:
        line = line.strip()
        if not line:
            continue
        if line.startswith("Tree="):
            trees.append((line, []))
            if len(trees) > MAX_TREES:
                break
        elif trees:
            trees[-1][1].append(line)
        else:
            head.append(line)
    if not trees:
        raise CostModelError(f"{source} holds no trees")
    return head, trees


def _key_values(lines: Sequence[str], source: str, where: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for line in lines:
        key, sep, value = line.partition("=")
        if not sep:
            raise CostModelError(f"{source}: {where} has a line that is not key=value: "
                                 f"{_short(line)}")
        if key in values:
            raise CostModelError(f"{source}: {where} sets {_short(key)} twice")
        values[key] = value
    return values


def _expect(values: dict[str, str], key: str, want: str, source: str) -> None:
    if values.get(key) != want:
        raise CostModelError(f"{source}: {key} must be {want}. "
                             f"Received: {_short(values.get(key))}")


def _canonical_tree(values: dict[str, str], index: int, num_features: int,
                    source: str) -> list[str]:
    where = f"{source}: tree {index}"
    leaves = _ints(values, "num_leaves", where, expected=1)[0]
    if not 1 <= leaves <= MAX_LEAVES:
        raise CostModelError(f"{where}: num_leaves must be in [1, {MAX_LEAVES}]. "
                             f"Received: {leaves}")
    if _ints(values, "num_cat", where, expected=1)[0] != 0:
        raise CostModelError(f"{where} has categorical splits (num_cat), which autodist's "
                             "cost models never hold")
    if values.get("is_linear", "0") != "0":
        raise CostModelError(f"{where} is a linear tree, which autodist's cost models never "
                             "hold")
    leaf_values = _floats(values, "leaf_value", where, expected=leaves)
    shrinkage = _floats(values, "shrinkage", where, expected=1) if "shrinkage" in values \
        else [1.0]
    internal = leaves - 1
    lines = [f"Tree={index}", f"num_leaves={leaves}", "num_cat=0"]
    if internal:
        features = _ints(values, "split_feature", where, expected=internal)
        bad = [f for f in features if not 0 <= f < num_features]
        if bad:
            raise CostModelError(f"{where}: split_feature must be in [0, {num_features}). "
                                 f"Received: {bad[0]}")
        thresholds = _floats(values, "threshold", where, expected=internal)
        decisions = _ints(values, "decision_type", where, expected=internal)
        bad = [d for d in decisions if d not in _DECISION_TYPES]
        if bad:
            raise CostModelError(f"{where}: decision_type {bad[0]} is not a numerical "
                                 f"split's (one of {sorted(_DECISION_TYPES)})")
        left = _ints(values, "left_child", where, expected=internal)
        right = _ints(values, "right_child", where, expected=internal)
        _check_tree(left, right, leaves, where)
        # What `feature_importance("gain")` sums; 0 where the text has none.
        gains = _floats(values, "split_gain", where, expected=internal) \
            if "split_gain" in values else [0.0] * internal
        lines += [_join("split_feature", features), _join("split_gain", gains),
                  _join("threshold", thresholds),
                  _join("decision_type", decisions), _join("left_child", left),
                  _join("right_child", right)]
    lines += [_join("leaf_value", leaf_values), "is_linear=0",
              _join("shrinkage", shrinkage), ""]
    return lines


def _check_tree(left: list[int], right: list[int], leaves: int, where: str) -> None:
    """Every child index names a node of the tree, and every node but the root, and
    every leaf, is reached exactly once from the root (no cycles, nothing shared)."""
    internal = len(left)
    seen_nodes = [False] * internal
    seen_leaves = [False] * leaves
    seen_nodes[0] = True
    stack = [0]
    while stack:
        node = stack.pop()
        for child in (left[node], right[node]):
            if child >= 0:
                if child >= internal or seen_nodes[child]:
                    raise CostModelError(f"{where} is not a tree: node {node} has child "
                                         f"{child} (of {internal} internal nodes), reached "
                                         "twice or out of range")
                seen_nodes[child] = True
                stack.append(child)
            else:
                leaf = ~child
                if leaf >= leaves or seen_leaves[leaf]:
                    raise CostModelError(f"{where} is not a tree: node {node} has leaf "
                                         f"{leaf} (of {leaves}), reached twice or out of range")
                seen_leaves[leaf] = True
    if not all(seen_nodes) or not all(seen_leaves):
        raise CostModelError(f"{where} is not a tree: some nodes or leaves are not reached "
                             "from the root")


def _fields(values: dict[str, str], key: str, where: str, expected: int) -> list[str]:
    if key not in values:
        raise CostModelError(f"{where} has no {key}")
    text = values[key]
    # A bound before splitting: no field of a valid tree is longer than this.
    if len(text) > 32 * (expected + 1):
        raise CostModelError(f"{where}: {key} is longer than {expected} numbers")
    parts = text.split(" ") if text else []
    if len(parts) != expected:
        raise CostModelError(f"{where}: {key} must hold {expected} values. "
                             f"Received {len(parts)}")
    return parts


def _ints(values: dict[str, str], key: str, where: str, expected: int) -> list[int]:
    out = []
    for part in _fields(values, key, where, expected):
        try:
            number = int(part)
        except ValueError:
            raise CostModelError(f"{where}: {key} must hold integers. "
                                 f"Received: {_short(part)}") from None
        if abs(number) > 2 ** 31 - 1:
            raise CostModelError(f"{where}: {key} holds {_short(part)}, out of int32")
        out.append(number)
    return out


def _floats(values: dict[str, str], key: str, where: str, expected: int) -> list[float]:
    out = []
    for part in _fields(values, key, where, expected):
        try:
            number = float(part)
        except ValueError:
            raise CostModelError(f"{where}: {key} must hold numbers. "
                                 f"Received: {_short(part)}") from None
        if not math.isfinite(number) or abs(number) > 1e300:
            raise CostModelError(f"{where}: {key} must hold finite numbers. "
                                 f"Received: {_short(part)}")
        out.append(number)
    return out


def _join(key: str, numbers: Sequence[int | float]) -> str:
    return f"{key}=" + " ".join(repr(n) if isinstance(n, float) else str(n) for n in numbers)


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
