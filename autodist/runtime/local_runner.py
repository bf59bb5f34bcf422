"""Measures strategies on a real local cluster: the search's `Runner` in the runtime.

`LocalRunner.run(strategies)` measures many strategies in one cluster
launch: the job starts with the first and switches in place to the next
every `warmup_steps + steps` steps (`fit(..., switch_at=...)`), so strategy k
owns steps [k * (warmup + steps), (k + 1) * (warmup + steps)) of the launch,
and its first `warmup_steps` steps (a new program's first steps are slow)
are not timed. A failed launch is measured again in halves, down to one
strategy per launch; a strategy that still fails gets a result with its
error. The model's weights are restored after every launch, so measuring
never changes the user's model.

Used by `autodist.optimize(measure=True)` (through the tuner), `autodist
bench`, and the benchmarks that collect trials or compare strategies. Its
cluster is on this machine; `autodist.runtime.remote_runner.RemoteRunner`
measures the same way on hosts that run `autodist serve`.

Example:
    >>> runner = LocalRunner(model, spec, batch_size=64, steps=10, warmup_steps=3)  # doctest: +SKIP
    >>> [r.median_step_time_s for r in runner.run([s1, s2, s3])]       # one launch
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from autodist.ir.errors import AutodistError
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.search.measurement import MeasureResult, Runner, pool


@dataclasses.dataclass(frozen=True)
class LaunchRecord:
    """What one cluster launch recorded.

    Attributes:
        step_times_s: The chief's time of every step of the launch, in seconds.
        switches: Per strategy switch, at least {"step": first step of the new
            strategy, "seconds": how long the switch took} (`History.resizes`).
    """

    step_times_s: Sequence[float]
    switches: Sequence[Mapping[str, float]] = ()


# (first strategy, switch_at {step: strategy}, total steps) -> what the launch
# recorded; raises when the launch fails.
Launch = Callable[[Strategy, Mapping[int, Strategy], int], LaunchRecord]


# ------------------------------------------------------------ the schedule
def trial_starts(num_strategies: int, warmup: int, steps: int) -> list[int]:
    """The global step at which each strategy of a launch starts."""
    if num_strategies < 1 or warmup < 0 or steps < 1:
        raise AutodistError(f"need >= 1 strategy, warmup >= 0 and steps >= 1. Received: "
                            f"{num_strategies}, {warmup}, {steps}")
    return [k * (warmup + steps) for k in range(num_strategies)]


def switch_schedule(strategies: Sequence[Any], warmup: int, steps: int
                    ) -> tuple[Any, dict[int, Any], int]:
    """The launch's first strategy, its `switch_at` and its total steps."""
    starts = trial_starts(len(strategies), warmup, steps)
    switch_at = {start: s for start, s in zip(starts[1:], strategies[1:])}
    return strategies[0], switch_at, len(strategies) * (warmup + steps)


def slice_step_times(step_times: Sequence[float], num_strategies: int, warmup: int,
                     steps: int) -> list[tuple[list[float], list[float]]]:
    """Per strategy of a launch: (its warm-up step times, its timed step times).

    Raises:
        AutodistError: The launch recorded fewer steps than its strategies need.
    """
    starts = trial_starts(num_strategies, warmup, steps)
    need = starts[-1] + warmup + steps
    if len(step_times) < need:
        raise AutodistError(f"the launch recorded {len(step_times)} step times; its "
                            f"{num_strategies} strategies of {warmup} + {steps} steps need "
                            f"{need}")
    return [([float(t) for t in step_times[s:s + warmup]],
             [float(t) for t in step_times[s + warmup:s + warmup + steps]]) for s in starts]


def switch_seconds(switches: Sequence[Mapping[str, float]], num_strategies: int, warmup: int,
                   steps: int) -> list[float | None]:
    """Per strategy, how long the switch into it took (None for the first).

    Raises:
        AutodistError: A switch is missing or happened at another step than planned.
    """
    starts = trial_starts(num_strategies, warmup, steps)
    by_step = {int(r["step"]): float(r["seconds"]) for r in switches}
    missing = [s for s in starts[1:] if s not in by_step]
    if missing:
        raise AutodistError(f"the launch did not switch at steps {missing} "
                            f"(switches at {sorted(by_step)})")
    return [None] + [by_step[s] for s in starts[1:]]


def chunks(items: Sequence[Any], size: int) -> list[list[Any]]:
    """`items` in consecutive lists of at most `size`, their sizes balanced."""
    if size < 1:
        raise AutodistError(f"size must be >= 1. Received: {size}")
    if not items:
        return []
    count = -(-len(items) // size)
    base, extra = divmod(len(items), count)
    out, start = [], 0
    for i in range(count):
        end = start + base + (1 if i < extra else 0)
        out.append(list(items[start:end]))
        start = end
    return out


def measure_with_fallback(strategies: Sequence[Any],
                          launch: Callable[[Sequence[Any]], list[MeasureResult]],
                          log: Callable[[str], None] = lambda _: None,
                          splits: Callable[[BaseException], bool] = lambda _: True
                          ) -> list[MeasureResult]:
    """Measures strategies in one launch; on failure, in halves, down to one per launch.

    Args:
        strategies: What to measure, in order.
        launch: Measures a list of strategies in one launch (one result per
            strategy) or raises when the launch fails.
        log: Receives a line per failed launch.
        splits: Whether a launch's error may be one strategy's fault, so that
            measuring in halves can isolate it (default: always). An error of
            the cluster itself (a task that does not answer) fails every
            strategy of the launch at once instead.

    Returns:
        One result per strategy, in order; a strategy that fails on its own
        gets `error` (never an exception).
    """
    if not strategies:
        return []
    try:
        results = launch(strategies)
        if len(results) != len(strategies):
            raise AutodistError(f"the launch returned {len(results)} results for "
                                f"{len(strategies)} strategies")
        return results
    except Exception as e:  # noqa: BLE001
        failed = MeasureResult.failure(e, launch_size=1)
        log(f"launch of {len(strategies)} failed: {failed.error.splitlines()[0][:200]}")
        if len(strategies) == 1 or not splits(e):
            return [dataclasses.replace(failed, launch_size=len(strategies))
                    for _ in strategies]
    half = len(strategies) // 2
    return (measure_with_fallback(strategies[:half], launch, log, splits)
            + measure_with_fallback(strategies[half:], launch, log, splits))


# ------------------------------------------------------------- the runner
class LocalRunner(Runner):
    """Trains a few steps per strategy on a local cluster and reports step times.

    Args:
        model: The compiled Keras model (its weights are restored after
            every launch). May be None with a `launch` of your own.
        resource_spec: The (local) cluster to measure on.
        batch_size: Global batch size.
        steps: Timed steps per strategy.
        warmup_steps: Untimed steps after each strategy's start or switch.
        per_launch: Most strategies in one launch (None: all of a `run` call).
        orders: 2: measure the strategies again in reverse order and pool the
            timed steps of both passes, so no strategy is always measured
            late in a launch; 1: one pass.
        x, y: Data for the steps (default: synthetic data shaped for the
            model, seeded by `data_seed`); rows are reused when there are
            fewer than a launch needs.
        data_seed: Seed of the synthetic data.
        graph_item: The model's capture, if already made.
        timeout_s: Bound on one launch.
        step_timeout_s, startup_timeout_s: As for `DistributedRun`.
        allow_exposed: As for `DistributedRun`: where no private network
            namespace can be made, run the launches reachable from other hosts.
        log: Receives a line per failed launch.
        launch: Runs one launch (default: `fit` on the local cluster); tests
            pass a fake.
    """

    def __init__(self, model, resource_spec: ResourceSpec, *, batch_size: int = 64,
                 steps: int = 10, warmup_steps: int = 3, per_launch: int | None = None,
                 orders: int = 1, x: Any = None, y: Any = None, data_seed: int = 0,
                 graph_item: GraphItem | None = None, timeout_s: float = 600.0,
                 step_timeout_s: float = 60.0, startup_timeout_s: float = 120.0,
                 allow_exposed: bool = False,
                 log: Callable[[str], None] = lambda _: None,
                 launch: Launch | None = None) -> None:
        if steps < 1 or warmup_steps < 0:
            raise AutodistError(f"steps must be >= 1 and warmup_steps >= 0. Received: "
                                f"steps={steps!r}, warmup_steps={warmup_steps!r}")
        if per_launch is not None and per_launch < 1:
            raise AutodistError(f"per_launch must be >= 1 or None. Received: {per_launch!r}")
        if orders not in (1, 2):
            raise AutodistError(f"orders must be 1 or 2. Received: {orders!r}")
        if batch_size < 1:
            raise AutodistError(f"batch_size must be >= 1. Received: {batch_size!r}")
        if model is None and launch is None:
            raise AutodistError("LocalRunner needs a model (or a launch function of its own)")
        if (x is None) != (y is None):
            raise AutodistError("pass both x and y, or neither (synthetic data)")
        if launch is None:
            self._check_cluster(resource_spec)
        self.model = model
        self.resource_spec = resource_spec
        self.batch_size = batch_size
        self.steps = steps
        self.warmup_steps = warmup_steps
        self.per_launch = per_launch
        self.orders = orders
        self.graph_item = graph_item
        self.timeout_s = timeout_s
        self.step_timeout_s = step_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.allow_exposed = allow_exposed
        self.log = log
        self._launch: Launch = launch if launch is not None else self._fit
        self._given = (x, y) if x is not None else None
        self._data_seed = data_seed
        self._data: tuple[Any, Any] | None = None
        self._data_rows = 0

    def run(self, strategies: Sequence[Strategy]) -> list[MeasureResult]:
        """One result per strategy, in order: timed steps pooled over the passes, or an error."""
        strategies = list(strategies)
        n = len(strategies)
        if not n:
            return []
        passes = [list(range(n))]
        if self.orders == 2 and n > 1:
            passes.append(list(reversed(range(n))))
        measured: list[list[MeasureResult]] = []
        for order in passes:
            results: list[MeasureResult | None] = [None] * n
            for group in chunks(order, self.per_launch or n):
                outcomes = measure_with_fallback([strategies[i] for i in group],
                                                 self._launch_batch, self.log, self._splits)
                for i, outcome in zip(group, outcomes):
                    results[i] = outcome
            measured.append(results)
        return [pool([results[i] for results in measured]) for i in range(n)]

    def _launch_batch(self, strategies: Sequence[Strategy]) -> list[MeasureResult]:
        """Measures strategies in one launch; raises when it fails."""
        first, switch_at, total = switch_schedule(strategies, self.warmup_steps, self.steps)
        record = self._launch(first, switch_at, total)
        parts = slice_step_times(record.step_times_s, len(strategies), self.warmup_steps,
                                 self.steps)
        switches = switch_seconds(record.switches, len(strategies), self.warmup_steps,
                                  self.steps)
        return [MeasureResult(step_times_s=tuple(timed), warmup_times_s=tuple(warm),
                              switch_s=switch, launch_size=len(strategies))
                for (warm, timed), switch in zip(parts, switches)]

    def _fit(self, first: Strategy, switch_at: Mapping[int, Strategy],
             total_steps: int) -> LaunchRecord:
        """One launch on the local cluster: `fit` with the strategies switched in place."""
        from autodist.runtime.run import DistributedRun

        x, y = self._rows(total_steps * self.batch_size)
        weights = [np.array(w) for w in self.model.get_weights()]
        try:
            run = DistributedRun(self.model, first, self.resource_spec,
                                 graph_item=self.graph_item, step_timeout_s=self.step_timeout_s,
                                 startup_timeout_s=self.startup_timeout_s,
                                 keep_optimizer_state=False, **self._run_options())
            self.graph_item = run.graph_item
            history = run.fit(x, y, batch_size=self.batch_size, epochs=1,
                              steps_per_epoch=total_steps, verbose=0, shuffle=False,
                              timeout_s=self.timeout_s, switch_at=dict(switch_at) or None)
        finally:
            self.model.set_weights(weights)   # every launch starts from the same weights
        return LaunchRecord(history.step_times, history.resizes)

    # What a remote runner (`autodist.runtime.remote_runner`) does otherwise.
    @staticmethod
    def _check_cluster(resource_spec: ResourceSpec) -> None:
        """Raises unless every node of the cluster is on this machine."""
        from autodist.launch.local import check_local

        try:
            check_local(resource_spec)
        except AutodistError as e:
            raise AutodistError(f"LocalRunner measures on this machine only: {e}. To measure "
                                "on served hosts use RemoteRunner (optimize(..., "
                                "launch='remote'), `autodist search --launch remote`)") from None

    def _run_options(self) -> dict[str, Any]:
        """The `DistributedRun` options of every launch, beyond the bounds."""
        return {"allow_exposed": self.allow_exposed}

    @staticmethod
    def _splits(error: BaseException) -> bool:
        """Whether a failed launch is measured again in halves (`measure_with_fallback`)."""
        return True

    def _rows(self, rows: int) -> tuple[Any, Any]:
        """The first `rows` examples of the data (synthetic, or the given ones reused)."""
        if self._given is not None:
            x, y = self._given
            available = len(y)
            index = np.arange(rows) % available
            take = lambda a: a[index] if rows > available else a[:rows]  # noqa: E731
        else:
            if self._data is None or self._data_rows < rows:
                from autodist.models import synthetic_data

                self._data = synthetic_data(self.model, rows, seed=self._data_seed)
                self._data_rows = rows
            x, y = self._data
            take = lambda a: a[:rows]  # noqa: E731
        return ([take(a) for a in x] if isinstance(x, list) else take(x)), take(y)
