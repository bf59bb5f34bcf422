"""How well predictions order measured trials: the cost models' metrics.

Every metric compares predictions (LOWER = predicted FASTER, what any cost
model's `predict` returns) with measured step times, within each workload
only: strategies of different workloads are never compared. They need numpy
only. The input checks here are shared with the LightGBM cost model
(`autodist.search.cost_model`), which raises the same `CostModelError`.

Example:
    >>> pairwise_accuracy([1, 2, 3], [0.1, 0.2, 0.3], ["w"] * 3)
    1.0
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from autodist.ir.errors import AutodistError

# Rows per block when metrics compare all pairs (bounds memory to block x n).
_PAIR_BLOCK = 512
# Pairs whose measured times differ by less than this factor are within the noise.
SIGNIFICANT = 1.10


class CostModelError(AutodistError, ValueError):
    """Bad input to a cost model or its metrics, or a cost model file that cannot be used."""


# ------------------------------------------------------------------ metrics
def pairwise_accuracy(pred: Sequence[float] | np.ndarray, actual: Sequence[float] | np.ndarray,
                      workloads: Sequence[str]) -> float:
    """Fraction of within-workload pairs that `pred` orders as `actual` does.

    Only pairs of the same workload with different actual times count. A pair
    is correct when the faster trial (lower actual) has the lower prediction;
    a tie in the prediction counts as half correct.

    Args:
        pred: Predictions, lower = predicted faster (`CostModel.predict`).
        actual: Measured step times.
        workloads: The workload of each row.

    Returns:
        A value in [0, 1]; NaN when there is no pair to compare.
    """
    pred, actual, groups = _metric_inputs(pred, actual, workloads)
    correct = total = 0.0
    for idx in groups:
        c, t = _pair_counts(pred[idx], actual[idx])
        correct += c
        total += t
    return correct / total if total else float("nan")


def kendall_tau(pred: Sequence[float] | np.ndarray, actual: Sequence[float] | np.ndarray,
                workloads: Sequence[str]) -> float:
    """Kendall's tau-b of `pred` against `actual` within each workload, averaged over workloads.

    Each workload counts once (an unweighted mean). Workloads where tau-b is
    undefined (fewer than two rows, or all predictions or all times equal)
    are left out. +1 means `pred` orders every workload exactly like `actual`.

    Args:
        pred: Predictions, lower = predicted faster.
        actual: Measured step times.
        workloads: The workload of each row.

    Returns:
        A value in [-1, 1]; NaN when no workload has a defined tau-b.
    """
    pred, actual, groups = _metric_inputs(pred, actual, workloads)
    taus = [t for t in (_tau_b(pred[idx], actual[idx]) for idx in groups) if t is not None]
    return float(np.mean(taus)) if taus else float("nan")


def log_rmse(pred_seconds: Sequence[float] | np.ndarray,
             actual: Sequence[float] | np.ndarray) -> float:
    """Root mean squared error of log(predicted seconds) against log(measured seconds)."""
    pred_seconds = as_vector(pred_seconds, "pred_seconds")
    actual = as_vector(actual, "actual")
    check_same_length(("pred_seconds", pred_seconds), ("actual", actual))
    if (pred_seconds <= 0).any() or (actual <= 0).any():
        raise CostModelError("log_rmse needs positive times")
    return float(np.sqrt(np.mean((np.log(pred_seconds) - np.log(actual)) ** 2)))


def significant_pairwise_accuracy(pred: Sequence[float] | np.ndarray,
                                  actual: Sequence[float] | np.ndarray,
                                  workloads: Sequence[str],
                                  factor: float = SIGNIFICANT) -> float:
    """Pairwise accuracy over the within-workload pairs whose times differ by > `factor`.

    Pairs closer than `factor` lie within the noise of a few timed steps; a
    tie in the prediction counts as half correct. NaN when there is no pair.
    """
    pred, actual, groups = _metric_inputs(pred, actual, workloads)
    correct = total = 0.0
    for idx in groups:
        p, a = pred[idx], actual[idx]
        ratio = a[:, None] / a[None, :]
        valid = ratio > factor                       # i clearly slower than j
        total += valid.sum()
        correct += (valid & (p[:, None] > p[None, :])).sum() \
            + 0.5 * (valid & (p[:, None] == p[None, :])).sum()
    return float(correct / total) if total else float("nan")


def top1_slowdown(pred: Sequence[float] | np.ndarray, actual: Sequence[float] | np.ndarray,
                  workloads: Sequence[str]) -> float:
    """Geometric mean over workloads of (measured time of the top-ranked) / (best measured).

    1.0 means every workload's first pick is its fastest strategy; NaN with no rows.
    """
    pred, actual, groups = _metric_inputs(pred, actual, workloads)
    logs = [math.log(actual[idx][np.argmin(pred[idx])] / actual[idx].min()) for idx in groups]
    return float(math.exp(np.mean(logs))) if logs else float("nan")


def _metric_inputs(pred: Any, actual: Any,
                   workloads: Sequence[str]) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    pred = as_vector(pred, "pred")
    actual = as_vector(actual, "actual")
    names = as_names(workloads)
    check_same_length(("pred", pred), ("actual", actual), ("workloads", names))
    return pred, actual, group_indices(names)


def _pair_counts(pred: np.ndarray, actual: np.ndarray) -> tuple[float, float]:
    """(correct, compared) over the unordered pairs with different `actual`."""
    correct = ties = total = 0
    for start in range(0, len(pred), _PAIR_BLOCK):
        block = slice(start, start + _PAIR_BLOCK)
        da = np.sign(actual[block, None] - actual[None, :])
        dp = np.sign(pred[block, None] - pred[None, :])
        valid = da != 0
        total += int(valid.sum())
        correct += int((valid & (da == dp)).sum())
        ties += int((valid & (dp == 0)).sum())
    # Every unordered pair was seen twice, as (i, j) and (j, i).
    return (correct + 0.5 * ties) / 2, total / 2


def _tau_b(x: np.ndarray, y: np.ndarray) -> float | None:
    """Kendall's tau-b of two equal-length vectors; None when undefined."""
    s = nx = ny = 0
    for start in range(0, len(x), _PAIR_BLOCK):
        block = slice(start, start + _PAIR_BLOCK)
        dx = np.sign(x[block, None] - x[None, :])
        dy = np.sign(y[block, None] - y[None, :])
        s += int((dx * dy).sum())          # 2 (concordant - discordant)
        nx += int((dx != 0).sum())         # 2 (pairs - pairs tied in x)
        ny += int((dy != 0).sum())
    if nx == 0 or ny == 0:
        return None
    return float(s / math.sqrt(nx * ny))


# ------------------------------------------------------------ input checks
def as_vector(values: Any, name: str) -> np.ndarray:
    """`values` as a finite 1-D float array; `CostModelError` naming `name` otherwise."""
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise CostModelError(f"{name} must be numbers. Received: {e}") from e
    if array.ndim != 1:
        raise CostModelError(f"{name} must be 1-D. Received shape {array.shape}")
    bad = np.flatnonzero(~np.isfinite(array))
    if bad.size:
        raise CostModelError(f"{name} must be finite. Received {array[bad[0]]} at row {bad[0]} "
                             f"({bad.size} non-finite values)")
    return array


def as_matrix(values: Any, name: str = "X") -> np.ndarray:
    """`values` as a finite 2-D float array (rows, features)."""
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise CostModelError(f"{name} must be a numeric matrix. Received: {e}") from e
    if array.ndim != 2:
        raise CostModelError(f"{name} must be 2-D (rows, features). Received shape {array.shape}")
    bad = np.argwhere(~np.isfinite(array))
    if bad.size:
        row, col = bad[0]
        raise CostModelError(f"{name} must be finite. Received {array[row, col]} at row {row}, "
                             f"column {col} ({len(bad)} non-finite values)")
    return array


def as_names(workloads: Sequence[str]) -> list[str]:
    """One workload (or group) name per row, as a list of strings."""
    if isinstance(workloads, (str, bytes)):
        raise CostModelError("workloads must be a sequence with one workload per row, "
                             f"not a single string. Received: {workloads!r}")
    names = list(workloads)
    for i, name in enumerate(names):
        if not isinstance(name, str):
            raise CostModelError(f"workloads must be strings. Received {name!r} at row {i}")
    return names


def check_same_length(*named: tuple[str, Any]) -> None:
    """Raises unless every (name, value) pair has the same length."""
    lengths = {name: len(value) for name, value in named}
    if len(set(lengths.values())) > 1:
        raise CostModelError(f"inputs must have one entry per row. Received lengths {lengths}")


def group_indices(names: Sequence[str]) -> list[np.ndarray]:
    """Row indices of each distinct name, in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        groups.setdefault(name, []).append(i)
    return [np.asarray(rows, dtype=np.int64) for rows in groups.values()]
