"""Which cost model ships: leave-one-model-out ranking quality and the shipping rule.

`benchmarks/train_cost_model.py` evaluates, for each model of the trial data
set, a LightGBM regressor and ranker trained on the other models' trials and
the analytic simulator alone (`leave_one_model_out`), and ships a learned
model only when `choose` says so: it must order held-out models about as
well as the simulator and pick first strategies no slower.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from autodist.bench.trials import Rows
from autodist.search.cost_model import CostModel
from autodist.search.metrics import (kendall_tau, pairwise_accuracy,
                                     significant_pairwise_accuracy, top1_slowdown)

PREDICTORS = ("regressor", "ranker", "simulator")


def ranking_metrics(pred: np.ndarray, actual: np.ndarray,
                    workloads: Sequence[str]) -> dict[str, float]:
    """The report's metrics of one set of predictions: pairwise accuracy (all pairs
    and pairs more than 10% apart), Kendall's tau and the top-1 slowdown."""
    return {"pairwise": pairwise_accuracy(pred, actual, workloads),
            "pairwise_10pct": significant_pairwise_accuracy(pred, actual, workloads),
            "tau": kendall_tau(pred, actual, workloads),
            "top1": top1_slowdown(pred, actual, workloads)}


def leave_one_model_out(rows: Rows, feature_names: Sequence[str], seed: int = 0
                        ) -> dict[str, dict[str, dict[str, float]]]:
    """Held-out metrics per model: {model: {predictor: metrics}}."""
    models = np.array(rows.models, dtype=object)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for model in dict.fromkeys(rows.models):
        test, train = models == model, models != model
        train_workloads = [w for w, t in zip(rows.workloads, train) if t]
        test_workloads = [w for w, t in zip(rows.workloads, test) if t]
        out[model] = {}
        for kind in ("regressor", "ranker"):
            fitted = CostModel(kind, seed=seed).fit(rows.X[train], rows.times[train],
                                                    train_workloads, feature_names)
            out[model][kind] = ranking_metrics(fitted.predict(rows.X[test]), rows.times[test],
                                               test_workloads)
        out[model]["simulator"] = ranking_metrics(rows.simulator[test], rows.times[test],
                                                  test_workloads)
        out[model]["simulator"]["rows"] = float(test.sum())
        out[model]["simulator"]["workloads"] = float(len(set(test_workloads)))
    return out


def mean_over_models(results: dict[str, dict[str, dict[str, float]]], predictor: str,
                     metric: str) -> float:
    """The mean of a metric over the held-out models where it is defined (NaN: nowhere)."""
    values = [r[predictor][metric] for r in results.values()
              if math.isfinite(r[predictor][metric])]
    return float(np.mean(values)) if values else float("nan")


def choose(results: dict[str, dict[str, dict[str, float]]], margin: float) -> tuple[str, str]:
    """(the kind to ship or "simulator", why).

    A learned kind ships when its mean held-out pairwise accuracy is at
    least the simulator's minus `margin` and its mean top-1 slowdown is no
    worse than the simulator's: `optimize` without measurements trains the
    strategy ranked first, so a better overall order that picks slower
    strategies does not help users. Of the kinds that qualify, the one with
    the better pairwise accuracy ships.
    """
    sim = mean_over_models(results, "simulator", "pairwise")
    sim_top1 = mean_over_models(results, "simulator", "top1")
    scores = {k: (mean_over_models(results, k, "pairwise"), mean_over_models(results, k, "top1"))
              for k in ("regressor", "ranker")}
    rule = (f"ship when at least the simulator's pairwise accuracy minus {margin:g} and a "
            "top-1 slowdown no worse than its")
    qualified = [k for k, (pairwise, top1) in scores.items()
                 if pairwise >= sim - margin and not top1 > sim_top1]
    if qualified:
        best = max(qualified, key=lambda k: scores[k][0])
        return best, (f"the {best} ranks held-out models with mean pairwise accuracy "
                      f"{scores[best][0]:.3f} and top-1 slowdown {scores[best][1]:.2f}, against "
                      f"the simulator's {sim:.3f} and {sim_top1:.2f} ({rule})")
    found = ", ".join(f"{k} {p:.3f} / {t:.2f}" for k, (p, t) in scores.items())
    return "simulator", (f"no learned model ranks held-out models about as well as the "
                         f"simulator (pairwise accuracy / top-1 slowdown: {found}; simulator "
                         f"{sim:.3f} / {sim_top1:.2f}; {rule}): nothing shipped, the "
                         "simulator ranks")
