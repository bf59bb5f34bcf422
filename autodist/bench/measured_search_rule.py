"""The second shipping rule: which model orders the candidates a measured search measures.

`optimize(measure=True, trials=k)` and `autodist search --trials k` measure
k candidates and pick the fastest measured; what matters there is how good
the best of the first k candidates in a model's order is, not the first
choice alone. `choose_measured_search` ships a learned kind for that order
when, on held-out models (`autodist.bench.shipping.few_shot`), its k-trial
slowdown is no worse than the simulator's for every k of `trials` and better
on average; the ranking of unmeasured picks keeps its own rule
(`autodist.bench.shipping.choose`).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from autodist.bench.shipping import LEARNED, geometric_means

# The trial counts the rule compares (k = 0 and 1 are the first choice: the first rule's).
MEASURED_TRIALS = tuple(range(2, 9))


def k_trial_slowdowns(shots: dict[str, dict[str, list[float]]], kind: str,
                      workloads: Sequence[str] | None = None) -> list[float]:
    """A predictor's geometric-mean slowdown per k (over `workloads`, default all)."""
    by_workload = shots[kind]
    names = list(by_workload) if workloads is None else list(workloads)
    return geometric_means({w: by_workload[w] for w in names})


def by_shape(shots: dict[str, dict[str, list[float]]], shape_of: dict[str, str],
             trials: Sequence[int] = MEASURED_TRIALS) -> dict[str, dict[str, float]]:
    """Per cluster shape, each predictor's mean over `trials` of its slowdown per k."""
    out: dict[str, dict[str, float]] = {}
    for shape in sorted(set(shape_of.values())):
        names = [w for w, s in shape_of.items() if s == shape]
        out[shape] = {p: float(np.mean([k_trial_slowdowns(shots, p, names)[k] for k in trials]))
                      for p in shots if all(w in shots[p] for w in names)}
    return out


def choose_measured_search(shots: dict[str, dict[str, list[float]]],
                           trials: Sequence[int] = MEASURED_TRIALS,
                           kinds: Sequence[str] = LEARNED) -> tuple[str, str]:
    """(the kind to ship for the measured search's order, or "simulator"; why).

    A kind qualifies when its geometric-mean slowdown (`shots`: `few_shot`'s
    result, without refits) is no worse than the simulator's at every k of
    `trials` and its mean over them is lower; of those, the lowest mean ships.
    """
    sim = k_trial_slowdowns(shots, "simulator")
    sim_mean = float(np.mean([sim[k] for k in trials]))
    span = f"k = {min(trials)}..{max(trials)}"
    rule = (f"ship when its k-trial slowdown is no worse than the simulator's for every "
            f"{span} and better on average")
    found, qualified = [], {}
    for kind in kinds:
        if kind not in shots:
            continue
        mine = k_trial_slowdowns(shots, kind)
        mean = float(np.mean([mine[k] for k in trials]))
        worse = [k for k in trials if mine[k] > sim[k]]
        found.append(f"{kind} {mean:.3f}" + (f" (worse at k = {', '.join(map(str, worse))})"
                                             if worse else ""))
        if not worse and mean < sim_mean:
            qualified[kind] = (mean, mine)
    if qualified:
        best = min(qualified, key=lambda k: qualified[k][0])
        mean, mine = qualified[best]
        return best, (f"on held-out models the {best}'s pick after k measured trials is "
                      f"{mine[min(trials)]:.3f}..{mine[max(trials)]:.3f} of the best for "
                      f"{span} (mean {mean:.3f}) against the simulator's "
                      f"{sim[min(trials)]:.3f}..{sim[max(trials)]:.3f} (mean {sim_mean:.3f}); "
                      f"{rule}")
    return "simulator", (f"no learned model picks as well as the simulator at every {span} "
                         f"(mean slowdown over {span}: {', '.join(found)}; simulator "
                         f"{sim_mean:.3f}; {rule}): the simulator orders the measured "
                         "candidates")
