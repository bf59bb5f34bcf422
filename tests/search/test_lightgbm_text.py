"""LightGBM model text is checked and rebuilt before LightGBM parses it.

LightGBM's parser trusts its input: these texts abort, crash or hang the
process when given to `lightgbm.Booster(model_str=...)` directly (the fuzz
target `cost_model` edits saved models' text and recomputes their checksum;
without the rebuild about one case in five crashed). Each is refused here
with an error that names the tree, the field and the value; a valid model
rebuilt predicts exactly as the original.
"""
from __future__ import annotations

import numpy as np
import pytest

from autodist.search.lightgbm_text import canonical_model_text
from autodist.search.metrics import CostModelError

lgb = pytest.importorskip("lightgbm")


@pytest.fixture(scope="module")
def booster():
    rng = np.random.default_rng(0)
    X = rng.uniform(size=(300, 4))
    y = X[:, 0] * 2 + np.sin(6 * X[:, 1]) + 0.1 * X[:, 3]
    return lgb.train({"objective": "regression", "num_leaves": 6, "verbose": -1,
                      "num_threads": 1, "seed": 0}, lgb.Dataset(X, y), num_boost_round=12)


def _edit(text: str, tree: int, key: str, value: str) -> str:
    lines = text.split("\n")
    start = lines.index(f"Tree={tree}")
    i = next(i for i in range(start, len(lines)) if lines[i].startswith(key + "="))
    lines[i] = f"{key}={value}"
    return "\n".join(lines)


def test_a_rebuilt_model_predicts_and_ranks_features_as_the_original(booster):
    text = canonical_model_text(booster.model_to_string(), 4)
    rebuilt = lgb.Booster(model_str=text)
    X = np.random.default_rng(1).uniform(size=(200, 4))
    X[:5, 1] = np.nan   # the missing-value branches too
    np.testing.assert_array_equal(rebuilt.predict(X), booster.predict(X))
    for kind in ("split", "gain"):
        np.testing.assert_allclose(rebuilt.feature_importance(kind),
                                   booster.feature_importance(kind), rtol=1e-12)
    assert canonical_model_text(text, 4) == text   # rebuilding is idempotent


def _field(text: str, tree: int, key: str) -> list[str]:
    lines = text.split("\n")
    start = lines.index(f"Tree={tree}")
    line = next(line for line in lines[start:] if line.startswith(key + "="))
    return line.partition("=")[2].split(" ")


# (field of tree 0, its values -> edited values, the error)
@pytest.mark.parametrize("key,edit,message", [
    ("left_child", lambda v: ["7"] + v[1:], r"tree 0 is not a tree: node 0 has child 7"),
    ("left_child", lambda v: ["0"] + v[1:], r"tree 0 is not a tree: node 0 has child 0"),
    ("left_child", lambda v: v[:-1] + ["-90"], r"has leaf 89 \(of 6\)"),
    ("num_leaves", lambda v: ["1000000"], r"num_leaves must be in \[1, 131072\]"),
    ("num_leaves", lambda v: ["5"], r"leaf_value must hold 5 values. Received 6"),
    ("split_feature", lambda v: v[:-1] + ["9"], r"split_feature must be in \[0, 4\). Received: 9"),
    ("decision_type", lambda v: ["1"] + v[1:], r"decision_type 1 is not a numerical split's"),
    ("threshold", lambda v: ["nan"] + v[1:],
     r"threshold must hold finite numbers. Received: 'nan'"),
    ("leaf_value", lambda v: v[:-1] + ["x"], r"leaf_value must hold numbers. Received: 'x'"),
    ("leaf_value", lambda v: v * 1000, r"leaf_value is longer than 6 numbers"),
    ("num_cat", lambda v: ["1"], r"categorical splits"),
    ("is_linear", lambda v: ["1"], r"linear tree"),
])
def test_a_damaged_tree_is_refused_naming_the_field(booster, key, edit, message):
    text = booster.model_to_string()
    damaged = _edit(text, 0, key, " ".join(edit(_field(text, 0, key))))
    with pytest.raises(CostModelError, match=message):
        canonical_model_text(damaged, 4, source="m")


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.replace("max_feature_idx=3", "max_feature_idx=9"),
     "max_feature_idx must be 3. Received: '9'"),
    (lambda t: t.replace("num_class=1", "num_class=3"), "num_class must be 1"),
    (lambda t: t.replace("objective=regression", "objective=multiclass"),
     "objective must be one of"),
    (lambda t: t.replace("end of trees", "end"), "no 'end of trees' line"),
    (lambda t: t.replace("Tree=1\n", "Tree=7\n"), "tree 1 is headed 'Tree=7'"),
    (lambda t: t.replace("Tree=1\n", "Tree=1\nnum_leaves=3\n"), "tree 1 sets 'num_leaves' twice"),
    (lambda t: "junk\n" + t, "no 'tree' first line"),
    (lambda t: t.replace("shrinkage=1\n", "shrinkage=1e999\n", 1), "shrinkage must hold finite"),
])
def test_a_damaged_header_or_layout_is_refused(booster, edit, message):
    with pytest.raises(CostModelError, match=message):
        canonical_model_text(edit(booster.model_to_string()), 4)


def test_wrong_tree_sizes_and_extra_sections_never_reach_lightgbm(booster):
    # tree_sizes that disagree with the trees crash LightGBM's parser; the rebuilt
    # text has no tree_sizes, no parameters and no feature ranges at all.
    text = booster.model_to_string().replace("tree_sizes=", "tree_sizes=1 ")
    rebuilt = canonical_model_text(text, 4)
    assert "tree_sizes" not in rebuilt and "parameters" not in rebuilt
    X = np.random.default_rng(2).uniform(size=(20, 4))
    np.testing.assert_array_equal(lgb.Booster(model_str=rebuilt).predict(X), booster.predict(X))
