"""A model's compute measured on the cluster, for the simulator to use instead of its estimate.

The simulator estimates a replica's forward and backward passes from the
captured FLOPs, a FLOP rate and a cost per op, measured in-process on small
kernels. On the trial data set that estimate is the largest error left once
the fixed costs are calibrated: a CNN's steps measured 2-3x the estimate,
and CPU replicas sharing a host's cores slow down more than their share
(`benchmarks/results/calibrated_simulator.md`). Measuring the model itself on
the cluster (every replica computing at once, as in a step) removes it:
`autodist.runtime.cluster_calibration.measure_compute` measures it;
`Simulator(..., measured_compute=...)` uses it.
"""
from __future__ import annotations

import dataclasses
import math

from autodist.ir.errors import InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class MeasuredCompute:
    """One replica's forward and backward passes, measured on the cluster.

    Attributes:
        seconds: The slowest replica's median time for its passes, all
            replicas computing at once (no update, no communication).
        examples: The examples each replica computed on (its share of the
            measured global batch).
        source: Where and how it was measured (for `Plan.explain`).
    """

    seconds: float
    examples: float
    source: str = "measured on the cluster"

    def __post_init__(self) -> None:
        for name in ("seconds", "examples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not math.isfinite(value) or value <= 0:
                raise InvalidArgumentError(f"MeasuredCompute.{name} must be a positive finite "
                                           f"number. Received: {value!r}")

    def seconds_at(self, examples: float) -> float:
        """The time at another per-replica batch: scaled by the examples (the fixed costs
        of the passes scale too; measure at the batch you plan for)."""
        return self.seconds * examples / self.examples
