"""Test doubles of the search and of adaptation, in one place (tests only).

Runners that stand in for a cluster (`autodist.search.measurement.Runner`),
a callback that records the tuner's rounds, a run that records the requests
of policies, and throughput curves that stand in for measuring a cluster at
n workers. The package's own double, `SimulatedRunner`, is in
`autodist.search.measurement` (the CLI's dry runs use it too).
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import keras

from autodist.adapt.autoscaler import Observation
from autodist.adapt.task_providers import LocalProcesses
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.runtime import elastic
from autodist.search.measure_callback import MeasureCallback
from autodist.search.measurement import MeasureResult, Runner, SimulatedRunner
from autodist.search.simulator import Calibration

# ---------------------------------------------------------------- runners


def skewed_runner(graph_item: GraphItem, spec: ResourceSpec,
                  fail_when: Callable[[Strategy], bool] | None = None) -> SimulatedRunner:
    """'Measures' with a differently calibrated simulator than the tuner predicts with.

    Fails a strategy where `fail_when(strategy)` is true.
    """
    return SimulatedRunner(graph_item, spec, fail_when=fail_when,
                           calibration=Calibration(latency_s=3e-4, memory_bytes_per_s=2e9))


class BrokenRunner(Runner):
    """Raises ConnectionError (results None), or returns `results` whatever it is asked."""

    def __init__(self, results: list[MeasureResult] | None = None) -> None:
        self.results = results

    def run(self, strategies: Sequence[Strategy]) -> list[MeasureResult]:
        if self.results is None:
            raise ConnectionError("cluster unreachable")
        return self.results


class LaunchCountingRunner:
    """Strategy "a", "b", ... takes 0.1 s * its letter's rank + 0.01 s per earlier launch.

    Remembers each launch's order; "b" fails in the second launch.
    """

    def __init__(self) -> None:
        self.orders: list[list[str]] = []

    def run(self, strategies: Sequence[str]) -> list[MeasureResult]:
        launch = len(self.orders)
        self.orders.append(list(strategies))
        return [MeasureResult(error="AutodistError: lost") if (s == "b" and launch == 1)
                else MeasureResult((0.1 * (ord(s) - 96) + 0.01 * launch,) * 2,
                                   launch_size=len(strategies))
                for s in strategies]


# -------------------------------------------------------------- callbacks
class RoundRecorder(MeasureCallback):
    """Remembers each round's trials' origins and the cost model that ranked then."""

    def __init__(self) -> None:
        self.rounds: list[tuple[list[str], str]] = []

    def apply(self, tuner, trials) -> None:
        self.rounds.append(([t.origin for t in trials], tuner.cost_model.name))


# ------------------------------------------------------------ adaptation
class StandInRun:
    """Stands in for a DistributedRun under a policy's `Control`: records resize / replan."""

    def __init__(self, graph_item: GraphItem, strategy: Strategy, spec: ResourceSpec) -> None:
        self.graph_item, self.strategy, self.resource_spec = graph_item, strategy, spec
        self.requests: list[tuple[str, object]] = []
        self.members = tuple(range(spec.num_worker_tasks))
        self.task_provider = LocalProcesses(spec.num_worker_tasks)

    def resize(self, workers) -> tuple[int, ...]:
        self.requests.append(("resize", workers))
        limit = self.resource_spec.num_worker_tasks
        self.members = elastic.resized(self.members, workers, limit) \
            if isinstance(workers, int) else elastic.check_members(workers, limit)
        return self.members

    def replan(self, strategy: Strategy) -> None:
        self.requests.append(("replan", strategy))


class ResizeAfterEpochs(keras.callbacks.Callback):
    """A policy as a callback: after epoch e, asks `run` for sizes[e] workers
    (`DistributedRun.resize`)."""

    def __init__(self, run, sizes: Mapping[int, object]) -> None:
        super().__init__()
        self.run, self.sizes = run, sizes

    def on_epoch_end(self, epoch, logs=None) -> None:
        if epoch in self.sizes:
            self.run.resize(self.sizes[epoch])


# ------------------------------------------- throughput at n workers
Curve = Callable[[int], "float | Observation"]


def comm_curve(batch: float, c: float, a: float, b: float) -> Curve:
    """throughput(n) = batch / (c/n + a + b(n-1)/n): compute shrinks, communication grows."""
    return lambda n: batch / (c / n + a + b * (n - 1) / n)


def saturating(k: float, m: float) -> Curve:
    """k·n / (n + m): the step n -> n+1 adds m / (n + m + 1) of the per-worker average."""
    return lambda n: k * n / (n + m)


def linear(n: int) -> float:
    """100 n: every step adds the average (an autoscaler goes to max_workers)."""
    return 100.0 * n


def peaked(n: int) -> float:
    """100 n - 6 n^2: peaks at n = 8.3, then falls."""
    return 100.0 * n - 6.0 * n * n


def flat(n: int) -> float:
    """500 whatever n."""
    return 500.0
