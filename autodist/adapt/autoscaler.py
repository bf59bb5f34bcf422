"""The autoscaler's decision logic: how many workers a job should run on.

Pure functions and small objects over measured throughputs; nothing here
starts a process or a TensorFlow graph. In production `measure(n)` resizes an
elastic run to `n` workers and returns the throughput it sees; in tests it is
a simulated curve.

* `Observation` / `ScalingCurve`: measured throughputs per size (the median
  over repeats counts), optionally with per-worker throughputs.
* `Heuristic` and its implementations: `ScalingEfficiency`, `CostUtility`
  (both walk a ladder of sizes, see `LadderHeuristic`) and
  `StragglerReplacement`.
* `Autoscaler`: trial and error (`run`: ask the heuristic, measure, repeat)
  and a cost-model-guided mode (`run_guided`: jump to the size the heuristic
  would settle on under a predicted curve, confirm it on the real curve,
  correct the prediction, repeat).
* `simulator_predictor`: a predicted throughput curve from the search's
  analytic simulator (or another cost model that predicts seconds).

Example:
    >>> scaler = Autoscaler(ScalingEfficiency(theta=0.8), min_workers=1, max_workers=16)
    >>> result = scaler.run(lambda n: 1000.0 * n / (n + 22))
    >>> result.workers, result.num_trials
    (5, 6)
"""
from __future__ import annotations

import abc
import dataclasses
import math
import statistics
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

from autodist.ir.deprecation import renamed_names
from autodist.ir.errors import AutodistError

if TYPE_CHECKING:  # only for annotations: the simulator is imported when used
    from autodist.ir.graph_item import GraphItem
    from autodist.ir.resource_spec import ResourceSpec
    from autodist.ir.strategy import Strategy
    from autodist.search.predictor import Predictor
    from autodist.search.simulator import Calibration


class AutoscalerError(AutodistError, ValueError):
    """A value given to the autoscaler is out of range, or a heuristic misbehaved."""


# ----------------------------------------------------------------- checks
def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise AutoscalerError(f"{name} must be an integer >= {minimum}. Received: {value!r}")
    return value


def _finite_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AutoscalerError(f"{name} must be a finite number. Received: {value!r}")
    return float(value)


def _throughput(name: str, value: object) -> float:
    """A measured or predicted throughput: finite and > 0."""
    number = _finite_number(name, value)
    if number <= 0:
        raise AutoscalerError(f"{name} must be > 0 examples/s. Received: {value!r}")
    return number


def _check_bounds(min_workers: int, max_workers: int, current: int | None = None) -> None:
    _positive_int("min_workers", min_workers)
    _positive_int("max_workers", max_workers)
    if min_workers > max_workers:
        raise AutoscalerError(f"min_workers must be <= max_workers. Received: min_workers="
                              f"{min_workers}, max_workers={max_workers}")
    if current is not None:
        if isinstance(current, bool) or not isinstance(current, int) \
                or not min_workers <= current <= max_workers:
            raise AutoscalerError(f"the current size must be an integer in [{min_workers}, "
                                  f"{max_workers}]. Received: {current!r}")


# ------------------------------------------------------------------- data
@dataclasses.dataclass(frozen=True)
class Observation:
    """One measurement of a job at one size.

    Attributes:
        workers: Number of workers the job ran on.
        throughput: Examples per second of the whole job.
        per_worker: Examples per second of each worker, keyed by task index
            (empty when not measured). A stalled worker may report 0.
    """

    workers: int
    throughput: float
    per_worker: Mapping[int, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        _positive_int("Observation.workers", self.workers)
        object.__setattr__(self, "throughput",
                           _throughput(f"throughput at {self.workers} workers", self.throughput))
        per_worker = {}
        for task, value in dict(self.per_worker).items():
            _positive_int("per-worker task index", task, minimum=0)
            number = _finite_number(f"throughput of worker {task}", value)
            if number < 0:
                raise AutoscalerError(f"throughput of worker {task} must be >= 0. "
                                      f"Received: {value!r}")
            per_worker[task] = number
        object.__setattr__(self, "per_worker", per_worker)


class ScalingCurve:
    """Measured throughput per number of workers.

    Repeated measurements of one size are kept in order; `throughput(n)` is
    their median, so one noisy repeat does not move a decision.

    Args:
        observations: Initial observations, in the order they were made.
    """

    def __init__(self, observations: Iterable[Observation] = ()) -> None:
        self._observations: list[Observation] = []
        for observation in observations:
            self.add(observation)

    def add(self, observation: Observation) -> None:
        """Appends one observation."""
        if not isinstance(observation, Observation):
            raise AutoscalerError(f"ScalingCurve.add takes an Observation. "
                                  f"Received: {observation!r}")
        self._observations.append(observation)

    def record(self, workers: int, throughput: float,
               per_worker: Mapping[int, float] | None = None) -> Observation:
        """Appends a measurement given by its parts; returns the Observation."""
        observation = Observation(workers, throughput, dict(per_worker or {}))
        self.add(observation)
        return observation

    def __contains__(self, workers: object) -> bool:
        return any(o.workers == workers for o in self._observations)

    def __len__(self) -> int:
        return len(self._observations)

    def sizes(self) -> list[int]:
        """The measured sizes, ascending."""
        return sorted({o.workers for o in self._observations})

    def observations(self, workers: int | None = None) -> list[Observation]:
        """The observations (of one size, or all), in the order they were made."""
        return [o for o in self._observations if workers is None or o.workers == workers]

    def throughput(self, workers: int) -> float:
        """The median measured throughput at `workers`; AutoscalerError if unmeasured."""
        values = [o.throughput for o in self._observations if o.workers == workers]
        if not values:
            raise AutoscalerError(f"no throughput measured at {workers!r} workers; "
                                  f"measured sizes: {self.sizes()}")
        return float(statistics.median(values))

    def as_dict(self) -> dict[int, float]:
        """{workers: median throughput}, ascending by size."""
        return {n: self.throughput(n) for n in self.sizes()}

    def __repr__(self) -> str:
        return f"ScalingCurve({self.as_dict()})"


@dataclasses.dataclass(frozen=True)
class Decision:
    """What a heuristic wants next.

    Attributes:
        workers: The size to run at next (to measure, when not yet measured),
            or the chosen size when `done`.
        reason: Why, in words with the numbers behind it.
        done: True when `workers` is the heuristic's final choice.
        replace: Task indices of workers to replace (straggler replacement;
            the size stays).
    """

    workers: int
    reason: str
    done: bool = False
    replace: tuple[int, ...] = ()


# ------------------------------------------------------------- heuristics
class Heuristic(abc.ABC):
    """Chooses the next number of workers from a measured scaling curve.

    A heuristic is stateless: everything it knows is in the curve, so the
    same curve always gives the same decision, and the guided mode can run
    it on a predicted curve as well as on a measured one.
    """

    @abc.abstractmethod
    def next_size(self, curve: ScalingCurve, current: int, min_workers: int,
                  max_workers: int) -> Decision:
        """The next decision for a job now at `current` workers.

        Args:
            curve: What has been measured so far (should include `current`).
            current: The size the job runs at.
            min_workers: Smallest allowed size.
            max_workers: Largest allowed size.
        """

    def support(self, workers: int, min_workers: int, max_workers: int) -> tuple[int, ...]:
        """The sizes whose measurements decide whether to settle at `workers`.

        The guided mode measures exactly these on the real curve to confirm
        a predicted choice. The default is the size alone.
        """
        return (workers,)


class LadderHeuristic(Heuristic):
    """Walks a ladder of sizes, growing while each step pays.

    The ladder is min_workers, min_workers + step, min_workers + 2·step, …,
    plus max_workers. A subclass says whether growing from a smaller size
    `lower` to a larger `upper` pays (`step_pays`). The heuristic settles on
    the size c where the step into c paid (or c is min_workers) and the step
    out of c does not (or c is max_workers): growing from min_workers while
    the steps pay ends there. From the current size c it decides, in order:

    1. the step from c to the next ladder size is measured and pays: move up;
    2. c > min_workers and the next lower ladder size is unmeasured: measure
       it (to learn whether the step into c paid);
    3. the step into c did not pay: move down;
    4. c is max_workers, or the step out of c is measured (and did not pay):
       done at c;
    5. otherwise measure the next size up.

    Starting at min_workers this is plain trial and error upward; starting
    elsewhere it checks the step into the start first, and walks down if the
    start is already too large. When the steps' payoff falls with the size
    (concave curves: the usual case) the local condition at c equals the
    walk from min_workers, which the guided mode relies on.

    Args:
        step: Ladder spacing in workers (>= 1).
    """

    def __init__(self, step: int = 1) -> None:
        self.step = _positive_int("step", step)

    @abc.abstractmethod
    def step_pays(self, curve: ScalingCurve, lower: int, upper: int) -> tuple[bool, str]:
        """Whether growing from `lower` to `upper` workers pays, and why (both measured)."""

    def ladder(self, min_workers: int, max_workers: int) -> list[int]:
        """The sizes this heuristic may visit, ascending."""
        _check_bounds(min_workers, max_workers)
        sizes = list(range(min_workers, max_workers + 1, self.step))
        if sizes[-1] != max_workers:
            sizes.append(max_workers)
        return sizes

    def neighbours(self, workers: int, min_workers: int,
                   max_workers: int) -> tuple[int | None, int | None]:
        """The ladder sizes just below and just above `workers` (None at the ends)."""
        sizes = self.ladder(min_workers, max_workers)
        lower = max((n for n in sizes if n < workers), default=None)
        upper = min((n for n in sizes if n > workers), default=None)
        return lower, upper

    def support(self, workers: int, min_workers: int, max_workers: int) -> tuple[int, ...]:
        lower, upper = self.neighbours(workers, min_workers, max_workers)
        return tuple(n for n in (workers, lower, upper) if n is not None)

    def next_size(self, curve: ScalingCurve, current: int, min_workers: int,
                  max_workers: int) -> Decision:
        _check_bounds(min_workers, max_workers, current)
        if current not in curve:
            return Decision(current, f"measure the current size {current} first")
        lower, upper = self.neighbours(current, min_workers, max_workers)
        up_pays, up_why = (False, "")
        if upper is not None and upper in curve:
            up_pays, up_why = self.step_pays(curve, current, upper)
            if up_pays:
                return Decision(upper, f"move up: {up_why}")
        if lower is not None:
            if lower not in curve:
                return Decision(lower, f"measure {lower} to check the step into {current}")
            pays, why = self.step_pays(curve, lower, current)
            if not pays:
                return Decision(lower, f"move down: {why}")
        if upper is None:
            return Decision(current, f"settle at {current}: max_workers reached", done=True)
        if upper in curve:
            return Decision(current, f"settle at {current}: {up_why}", done=True)
        return Decision(upper, f"grow to {upper}: the step into {current} paid"
                        if lower is not None else f"grow to {upper} from min_workers")


class ScalingEfficiency(LadderHeuristic):
    """Grow while the added workers still work almost as well as the others.

    The rule, for a step from `a` to `b > a` workers with throughputs T(a)
    and T(b): the marginal throughput per added worker is
    (T(b) − T(a)) / (b − a), the per-worker average at the smaller size is
    T(a) / a, and the step pays when

        (T(b) − T(a)) / (b − a) >= theta · T(a) / a.

    The heuristic grows along the ladder (see `LadderHeuristic`) while the
    steps pay and settles on the largest size whose step in still paid, or
    on max_workers. theta = 1 grows only while scaling is linear or better;
    smaller theta tolerates more communication overhead.

    Args:
        theta: The fraction of the average per-worker throughput an added
            worker must contribute, in (0, 1].
        step: Workers added per step.

    Example:
        >>> h = ScalingEfficiency(theta=0.8)
        >>> curve = ScalingCurve([Observation(1, 100.0), Observation(2, 190.0)])
        >>> h.step_pays(curve, 1, 2)[0]     # 90 per added worker >= 0.8 · 100
        True
    """

    def __init__(self, theta: float = 0.8, step: int = 1) -> None:
        super().__init__(step)
        theta = _finite_number("theta", theta)
        if not 0 < theta <= 1:
            raise AutoscalerError(f"theta must be in (0, 1]. Received: {theta!r}")
        self.theta = theta

    def step_pays(self, curve: ScalingCurve, lower: int, upper: int) -> tuple[bool, str]:
        t_lower, t_upper = curve.throughput(lower), curve.throughput(upper)
        marginal = (t_upper - t_lower) / (upper - lower)
        average = t_lower / lower
        pays = marginal >= self.theta * average
        sign = ">=" if pays else "<"
        return pays, (f"{lower}->{upper} adds {marginal:.4g}/worker {sign} {self.theta:g} x "
                      f"average {average:.4g}/worker at {lower}")

    def __repr__(self) -> str:
        return f"ScalingEfficiency(theta={self.theta!r}, step={self.step!r})"


class CostUtility(LadderHeuristic):
    """Grow while the value of the extra examples exceeds the extra workers' cost.

    The utility of n workers, per hour, is

        U(n) = value_per_million_examples · T(n) · 3600 / 1e6
               − worker_cost_per_hour · n,

    and a step from `a` to `b` workers pays when U(b) > U(a). Walking the
    ladder from min_workers this settles on the first local maximum of U,
    which is the argmax over the ladder when U is unimodal (throughput
    concave, cost linear).

    Args:
        worker_cost_per_hour: Cost of one worker for an hour (>= 0).
        value_per_million_examples: What a million trained examples are
            worth, in the same currency (> 0).
        step: Workers added per step.
    """

    def __init__(self, worker_cost_per_hour: float, value_per_million_examples: float,
                 step: int = 1) -> None:
        super().__init__(step)
        cost = _finite_number("worker_cost_per_hour", worker_cost_per_hour)
        if cost < 0:
            raise AutoscalerError(f"worker_cost_per_hour must be >= 0. "
                                  f"Received: {worker_cost_per_hour!r}")
        value = _finite_number("value_per_million_examples", value_per_million_examples)
        if value <= 0:
            raise AutoscalerError(f"value_per_million_examples must be > 0. "
                                  f"Received: {value_per_million_examples!r}")
        self.worker_cost_per_hour = cost
        self.value_per_million_examples = value

    def utility(self, workers: int, throughput: float) -> float:
        """Value minus cost per hour of running `workers` at `throughput` examples/s."""
        return (self.value_per_million_examples * throughput * 3600.0 / 1e6
                - self.worker_cost_per_hour * workers)

    def step_pays(self, curve: ScalingCurve, lower: int, upper: int) -> tuple[bool, str]:
        u_lower = self.utility(lower, curve.throughput(lower))
        u_upper = self.utility(upper, curve.throughput(upper))
        pays = u_upper > u_lower
        sign = ">" if pays else "<="
        return pays, f"utility {u_upper:.6g}/h at {upper} {sign} {u_lower:.6g}/h at {lower}"

    def __repr__(self) -> str:
        return (f"CostUtility(worker_cost_per_hour={self.worker_cost_per_hour!r}, "
                f"value_per_million_examples={self.value_per_million_examples!r}, "
                f"step={self.step!r})")


def smoothed_worker_throughput(observations: Sequence[Observation],
                               smoothing: float) -> dict[int, float]:
    """EMA of each worker's throughput over `observations`, in order.

    A worker's first value starts its average; each later value x updates it
    to smoothing · x + (1 − smoothing) · average. Workers missing from an
    observation keep their average.
    """
    smoothed: dict[int, float] = {}
    for observation in observations:
        for task, value in observation.per_worker.items():
            previous = smoothed.get(task)
            smoothed[task] = value if previous is None else (
                smoothing * value + (1.0 - smoothing) * previous)
    return smoothed


class StragglerReplacement(Heuristic):
    """Flags workers persistently slower than their peers; keeps the size.

    Each worker's throughput at the current size is smoothed with an
    exponential moving average over the observations (see
    `smoothed_worker_throughput`), so a one-off dip barely moves it. A
    worker whose smoothed throughput is below threshold × the median of the
    smoothed throughputs is listed in `Decision.replace`; the decision is
    always done at the current size.

    Args:
        threshold: Fraction of the median below which a worker is a
            straggler, in (0, 1).
        smoothing: EMA weight of the newest observation, in (0, 1]
            (1 = no smoothing).
    """

    def __init__(self, threshold: float = 0.7, smoothing: float = 0.3) -> None:
        threshold = _finite_number("threshold", threshold)
        if not 0 < threshold < 1:
            raise AutoscalerError(f"threshold must be in (0, 1). Received: {threshold!r}")
        smoothing = _finite_number("smoothing", smoothing)
        if not 0 < smoothing <= 1:
            raise AutoscalerError(f"smoothing must be in (0, 1]. Received: {smoothing!r}")
        self.threshold = threshold
        self.smoothing = smoothing

    def next_size(self, curve: ScalingCurve, current: int, min_workers: int,
                  max_workers: int) -> Decision:
        _check_bounds(min_workers, max_workers, current)
        smoothed = smoothed_worker_throughput(curve.observations(current), self.smoothing)
        if not smoothed:
            return Decision(current, f"no per-worker throughputs measured at {current} "
                            "workers", done=True)
        median = statistics.median(smoothed.values())
        limit = self.threshold * median
        slow = tuple(sorted(t for t, v in smoothed.items() if v < limit))
        if not slow:
            return Decision(current, f"no straggler: every smoothed throughput >= "
                            f"{self.threshold:g} x median {median:.4g}", done=True)
        detail = ", ".join(f"worker {t} at {smoothed[t]:.4g}" for t in slow)
        return Decision(current, f"replace {detail} (< {self.threshold:g} x median "
                        f"{median:.4g})", done=True, replace=slow)

    def __repr__(self) -> str:
        return f"StragglerReplacement(threshold={self.threshold!r}, smoothing={self.smoothing!r})"


# ------------------------------------------------------------- the search
@dataclasses.dataclass(frozen=True)
class ScalingTrial:
    """One measurement the autoscaler paid for: `workers` gave `throughput` examples/s."""

    workers: int
    throughput: float


@dataclasses.dataclass
class ScalingResult:
    """The outcome of an autoscaling search.

    Attributes:
        workers: The chosen size.
        decision: The heuristic's final decision (its reason, stragglers).
        trials: Every measurement, in the order it was made.
        curve: The measured curve.
        mode: "trial-and-error" or "guided".
        targets: Guided mode: the size predicted at each round, in order.
    """

    workers: int
    decision: Decision
    trials: list[ScalingTrial]
    curve: ScalingCurve
    mode: str
    targets: list[int] = dataclasses.field(default_factory=list)

    @property
    def num_trials(self) -> int:
        """Number of measurements made."""
        return len(self.trials)

    @property
    def replace(self) -> tuple[int, ...]:
        """Task indices of workers to replace (from the final decision)."""
        return self.decision.replace


Measure = Callable[[int], "float | Observation"]


def _walk(heuristic: Heuristic, curve: ScalingCurve, current: int, min_workers: int,
          max_workers: int, measure_at: Callable[[int], None]) -> Decision:
    """Trial and error: measure the current size if new, ask, move; until done."""
    # A ladder walk visits each size at most a few times; more means a
    # heuristic that cycles, which would otherwise loop forever.
    limit = 4 * (max_workers - min_workers + 1) + 8
    decision = None
    for _ in range(limit):
        if current not in curve:
            measure_at(current)
        decision = heuristic.next_size(curve, current, min_workers, max_workers)
        if not isinstance(decision, Decision):
            raise AutoscalerError(f"{heuristic!r}.next_size must return a Decision. "
                                  f"Received: {decision!r}")
        if not min_workers <= decision.workers <= max_workers:
            raise AutoscalerError(f"{heuristic!r} chose {decision.workers!r} workers, outside "
                                  f"[{min_workers}, {max_workers}] ({decision.reason})")
        if decision.done:
            return decision
        current = decision.workers
    raise AutoscalerError(f"{heuristic!r} made no final decision in {limit} steps; "
                          f"last: {decision.reason if decision else None}")


def settle(heuristic: Heuristic, throughput: Callable[[int], float], min_workers: int,
           max_workers: int, start: int | None = None) -> Decision:
    """The decision trial and error would reach if `throughput` were the true curve.

    Costs no measurement: `throughput(n)` is evaluated instead (a prediction,
    or a known test curve).

    Args:
        heuristic: The heuristic to follow.
        throughput: Examples/s at n workers.
        min_workers: Smallest allowed size.
        max_workers: Largest allowed size.
        start: Where the walk starts (default min_workers).
    """
    start = min_workers if start is None else start
    _check_bounds(min_workers, max_workers, start)
    curve = ScalingCurve()

    def evaluate(n: int) -> None:
        curve.record(n, _throughput(f"throughput({n})", throughput(n)))

    return _walk(heuristic, curve, start, min_workers, max_workers, evaluate)


class _Corrected:
    """A predicted curve corrected by the measurements made so far.

    At a measured size it is the measurement. Elsewhere it is the prediction
    times the measured/predicted ratio r(n), with log r piecewise linear in
    log n through the measured sizes and extended beyond them along the
    nearest segment: locally a power law r(n) ∝ n^β. A constant factor
    would not move a scale-free decision (scaling efficiency compares
    ratios), so the trend β is what moves a wrong knee towards the real one;
    a power law in n (rather than an exponential) keeps that extrapolation
    from overshooting to the far end of the range.
    """

    def __init__(self, predict: Callable[[int], float], curve: ScalingCurve) -> None:
        self._predict = predict
        self._curve = curve
        self._sizes = curve.sizes()
        self._log_ratio = [math.log(curve.throughput(n) / predict(n)) for n in self._sizes]

    def __call__(self, n: int) -> float:
        if n in self._curve:
            return self._curve.throughput(n)
        return self._predict(n) * math.exp(self._log_ratio_at(n))

    def _log_ratio_at(self, n: int) -> float:
        sizes, logs = self._sizes, self._log_ratio
        if not sizes:
            return 0.0
        if len(sizes) == 1:
            return logs[0]
        if n < sizes[0]:
            i = 0
        elif n > sizes[-1]:
            i = len(sizes) - 2
        else:
            i = max(k for k in range(len(sizes) - 1) if sizes[k] <= n)
        x0, x1 = math.log(sizes[i]), math.log(sizes[i + 1])
        return logs[i] + (logs[i + 1] - logs[i]) / (x1 - x0) * (math.log(n) - x0)


class Autoscaler:
    """Finds the number of workers a heuristic settles on, measuring as it goes.

    Args:
        heuristic: The decision rule (`ScalingEfficiency`, `CostUtility`,
            `StragglerReplacement` or your own `Heuristic`).
        min_workers: Smallest allowed size (>= 1).
        max_workers: Largest allowed size (>= min_workers).
        repeats: Measurements per size; the median counts.

    Example:
        >>> scaler = Autoscaler(ScalingEfficiency(0.8), min_workers=1, max_workers=16)
        >>> curve = lambda n: 1000.0 * n / (n + 22)
        >>> scaler.run(curve).num_trials, scaler.run_guided(curve, predict=curve).num_trials
        (6, 3)
    """

    def __init__(self, heuristic: Heuristic, min_workers: int = 1, max_workers: int = 8, *,
                 repeats: int = 1) -> None:
        if not isinstance(heuristic, Heuristic):
            raise AutoscalerError(f"heuristic must be a Heuristic. Received: {heuristic!r}")
        _check_bounds(min_workers, max_workers)
        self.heuristic = heuristic
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.repeats = _positive_int("repeats", repeats)

    def decide(self, curve: ScalingCurve, current: int) -> Decision:
        """One decision on what has been measured (for a controller driving resizes itself)."""
        return self.heuristic.next_size(curve, current, self.min_workers, self.max_workers)

    def _start(self, start: int | None) -> int:
        start = self.min_workers if start is None else start
        _check_bounds(self.min_workers, self.max_workers, start)
        return start

    def _measurer(self, measure: Measure, curve: ScalingCurve,
                  trials: list[ScalingTrial]) -> Callable[[int], None]:
        if not callable(measure):
            raise AutoscalerError(f"measure must be callable. Received: {measure!r}")

        def measure_at(n: int) -> None:
            for _ in range(self.repeats):
                value = measure(n)
                if isinstance(value, Observation):
                    if value.workers != n:
                        raise AutoscalerError(f"measure({n}) returned an Observation of "
                                              f"{value.workers} workers")
                    observation = value
                else:
                    observation = Observation(n, _throughput(f"measure({n})", value))
                curve.add(observation)
                trials.append(ScalingTrial(n, observation.throughput))

        return measure_at

    def run(self, measure: Measure, start: int | None = None) -> ScalingResult:
        """Trial and error: measure, ask the heuristic, move, until it is done.

        Args:
            measure: Throughput (examples/s, or an `Observation` with
                per-worker throughputs) of the job at n workers.
            start: The first size (default min_workers).

        Returns:
            The chosen size and every trial made.
        """
        curve, trials = ScalingCurve(), []
        decision = _walk(self.heuristic, curve, self._start(start), self.min_workers,
                         self.max_workers, self._measurer(measure, curve, trials))
        return ScalingResult(decision.workers, decision, trials, curve, "trial-and-error")

    def run_guided(self, measure: Measure, predict: Callable[[int], float],
                   start: int | None = None, max_rounds: int | None = None) -> ScalingResult:
        """Cost-model-guided search: jump to the predicted choice and confirm it.

        Each round settles the heuristic on the predicted curve corrected by
        every measurement so far (measured sizes count as measured; see
        `settle`) and looks at that target's `Heuristic.support`, i.e. the
        sizes that decide it on the real curve (for a ladder heuristic: the
        target and its two ladder neighbours). If all are measured the
        target is confirmed and returned; otherwise the first unmeasured one
        is measured and the next round re-predicts. A wrong prediction thus
        costs extra rounds, not a wrong answer: the result is always
        confirmed by measurements. After `max_rounds` rounds the search
        falls back to trial and error from the last target, reusing every
        measurement.

        Args:
            measure: As in `run`.
            predict: Predicted throughput at n workers (any scale; only
                its shape and the corrections matter), e.g. from
                `simulator_predictor`.
            start: Where the walk on the predicted curve starts (default
                min_workers), as in `run`.
            max_rounds: Bound on rounds (default: the number of sizes).
        """
        start = self._start(start)
        if not callable(predict):
            raise AutoscalerError(f"predict must be callable. Received: {predict!r}")
        rounds = (self.max_workers - self.min_workers + 1 if max_rounds is None
                  else _positive_int("max_rounds", max_rounds))
        predicted: dict[int, float] = {}

        def prediction(n: int) -> float:
            if n not in predicted:
                predicted[n] = _throughput(f"predict({n})", predict(n))
            return predicted[n]

        curve, trials, targets = ScalingCurve(), [], []
        measure_at = self._measurer(measure, curve, trials)
        target = start
        for _ in range(rounds):
            target = settle(self.heuristic, _Corrected(prediction, curve), self.min_workers,
                            self.max_workers, start).workers
            targets.append(target)
            missing = [n for n in self.heuristic.support(target, self.min_workers,
                                                         self.max_workers) if n not in curve]
            if not missing:
                decision = self.decide(curve, target)
                if decision.done:
                    return ScalingResult(target, decision, trials, curve, "guided", targets)
                break  # a heuristic whose support does not decide: walk from here
            measure_at(missing[0])
        decision = _walk(self.heuristic, curve, target, self.min_workers, self.max_workers,
                         measure_at)
        return ScalingResult(decision.workers, decision, trials, curve, "guided", targets)

    def __repr__(self) -> str:
        return (f"Autoscaler({self.heuristic!r}, min_workers={self.min_workers}, "
                f"max_workers={self.max_workers}, repeats={self.repeats})")


# ------------------------------------------------------------- prediction
def simulator_predictor(graph_item: GraphItem,
                        build: Callable[[GraphItem, ResourceSpec], Strategy], *,
                        global_batch: int, ps: int = 0, bandwidth_gbps: float | None = None,
                        calibration: Calibration | None = None,
                        cost_model: Predictor | None = None,
                        host_cores: int | None = None) -> Callable[[int], float]:
    """A predicted throughput curve from the search's analytic simulator.

    For n workers: the spec `ResourceSpec.local(workers=n, ps=ps,
    bandwidth_gbps=bandwidth_gbps)`, the strategy `build(graph_item, spec)`,
    and the simulator's step time for it at the fixed global batch;
    throughput = global_batch / step time. With `cost_model` (a cost model
    that predicts seconds, e.g. a fitted LightGBM regressor of
    `autodist.search.cost_model`), the step time is that model's prediction
    instead. Predictions are cached per size, in the returned function.

    Args:
        graph_item: The training step.
        build: Strategy for a spec, e.g. `autodist.builders.AllReduce().build`.
        global_batch: Examples per step over all workers (fixed as the job
            resizes); at least the largest n asked for.
        ps: Parameter-server-only tasks in every spec.
        bandwidth_gbps: Bandwidth per task (None: the spec's default).
        calibration: The simulator's machine constants (default `Calibration()`).
        cost_model: What predicts the step time: a cost model that predicts
            seconds (default: the simulator, `SimulatorCostModel()`).
        host_cores: When every worker shares one host with this many cores
            (an emulated cluster), compute slows by n / host_cores beyond
            that many workers (simulator only). None: a host per worker.

    Returns:
        predict(n) -> examples/s.

    Example:
        >>> predict = simulator_predictor(gi, AllReduce().build, global_batch=512,
        ...                               bandwidth_gbps=1.0)        # doctest: +SKIP
        >>> Autoscaler(ScalingEfficiency(), 1, 16).run_guided(measure, predict)  # doctest: +SKIP
    """
    # Imported here: the decision logic above needs none of this.
    from autodist.ir.resource_spec import ResourceSpec
    from autodist.search.cost_model import SimulatorCostModel
    from autodist.search.features import FEATURE_NAMES
    from autodist.search.metrics import CostModelError
    from autodist.search.simulator import Simulator
    from autodist.search.space import SearchSpace, SpaceOptions

    # Only the strategy's own options are scored (encode adds them), so the
    # space is kept lean: a full one holds O(n^2) options per variable and
    # the simulator compiles all of them. Step times and features are the same.
    lean = SpaceOptions(max_shards=1, max_groups=1, allow_local_replication=False)

    global_batch = _positive_int("global_batch", global_batch)
    if host_cores is not None:
        _positive_int("host_cores", host_cores)
    if not callable(build):
        raise AutoscalerError(f"build must be callable (GraphItem, ResourceSpec) -> Strategy. "
                              f"Received: {build!r}")
    if cost_model is None:
        cost_model = SimulatorCostModel()
    try:
        if not cost_model.predicts_seconds:
            raise CostModelError("it predicts no seconds")
        cost_model.check_features(FEATURE_NAMES)
    except (CostModelError, AttributeError) as e:
        raise AutoscalerError(f"cost_model must predict step times: the simulator or a fitted "
                              f"regressor (a ranker's scores are not step times). Received: "
                              f"{cost_model!r} ({e})") from e
    simulated = isinstance(cost_model, SimulatorCostModel)
    cache: dict[int, float] = {}

    def predict(n: int) -> float:
        _positive_int("workers", n)
        if n > global_batch:
            raise AutoscalerError(f"cannot predict {n} workers: more than global_batch "
                                  f"{global_batch} examples per step")
        if n not in cache:
            spec = ResourceSpec.local(workers=n, ps=ps, bandwidth_gbps=bandwidth_gbps)
            strategy = build(graph_item, spec)
            simulator = Simulator(SearchSpace(graph_item, spec, lean), calibration,
                                  batch_size=global_batch)
            prediction = simulator.predict_strategy(strategy)
            step_s = float(cost_model.predict_candidates(
                simulator, simulator.space.encode(strategy)[None, :], prediction)[0])
            if simulated and host_cores is not None and n > host_cores:
                step_s += float(prediction.parts["compute_s"][0]) * (n / host_cores - 1)
            cache[n] = global_batch / _throughput(f"predicted step time at {n} workers",
                                                  step_s)
        return cache[n]

    return predict


# Old names, kept working with a DeprecationWarning that names the new one.
__getattr__ = renamed_names(__name__, globals(), {"Trial": "ScalingTrial"})
