"""Which cost model ships: held-out ranking quality, few-shot tuning, and the shipping rule.

`benchmarks/train_cost_model.py` evaluates, for each model of the trial data
set, LightGBM models trained on the other models' trials (a regressor of
step time, a ranker, and a residual model of the simulator's error) and the
analytic simulator alone (`leave_one_model_out`), and ships a learned model
only when `choose` says so: it must order held-out models about as well as
the simulator and pick first strategies no slower. `few_shot` evaluates the
tuner's real use: a pretrained model plus k measured trials of the new
workload.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from autodist.bench.trials import Rows
from autodist.search.cost_model import CostModel
from autodist.search.features import FEATURE_NAMES
from autodist.search.metrics import (CostModelError, group_indices, kendall_tau,
                                     pairwise_accuracy, significant_pairwise_accuracy,
                                     top1_slowdown)

LEARNED = ("regressor", "ranker", "residual")
PREDICTORS = LEARNED + ("simulator",)
# The baseline of `few_shot`: strategies measured in a random order.
RANDOM = "random"


def ranking_metrics(pred: np.ndarray, actual: np.ndarray,
                    workloads: Sequence[str]) -> dict[str, float]:
    """The report's metrics of one set of predictions: pairwise accuracy (all pairs
    and pairs more than 10% apart), Kendall's tau and the top-1 slowdown."""
    return {"pairwise": pairwise_accuracy(pred, actual, workloads),
            "pairwise_10pct": significant_pairwise_accuracy(pred, actual, workloads),
            "tau": kendall_tau(pred, actual, workloads),
            "top1": top1_slowdown(pred, actual, workloads)}


def train_without(rows: Rows, held_out: str, kind: str, feature_names: Sequence[str],
                  seed: int = 0) -> CostModel:
    """A LightGBM model of `kind` trained on every model's trials but `held_out`'s."""
    train = np.array(rows.models, dtype=object) != held_out
    return CostModel(kind, seed=seed).fit(rows.X[train], rows.times[train],
                                          [w for w, t in zip(rows.workloads, train) if t],
                                          feature_names)


def leave_one_model_out(rows: Rows, feature_names: Sequence[str], seed: int = 0
                        ) -> dict[str, dict[str, dict[str, float]]]:
    """Held-out metrics per model: {model: {predictor: metrics}}."""
    models = np.array(rows.models, dtype=object)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for model in dict.fromkeys(rows.models):
        test = models == model
        test_workloads = [w for w, t in zip(rows.workloads, test) if t]
        out[model] = {}
        for kind in LEARNED:
            fitted = train_without(rows, model, kind, feature_names, seed)
            out[model][kind] = ranking_metrics(fitted.predict(rows.X[test]), rows.times[test],
                                               test_workloads)
        out[model]["simulator"] = ranking_metrics(rows.simulator[test], rows.times[test],
                                                  test_workloads)
        out[model]["simulator"]["rows"] = float(test.sum())
        out[model]["simulator"]["workloads"] = float(len(set(test_workloads)))
    return out


def few_shot(rows: Rows, max_trials: int = 8, refit_min_trials: int = 2, seed: int = 0,
             random_seeds: int = 20) -> dict[str, dict[str, list[float]]]:
    """Slowdown of the tuner's pick after k = 0..max_trials measured trials of a new workload.

    For each model of the data set, each learned kind is trained on the other
    models' trials (rows built with `FEATURE_NAMES`); then, for each workload
    of the held-out model, it ranks the workload's measured strategies (its
    pool) and the strategies are "measured" one at a time, each the pool's
    unmeasured strategy the current model ranks first. After each trial,
    once `refit_min_trials` trials are in, the model is refitted as the
    tuner's `RefitCostModel` does: `pretrained.update(trials so far)` (a
    refit that cannot train keeps the current model). The pick is then as the
    tuner's: the best measured trial (k = 0: the model's first choice, so
    k = 0 and k = 1 agree). The simulator measures its own top k (it learns
    nothing below the tuner's 8 trials); "random" measures k strategies drawn
    at random (the mean over `random_seeds` draws).

    Args:
        rows: The data set.
        max_trials: The largest k.
        refit_min_trials: Trials needed before a refit (above `max_trials`:
            never, the pretrained model's top k).
        seed: Seeds LightGBM.
        random_seeds: Draws averaged for the random baseline.

    Returns:
        {predictor: {workload: [slowdown at k = 0 .. max_trials]}}, where a
        slowdown is the pick's measured time over the pool's best.
    """
    models = np.array(rows.models, dtype=object)
    names = np.array(rows.workloads, dtype=object)
    out: dict[str, dict[str, list[float]]] = {p: {} for p in PREDICTORS + (RANDOM,)}
    rng = np.random.default_rng(seed)
    for model in dict.fromkeys(rows.models):
        pretrained = {kind: train_without(rows, model, kind, FEATURE_NAMES, seed)
                      for kind in LEARNED}
        for idx in group_indices(list(names)):
            if models[idx[0]] != model:
                continue
            workload = names[idx[0]]
            times = rows.times[idx]
            for kind, base in pretrained.items():
                out[kind][workload] = _tune(times, lambda measured, b=base, idx=idx: _refit(
                    b, [rows.records[idx[i]] for i in measured], refit_min_trials, seed
                ).predict(rows.X[idx]), max_trials)
            sim = rows.simulator[idx]
            out["simulator"][workload] = _tune(times, lambda measured, sim=sim: sim, max_trials)
            draws = [_best_so_far(times, rng.permutation(len(idx))[:max(max_trials, 1)],
                                  max_trials) for _ in range(random_seeds)]
            out[RANDOM][workload] = [float(np.mean(col)) for col in zip(*draws)]
    return out


def _refit(base: CostModel, records: list, min_trials: int, seed: int) -> CostModel:
    """What `RefitCostModel` makes of `base` and the trials so far."""
    if len(records) < min_trials:
        return base
    try:
        return base.update(records, seed=seed)
    except CostModelError:
        return base          # e.g. a ranker's trials all of one time


def _tune(times: np.ndarray, predict, max_trials: int) -> list[float]:
    """Slowdowns at k = 0..max_trials measuring, each time, the predicted best unmeasured."""
    measured: list[int] = []
    for _ in range(min(max_trials, len(times))):
        pred = np.asarray(predict(measured), dtype=np.float64).copy()
        pred[measured] = np.inf
        measured.append(int(np.argmin(pred)))
    return _best_so_far(times, np.array(measured, dtype=np.int64), max_trials)


def _best_so_far(times: np.ndarray, order: np.ndarray, max_trials: int) -> list[float]:
    """[slowdown of the pick after k trials measured in `order`], k = 0..max_trials."""
    best = float(times.min())
    picked = [float(times[order[0]]) / best]                  # k = 0: the first choice
    for k in range(1, max_trials + 1):
        picked.append(float(times[order[:k]].min()) / best)    # beyond the pool: all of it
    return picked


def geometric_means(slowdowns: dict[str, list[float]]) -> list[float]:
    """Per k, the geometric mean of the slowdowns over workloads."""
    columns = np.array(list(slowdowns.values()), dtype=np.float64)
    return [float(math.exp(np.mean(np.log(col)))) for col in columns.T]


def mean_over_models(results: dict[str, dict[str, dict[str, float]]], predictor: str,
                     metric: str) -> float:
    """The mean of a metric over the held-out models where it is defined (NaN: nowhere)."""
    values = [r[predictor][metric] for r in results.values()
              if math.isfinite(r[predictor][metric])]
    return float(np.mean(values)) if values else float("nan")


def first_choices_by_shape(first: dict[str, dict[str, list[float]]],
                           shape_of: dict[str, str]) -> dict[str, dict[str, float]]:
    """Per cluster shape, each predictor's geometric-mean first-choice slowdown.

    Args:
        first: `few_shot`'s result (predictor -> workload -> slowdown per k).
        shape_of: Workload -> its cluster shape.
    """
    out: dict[str, dict[str, float]] = {}
    for shape in sorted(set(shape_of.values())):
        names = [w for w, s in shape_of.items() if s == shape]
        out[shape] = {p: geometric_means({w: by_workload[w] for w in names})[0]
                      for p, by_workload in first.items()
                      if all(w in by_workload for w in names)}
    return out


def choose(results: dict[str, dict[str, dict[str, float]]], margin: float,
           by_shape: dict[str, dict[str, float]] | None = None,
           shape_margin: float = 0.01) -> tuple[str, str]:
    """(the kind to ship or "simulator", why).

    A learned kind ships when its mean held-out pairwise accuracy is at
    least the simulator's minus `margin`, its mean top-1 slowdown is no
    worse than the simulator's, and (with `by_shape`: per cluster shape,
    each predictor's first-choice slowdown) on no cluster shape are its
    first choices slower than the simulator's by more than `shape_margin`:
    `optimize` without measurements trains the strategy ranked first, on
    whatever cluster the user has, so a better overall order that picks
    slower strategies, or a mean won on some cluster shapes and lost on
    others, does not help every user. Of the kinds that qualify, the one
    with the better pairwise accuracy ships.
    """
    sim = mean_over_models(results, "simulator", "pairwise")
    sim_top1 = mean_over_models(results, "simulator", "top1")
    scores = {k: (mean_over_models(results, k, "pairwise"), mean_over_models(results, k, "top1"))
              for k in LEARNED if all(k in r for r in results.values())}
    rule = (f"ship when at least the simulator's pairwise accuracy minus {margin:g} and a "
            "top-1 slowdown no worse than its")
    if by_shape:
        rule += (f", and on no cluster shape first choices more than {shape_margin:.0%} "
                 "slower than its")

    def lost_shapes(kind: str) -> list[str]:
        return [f"{shape} {v[kind]:.3f} vs {v['simulator']:.3f}"
                for shape, v in (by_shape or {}).items()
                if kind in v and "simulator" in v and
                v[kind] > v["simulator"] * (1 + shape_margin)]

    qualified = [k for k, (pairwise, top1) in scores.items()
                 if pairwise >= sim - margin and not top1 > sim_top1 and not lost_shapes(k)]
    if qualified:
        best = max(qualified, key=lambda k: scores[k][0])
        return best, (f"the {best} ranks held-out models with mean pairwise accuracy "
                      f"{scores[best][0]:.3f} and top-1 slowdown {scores[best][1]:.2f}, against "
                      f"the simulator's {sim:.3f} and {sim_top1:.2f} ({rule})")
    found = ", ".join(f"{k} {p:.3f} / {t:.2f}" for k, (p, t) in scores.items())
    lost = "; ".join(f"{k} loses on {', '.join(lost_shapes(k))}" for k in scores
                     if lost_shapes(k))
    return "simulator", (f"no learned model both orders held-out models about as well as "
                         f"the simulator and picks first strategies as fast (pairwise "
                         f"accuracy / top-1 slowdown: {found}; simulator "
                         f"{sim:.3f} / {sim_top1:.2f}"
                         f"{'; first choices by cluster shape: ' + lost if lost else ''}; "
                         f"{rule}): nothing shipped, the simulator ranks")
