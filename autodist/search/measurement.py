"""The measuring role of the search: strategies in, step times (or errors) out.

A `Runner` measures a list of strategies and returns one `MeasureResult` per
strategy, in the same order. Failures are data: a strategy that cannot be
measured gets a result with its `error`, never an exception, so one bad
trial never stops a search. The runtime implements the real runners
(`autodist.runtime.local_runner.LocalRunner`: many strategies per cluster launch,
switched in place; `autodist.runtime.remote_runner.RemoteRunner`: the same as
jobs on served hosts); `SimulatedRunner` here "measures" with the analytic
simulator, so the tuning loop runs in unit tests and dry runs without a
cluster.

Example:
    >>> results = runner.run([strategy_a, strategy_b])          # doctest: +SKIP
    >>> [r.median_step_time_s if r.ok else r.error for r in results]  # doctest: +SKIP
"""
from __future__ import annotations

import abc
import dataclasses
import statistics
from typing import Callable, Sequence

from autodist.ir.errors import AutodistError, InvalidArgumentError
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.search.simulator import Calibration, Simulator
from autodist.search.space import SearchSpace


class RunnerError(AutodistError, RuntimeError):
    """A runner broke its contract (e.g. returned a result count other than asked for)."""


@dataclasses.dataclass(frozen=True)
class MeasureResult:
    """What measuring one strategy gave: timed step times, or why it failed.

    Attributes:
        step_times_s: Timed step times in seconds (after warm-up); empty on failure.
        error: Why the measurement failed ("<ExceptionType>: message"), or None.
        warmup_times_s: The untimed warm-up steps' times, when the runner records them.
        switch_s: Seconds the switch into this strategy took, when it was
            switched to in a running job (None: it started its launch, or
            the runner does not switch).
        launch_size: Strategies measured in the same launch (0: unknown).
    """

    step_times_s: tuple[float, ...] = ()
    error: str | None = None
    warmup_times_s: tuple[float, ...] = ()
    switch_s: float | None = None
    launch_size: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "step_times_s", tuple(float(t) for t in self.step_times_s))
        object.__setattr__(self, "warmup_times_s",
                           tuple(float(t) for t in self.warmup_times_s))

    @property
    def ok(self) -> bool:
        """Measured without error, with at least one timed step."""
        return self.error is None and bool(self.step_times_s)

    @property
    def median_step_time_s(self) -> float | None:
        """Median timed step time in seconds; None without timed steps."""
        return float(statistics.median(self.step_times_s)) if self.step_times_s else None

    @classmethod
    def failure(cls, error: BaseException | str, launch_size: int = 0) -> MeasureResult:
        """A failed result; an exception becomes "<ExceptionType>: message"."""
        if isinstance(error, BaseException):
            error = f"{type(error).__name__}: {error}"
        return cls(error=error, launch_size=launch_size)


def pool(results: Sequence[MeasureResult]) -> MeasureResult:
    """One strategy's measurements pooled (e.g. one per launch order).

    The timed (and warm-up) steps of the successful results are concatenated,
    in order; `switch_s` and `launch_size` are those of the first successful
    one. With none successful, the first result (its error) is returned.
    """
    if not results:
        raise InvalidArgumentError("pool needs at least one result")
    ok = [r for r in results if r.ok]
    if not ok:
        return results[0]
    return MeasureResult(step_times_s=tuple(t for r in ok for t in r.step_times_s),
                         warmup_times_s=tuple(t for r in ok for t in r.warmup_times_s),
                         switch_s=ok[0].switch_s, launch_size=ok[0].launch_size)


class Runner(abc.ABC):
    """Measures strategies; the search's only way to the hardware."""

    @abc.abstractmethod
    def run(self, strategies: Sequence[Strategy]) -> list[MeasureResult]:
        """One result per strategy, in the same order; failures as results with `error`."""


def checked_run(runner: Runner, strategies: Sequence[Strategy]) -> list[MeasureResult]:
    """`runner.run(strategies)`, with a runner's own crash turned into failed results.

    Raises:
        RunnerError: The runner returned another number of results than strategies.
    """
    strategies = list(strategies)
    if not strategies:
        return []
    try:
        results = list(runner.run(strategies))
    except Exception as e:  # noqa: BLE001
        # A crashed runner fails its trials; it never ends the search.
        return [MeasureResult.failure(e) for _ in strategies]
    if len(results) != len(strategies):
        raise RunnerError(f"{type(runner).__name__}.run returned {len(results)} results for "
                          f"{len(strategies)} strategies")
    bad = [type(r).__name__ for r in results if not isinstance(r, MeasureResult)]
    if bad:
        raise RunnerError(f"{type(runner).__name__}.run must return MeasureResult objects. "
                          f"Received: {bad[:3]}")
    return results


class SimulatedRunner(Runner):
    """A test double: "measures" with the simulator under another calibration.

    The step time of a strategy is the simulator's prediction for it with
    `calibration` (so the tuner's own, default-calibrated ranking is not
    exactly right), times each of `spread`. Strategies for which `fail_when`
    returns True fail with `RuntimeError: ... (simulated)`.

    Args:
        graph_item, resource_spec: The workload.
        calibration: The "true" machine constants.
        batch_size: Global batch size.
        spread: Factors of the timed steps around the prediction.
        fail_when: Which strategies fail (default: none).

    Attributes:
        calls: Strategies "measured" so far.
        batches: Sizes of the `run` calls so far.
    """

    def __init__(self, graph_item: GraphItem, resource_spec: ResourceSpec, *,
                 calibration: Calibration | None = None, batch_size: int | None = None,
                 spread: Sequence[float] = (1.0, 1.02, 0.98),
                 fail_when: Callable[[Strategy], bool] | None = None) -> None:
        self.simulator = Simulator(SearchSpace(graph_item, resource_spec), calibration,
                                   batch_size)
        self.spread = tuple(float(f) for f in spread)
        self.fail_when = fail_when
        self.calls = 0
        self.batches: list[int] = []

    def run(self, strategies: Sequence[Strategy]) -> list[MeasureResult]:
        self.batches.append(len(strategies))
        results = []
        for strategy in strategies:
            self.calls += 1
            if self.fail_when is not None and self.fail_when(strategy):
                results.append(MeasureResult.failure("RuntimeError: worker:1 died (simulated)",
                                                     launch_size=len(strategies)))
                continue
            t = float(self.simulator.predict_strategy(strategy).step_time_s[0])
            results.append(MeasureResult(step_times_s=tuple(t * f for f in self.spread),
                                         launch_size=len(strategies)))
        return results
