"""Fits the simulator's fixed costs to step times measured on a cluster.

The simulator's compute, bandwidth and update terms come from rates (FLOP/s,
bytes/s); what a step costs besides them is a count of events times a fixed
cost each, and the counts are what the simulator already knows for every
strategy:

* a collective's hops (`Prediction.parts["collective_hops"]`) × α of a hop,
* the busiest PS node's messages, plus the synchronous PS token round
  (2 messages) × α of a PS message,
* the extra session run of a step that mixes PS and all-reduce × its cost,
* the cluster's tasks × a fixed cost per task per step,
* the busiest task's bytes × the CPU time per byte it moves.

Given a few probe strategies measured on the cluster (chosen so that these
counts differ: one fused group against one group per variable, PS against
all-reduce, mixed against not, a model with a megabyte-sized layer against
one without), the costs are the non-negative least-squares fit of the
measured step times minus the rate terms, each probe weighted by its
measured time (relative errors). With five unknowns the non-negative fit
enumerates the subsets of free costs (32) and keeps the best; a cost a probe
set cannot separate keeps its base value.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence

import numpy as np

from autodist.ir.errors import InvalidArgumentError
from autodist.ir.strategy import Strategy
from autodist.search.simulator import Calibration, Simulator

# The fitted fixed costs, as Calibration fields.
FITTED = ("task_overhead_s", "collective_latency_s", "latency_s", "run_overhead_s",
          "byte_cost_s")


@dataclasses.dataclass(frozen=True)
class ProbeStep:
    """One probe strategy's measured step and the simulator's counts for it.

    Attributes:
        name: What the probe is (for reports).
        measured_s: The median measured step time.
        rate_s: The simulator's compute + bandwidth + update time (rates only).
        counts: Events per step, one per `FITTED` cost: tasks, collective
            hops, PS messages (with the token round), extra session runs,
            the busiest task's bytes.
    """

    name: str
    measured_s: float
    rate_s: float
    counts: tuple[float, float, float, float, float]


def probe_step(simulator: Simulator, strategy: Strategy, name: str,
               measured_s: float) -> ProbeStep:
    """The counts of `strategy` under `simulator`, with its measured step time."""
    if not (math.isfinite(measured_s) and measured_s > 0):
        raise InvalidArgumentError(f"probe {name!r}: measured step time must be positive "
                                   f"seconds. Received: {measured_s!r}")
    parts = simulator.predict_strategy(strategy).parts
    value = lambda key: float(parts[key][0])  # noqa: E731
    token_round = 2.0 if value("sync_s") > 0 else 0.0
    return ProbeStep(
        name=name, measured_s=float(measured_s),
        rate_s=value("compute_s") + value("bandwidth_s") + value("update_s"),
        counts=(float(simulator.num_tasks), value("collective_hops"),
                value("ps_messages_max") + token_round, value("extra_runs"),
                value("max_node_bytes")))


def fit_fixed_costs(base: Calibration, probes: Sequence[ProbeStep],
                    source: str = "fitted") -> tuple[Calibration, dict[str, float]]:
    """`base` with its fixed costs fitted to `probes`.

    Args:
        base: The rates (and the fixed costs kept where the probes cannot
            tell them apart).
        probes: Measured probe steps (at least 1; one fits the cost per task only).
        source: `Calibration.source` of the result.

    Returns:
        The calibration, and the fit's median |log(measured / predicted)|
        over the probes under "median_abs_log_error" with the base's under
        "base_median_abs_log_error".

    Raises:
        InvalidArgumentError: No probes.
    """
    if not probes:
        raise InvalidArgumentError("fitting fixed costs needs at least 1 probe step. "
                                   "Received: none")
    counts = np.array([p.counts for p in probes], dtype=np.float64)
    measured = np.array([p.measured_s for p in probes])
    rates = np.array([p.rate_s for p in probes])
    base_costs = np.array([base.task_overhead_s, base.hop_latency_s, base.latency_s,
                           base.run_overhead_s, base.byte_cost_s])
    # Costs whose count is the same in every probe are confounded with the
    # others' intercept unless it is the only constant one (the tasks).
    varies = np.ptp(counts, axis=0) > 0
    free = [j for j in range(len(FITTED)) if varies[j] or j == 0]
    fixed = [j for j in range(len(FITTED)) if j not in free]
    target = measured - rates - counts[:, fixed] @ base_costs[fixed]
    weight = 1.0 / measured
    costs = base_costs.copy()
    # The empty subset: every free cost 0 (measured no slower than the rates).
    best = (float(np.sum((target * weight) ** 2)), (), np.zeros(0))
    for size in range(len(free), 0, -1):
        for subset in itertools.combinations(free, size):
            columns = counts[:, subset] * weight[:, None]
            solution, *_ = np.linalg.lstsq(columns, target * weight, rcond=None)
            if (solution < 0).any():
                continue
            residual = float(np.sum((columns @ solution - target * weight) ** 2))
            if residual < best[0] - 1e-15:
                best = (residual, subset, solution)
    costs[free] = 0.0
    costs[list(best[1])] = best[2]
    fitted = dataclasses.replace(
        base, task_overhead_s=float(costs[0]), collective_latency_s=float(costs[1]),
        latency_s=float(costs[2]), run_overhead_s=float(costs[3]),
        byte_cost_s=float(costs[4]), source=source)
    predicted = rates + counts @ costs
    base_predicted = rates + counts @ base_costs
    return fitted, {
        "median_abs_log_error": float(np.median(np.abs(np.log(measured / predicted)))),
        "base_median_abs_log_error": float(np.median(np.abs(np.log(measured
                                                                   / base_predicted)))),
    }
