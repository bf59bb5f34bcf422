"""What happens after the tuner measures a batch of trials: callbacks.

After every measured batch the tuner calls each `MeasureCallback` in order
with itself and the batch's trials. The defaults reproduce the tuner's side
effects: `AddToDatabase` (record every trial, failures with their error),
`RefitCostModel` (retrain the cost model on the database) and, with
`progress`, `LogProgress` (a line per trial). A callback sees the tuner
through `TuneState`, so this module does not depend on the tuner.

Example:
    >>> class CountFailures(MeasureCallback):                   # doctest: +SKIP
    ...     def __init__(self): self.failed = 0
    ...     def apply(self, tuner, trials): self.failed += sum(not t.ok for t in trials)
    >>> Tuner(gi, spec, runner=r, callbacks=default_callbacks() + [CountFailures()])
"""
from __future__ import annotations

import abc
import dataclasses
import statistics
import sys
from typing import Any, Protocol, Sequence, TextIO

from autodist.ir.deprecation import renamed_names
from autodist.ir.strategy import Strategy
from autodist.search.database import Database, TrialRecord
from autodist.search.metrics import CostModelError
from autodist.search.predictor import Predictor


@dataclasses.dataclass
class StrategyTrial:
    """One measured (or failed) strategy of a tuning run.

    Attributes:
        strategy: What was measured.
        predicted_step_time_s: The tuner's predicted seconds for it.
        step_times_s: Timed step times in seconds (empty on failure).
        error: Why the trial failed, or None.
        origin: What proposed it: a builder's name or "search".
    """

    strategy: Strategy
    predicted_step_time_s: float
    step_times_s: tuple[float, ...] = ()
    error: str | None = None
    origin: str = "search"

    @property
    def ok(self) -> bool:
        """Measured without error, with timed steps."""
        return self.error is None and bool(self.step_times_s)

    @property
    def median_step_time_s(self) -> float | None:
        return float(statistics.median(self.step_times_s)) if self.step_times_s else None


class TuneState(Protocol):
    """What a callback may read and change of the tuner (`autodist.search.tuner.Tuner`)."""

    database: Database | None
    cost_model: Predictor          # what ranks now; a callback may replace it
    base_cost_model: Predictor     # what the tuner started with
    seed: int

    def record(self, strategy: Strategy, step_times_s: Sequence[float], error: str | None,
               predicted_step_time_s: float | None = None, origin: str = "search",
               extra: dict[str, Any] | None = None) -> TrialRecord:
        """The database record of one trial on the tuner's workload."""


class MeasureCallback(abc.ABC):
    """Runs after each measured batch of a tuning run."""

    @abc.abstractmethod
    def apply(self, tuner: TuneState, trials: Sequence[StrategyTrial]) -> None:
        """Acts on the batch's trials (in the order they were proposed)."""


class AddToDatabase(MeasureCallback):
    """Appends every trial, failed ones with their error, to the tuner's database (if any)."""

    def apply(self, tuner: TuneState, trials: Sequence[StrategyTrial]) -> None:
        if tuner.database is None or not trials:
            return
        tuner.database.extend([tuner.record(t.strategy, t.step_times_s, t.error,
                                            t.predicted_step_time_s, origin=t.origin)
                               for t in trials])


class RefitCostModel(MeasureCallback):
    """Retrains the cost model on the database's measured trials.

    The new model is `tuner.base_cost_model.update(records)`: a LightGBM
    model continues from the model the tuner started with (e.g. the shipped
    one), the simulator gives way to a LightGBM regressor. The tuner
    searches again with it. Nothing happens without a database, with fewer
    than `min_trials` successful trials, or when the trials cannot train a
    model yet (e.g. no workload with two distinct times).

    Args:
        min_trials: Successful trials with features needed before a refit.
    """

    def __init__(self, min_trials: int = 8) -> None:
        if isinstance(min_trials, bool) or not isinstance(min_trials, int) or min_trials < 1:
            raise CostModelError(f"min_trials must be a positive integer. "
                                 f"Received: {min_trials!r}")
        self.min_trials = min_trials

    def apply(self, tuner: TuneState, trials: Sequence[StrategyTrial]) -> None:
        if tuner.database is None:
            return
        records = [r for r in tuner.database.records() if r.ok and r.features]
        if len(records) < self.min_trials:
            return
        try:
            tuner.cost_model = tuner.base_cost_model.update(records, seed=tuner.seed)
        except CostModelError:
            return  # e.g. no workload with two distinct measurements yet


class LogProgress(MeasureCallback):
    """Prints one line per trial: its origin, predicted and measured time or error.

    Args:
        stream: Where to print (default: `sys.stderr` at the time of printing).
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream

    def apply(self, tuner: TuneState, trials: Sequence[StrategyTrial]) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        for t in trials:
            outcome = (f"{t.median_step_time_s * 1e3:.2f} ms" if t.error is None
                       else f"failed: {t.error.splitlines()[0][:80] if t.error else ''}")
            print(f"trial ({t.origin}): predicted {t.predicted_step_time_s * 1e3:.2f} ms, "
                  f"measured {outcome}", file=stream, flush=True)


def default_callbacks(progress: bool = False) -> list[MeasureCallback]:
    """The tuner's default side effects: record, refit and (with `progress`) log."""
    callbacks: list[MeasureCallback] = [AddToDatabase(), RefitCostModel()]
    if progress:
        callbacks.append(LogProgress())
    return callbacks


# Old names, kept working with a DeprecationWarning that names the new one.
__getattr__ = renamed_names(__name__, globals(), {"Trial": "StrategyTrial"})
