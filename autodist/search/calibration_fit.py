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
* the busiest task's bytes × the CPU time per byte it moves,
* a replica's ops (`Simulator.op_runs`) × the cost of running one op in a
  worker's step (well above the in-process micro-benchmark's on a host whose
  cores the cluster's tasks share).

Given a few probe strategies measured on the cluster (chosen so that these
counts differ: one, two and three fused groups, PS against all-reduce, mixed
against not, a model with a megabyte-sized layer and one with a thousand
cheap ops against one without), the costs are the non-negative
least-squares fit of the measured step times minus the rate terms, each
probe weighted by its measured time (relative errors). With six unknowns
the non-negative fit enumerates the subsets of free costs (64) and keeps the
best; a cost a probe set cannot separate keeps its base value. A message
(a collective hop, a PS message) is never free: where the best fit sets its
cost to zero, the probes could not tell it from the others (with 6-9 tasks
sharing 2 cores the cost per task absorbed the PS messages, and strategies
holding tables on PS were then predicted cheaper than measured), so it keeps
its base value and the other costs are fitted again around it.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence

import numpy as np

from autodist.ir.errors import InvalidArgumentError
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.search.builders import AllReduce
from autodist.search.simulator import Calibration, Simulator

# The fitted fixed costs, as Calibration fields.
FITTED = ("task_overhead_s", "collective_latency_s", "latency_s", "run_overhead_s",
          "byte_cost_s", "op_overhead_s")
# The costs of a message (their indices in FITTED), never fitted to zero (below _ZERO_S).
_MESSAGES = (FITTED.index("collective_latency_s"), FITTED.index("latency_s"))
_ZERO_S = 1e-9


@dataclasses.dataclass(frozen=True)
class ProbeStep:
    """One probe strategy's measured step and the simulator's counts for it.

    Attributes:
        name: What the probe is (for reports).
        measured_s: The median measured step time.
        rate_s: The simulator's compute (without its ops' fixed costs) +
            bandwidth + update time (rates only).
        counts: Events per step, one per `FITTED` cost: tasks, collective
            hops, PS messages (with the token round), extra session runs,
            the busiest task's bytes, a replica's op runs.
    """

    name: str
    measured_s: float
    rate_s: float
    counts: tuple[float, float, float, float, float, float]


def all_reduce_in_groups(graph_item: GraphItem, spec: ResourceSpec, groups: int) -> Strategy:
    """All-reduce with the dense gradients in `groups` fused groups of consecutive ones.

    A probe strategy: its collectives number as in the trial workloads'
    strategies (one to three groups), so that they overlap each other no
    more than those do, and the hop cost is the difference between such
    probes. Sparse gradients are all-gathered (one group each, after the dense ones).

    Raises:
        InvalidArgumentError: `groups` is below 1 or above the dense variables.
    """
    strategy = AllReduce(group_bytes=1 << 30).build(graph_item, spec)
    dense = sorted((v.gradient_order, v.name) for v in graph_item.variables
                   if not v.sparse_gradient)
    if not 1 <= groups <= max(1, len(dense)):
        raise InvalidArgumentError(f"groups must be in [1, {max(1, len(dense))}] (the dense "
                                   f"variables). Received: {groups!r}")
    group_of = {name: i * groups // len(dense) for i, (_, name) in enumerate(dense)}
    next_sparse = groups
    for config in strategy.proto.variables:
        for shard in config.shards:
            if config.var_name in group_of:
                shard.all_reduce.group = group_of[config.var_name]
            else:
                shard.all_reduce.group = next_sparse
                next_sparse += 1
    strategy.validate(graph_item, spec)
    return strategy


def probe_step(simulator: Simulator, strategy: Strategy, name: str,
               measured_s: float) -> ProbeStep:
    """The counts of `strategy` under `simulator`, with its measured step time."""
    if not (math.isfinite(measured_s) and measured_s > 0):
        raise InvalidArgumentError(f"probe {name!r}: measured step time must be positive "
                                   f"seconds. Received: {measured_s!r}")
    parts = simulator.predict_strategy(strategy).parts
    value = lambda key: float(parts[key][0])  # noqa: E731
    token_round = 2.0 if value("sync_s") > 0 else 0.0
    ops_s = simulator.calibration.op_overhead_s * simulator.op_runs
    return ProbeStep(
        name=name, measured_s=float(measured_s),
        rate_s=value("compute_s") - ops_s + value("bandwidth_s") + value("update_s"),
        counts=(float(simulator.num_tasks), value("collective_hops"),
                value("ps_messages_max") + token_round, value("extra_runs"),
                value("max_node_bytes"), float(simulator.op_runs)))


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
                           base.run_overhead_s, base.byte_cost_s, base.op_overhead_s])
    # Costs whose count is the same in every probe are confounded with the
    # others' intercept unless it is the only constant one (the tasks).
    varies = np.ptp(counts, axis=0) > 0
    free = [j for j in range(len(FITTED)) if varies[j] or j == 0]
    costs = _nonnegative_fit(counts, measured, rates, base_costs, free)
    unseparated = [j for j in _MESSAGES if j in free and costs[j] < _ZERO_S]
    if unseparated:
        free = [j for j in free if j not in unseparated]
        costs = _nonnegative_fit(counts, measured, rates, base_costs, free)
    fitted = dataclasses.replace(
        base, task_overhead_s=float(costs[0]), collective_latency_s=float(costs[1]),
        latency_s=float(costs[2]), run_overhead_s=float(costs[3]),
        byte_cost_s=float(costs[4]), op_overhead_s=float(costs[5]), source=source)
    predicted = rates + counts @ costs
    base_predicted = rates + counts @ base_costs
    return fitted, {
        "median_abs_log_error": float(np.median(np.abs(np.log(measured / predicted)))),
        "base_median_abs_log_error": float(np.median(np.abs(np.log(measured
                                                                   / base_predicted)))),
    }


def _nonnegative_fit(counts: np.ndarray, measured: np.ndarray, rates: np.ndarray,
                     base_costs: np.ndarray, free: list[int]) -> np.ndarray:
    """Every cost: the `free` ones fitted (non-negative least squares of the relative
    errors), the others at their base values."""
    fixed = [j for j in range(len(base_costs)) if j not in free]
    target = measured - rates - counts[:, fixed] @ base_costs[fixed]
    weight = 1.0 / measured
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
    costs = base_costs.copy()
    costs[free] = 0.0
    costs[list(best[1])] = best[2]
    return costs
