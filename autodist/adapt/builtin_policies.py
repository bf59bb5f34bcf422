"""Built-in adaptation policies: scheduled resizes, re-plans on slowdowns, adaptive batch,
autoscaling.

Each is a `Policy` (`autodist.adapt.policy_interface`) that asks for actions
through its `Control`; `fit(..., policies=[...])` runs them. The base classes are
re-exported here, so ``autodist.policies`` is the one module a user needs:

    from autodist import policies
    run.fit(x, y, epochs=5, policies=[policies.ScheduledResize({100: 2}),
                                      policies.ThroughputReplan(fraction=0.7)])
"""
from __future__ import annotations

import math
import queue
import statistics
import threading
from typing import Callable, Mapping

from autodist.adapt.autoscaler import Observation
from autodist.adapt.policy_interface import (Control, Policy, Replanner, StepMetrics,
                                             scaled_bandwidth, search_replanner)
from autodist.ir.errors import AutodistError

__all__ = ["AdaptiveBatchSize", "Autoscale", "Control", "Policy", "Replanner",
           "ScheduledResize", "StepMetrics", "ThroughputReplan", "scaled_bandwidth",
           "search_replanner"]


class ScheduledResize(Policy):
    """Resizes at given steps: {step: workers}.

    Applied when the driver sees the step before it (at an epoch's end,
    exactly at it; inside an epoch, within a few steps of it).
    """

    def __init__(self, schedule: Mapping[int, int]) -> None:
        for step, workers in schedule.items():
            if int(step) < 0 or not isinstance(workers, int) or workers < 1:
                raise AutodistError("ScheduledResize needs {step >= 0: workers >= 1}. "
                                    f"Received: {dict(schedule)!r}")
        self.schedule = dict(sorted((int(k), v) for k, v in schedule.items()))
        self._done: set[int] = set()

    def on_train_begin(self, control: Control) -> None:
        self._apply(0, control)

    def on_step_end(self, metrics: StepMetrics, control: Control) -> None:
        self._apply(metrics.step + 1, control)

    def _apply(self, next_step: int, control: Control) -> None:
        due = [s for s in self.schedule if s <= next_step and s not in self._done]
        if due:
            self._done.update(due)
            control.resize(self.schedule[max(due)], reason=f"scheduled at step {max(due)}")


class ThroughputReplan(Policy):
    """Re-plans when throughput drops below `fraction` of its reference.

    The reference is the median examples/s of the `window` steps after
    `warmup` steps of a membership (a new size or strategy starts a new
    reference). When the median of the last `window` steps falls below
    `fraction` of it, the policy re-runs the search for the cluster with its
    bandwidth scaled by the measured drop (the cost of a slowed link) and
    switches to the pick if it differs.

    Args:
        fraction: Throughput below this fraction of the reference triggers.
        window: Steps whose median is compared.
        warmup: Steps skipped after a change (new programs warm up).
        max_replans: Bound on re-plans in one fit.
    """

    def __init__(self, fraction: float = 0.7, window: int = 5, warmup: int = 3,
                 max_replans: int = 3) -> None:
        if not 0 < fraction < 1:
            raise AutodistError(f"fraction must be in (0, 1). Received: {fraction!r}")
        if window < 1 or warmup < 0 or max_replans < 0:
            raise AutodistError(f"window >= 1, warmup >= 0 and max_replans >= 0 are needed. "
                                f"Received: {window!r}, {warmup!r}, {max_replans!r}")
        self.fraction, self.window, self.warmup = fraction, window, warmup
        self.max_replans = max_replans
        self.reference: float | None = None
        self.replans = 0
        self._recent: list[float] = []
        self._membership: tuple[int, int] | None = None
        self._skip = 0

    def on_step_end(self, metrics: StepMetrics, control: Control) -> None:
        membership = (metrics.workers, metrics.plan)
        if membership != self._membership:
            self._membership, self.reference, self._recent = membership, None, []
            self._skip = self.warmup
        if self._skip:
            self._skip -= 1
            return
        self._recent = (self._recent + [metrics.examples_per_s])[-self.window:]
        if len(self._recent) < self.window:
            return
        current = statistics.median(self._recent)
        if self.reference is None:
            self.reference = current
            return
        if current < self.fraction * self.reference and self.replans < self.max_replans:
            self.replans += 1
            drop = current / self.reference
            control.replan(bandwidth_scale=drop,
                           reason=f"throughput {current:.0f}/s < {self.fraction:g} x "
                                  f"reference {self.reference:.0f}/s")
            # Whether or not the strategy changed, measure afresh.
            self.reference, self._recent, self._skip = None, [], self.warmup


class AdaptiveBatchSize(Policy):
    """Moves the global batch toward the gradient noise scale, at epochs' ends.

    The gradient noise scale B_noise = tr(Σ)/|G|² (measured inside the
    steps with `fit(..., monitor_every=k)`, smoothed) is the batch size
    beyond which larger batches stop paying off (McCandlish et al., 2018).
    At each epoch's end the policy takes the latest smoothed estimate,
    rounds it down to a multiple of the virtual nodes, clips it to
    [min_batch, max_batch], and switches to it (with the learning-rate
    rule) when it differs from the current batch by at least `factor`.

    Args:
        min_batch: Smallest batch.
        max_batch: Largest batch.
        factor: Hysteresis: act only when the target is this many times
            larger or smaller than the current batch (> 1).
        learning_rate_rule: See `Control.set_batch_size`.
    """

    def __init__(self, min_batch: int, max_batch: int, factor: float = 1.5,
                 learning_rate_rule: str = "linear") -> None:
        if not 1 <= min_batch <= max_batch or not factor > 1:
            raise AutodistError(f"AdaptiveBatchSize needs 1 <= min_batch <= max_batch and "
                                f"factor > 1. Received: {min_batch!r}, {max_batch!r}, "
                                f"{factor!r}")
        self.min_batch, self.max_batch, self.factor = min_batch, max_batch, factor
        self.learning_rate_rule = learning_rate_rule
        self.estimate: float | None = None

    def on_step_end(self, metrics: StepMetrics, control: Control) -> None:
        if metrics.noise_scale is not None and math.isfinite(metrics.noise_scale.noise_scale):
            self.estimate = metrics.noise_scale.noise_scale

    def on_epoch_end(self, epoch: int, logs: Mapping[str, float], control: Control) -> None:
        if self.estimate is None:
            return
        nodes = control.strategy.num_virtual_nodes
        low = -(-self.min_batch // nodes) * nodes
        high = self.max_batch // nodes * nodes
        target = min(max(int(self.estimate) // nodes * nodes, low), high)
        current = control.global_batch_size
        if target >= current * self.factor or target * self.factor <= current:
            control.set_batch_size(target, learning_rate_rule=self.learning_rate_rule,
                                   reason=f"noise scale {self.estimate:.0f}")


class Autoscale(Policy):
    """Finds the run's efficient number of workers while it trains, then stays there.

    An `autoscaler.Autoscaler` (its heuristic: scaling efficiency, cost /
    utility, ...) chooses which sizes to try; each trial resizes the run in
    place and measures the median examples/s of `window` steps after
    `warmup` steps at that size. With `predict` (e.g.
    `autoscaler.simulator_predictor`, the search's cost model of the
    scaling curve) the guided mode jumps to the predicted efficient size
    and confirms it, needing fewer trials. The run ends on the chosen size;
    `result` holds the trials.

    With `replan_on_resize`, every resize also switches to a fresh plan for
    the new members (`Control.replan()`: the replanner on the spec
    restricted to them), through the strategy-switch path, so the global
    batch and the virtual nodes, hence the trajectory, stay.

    When the steps' metrics carry per-worker throughputs
    (`StepMetrics.per_worker`), each trial's observation has their medians,
    and a final decision that lists workers to replace
    (`autoscaler.StragglerReplacement`) takes them out of the run, swapping
    in idle workers of the spec where there are any (`Control.replace`;
    the chief is never taken out, that is logged).

    Its resizes go through the run's task provider (`Control.resize`): a trial
    that would grow onto more tasks than the provider has available (under
    launch="remote", slots whose `autodist serve` answers) is refused, and
    the search ends there, at the run's current size ("resize_refused" and
    "autoscale_failed" in the actions).

    The autoscaler's search runs in a helper thread that waits for the
    measurements this policy collects from the steps; every wait is bounded
    by `trial_timeout_s`, and the thread ends with the fit.

    Args:
        autoscaler: The decision logic (sizes within the spec's workers).
        predict: Predicted throughput at n workers, for the guided mode.
        window: Steps measured per trial.
        warmup: Steps skipped after each resize.
        trial_timeout_s: Bound on one trial.
        replan_on_resize: Re-plan for the new members at every resize.
    """

    def __init__(self, autoscaler, predict: Callable[[int], float] | None = None, *,
                 window: int = 5, warmup: int = 2, trial_timeout_s: float = 600.0,
                 replan_on_resize: bool = False) -> None:
        if window < 1 or warmup < 0:
            raise AutodistError(f"window must be >= 1 and warmup >= 0. Received: "
                                f"{window!r}, {warmup!r}")
        self.autoscaler, self.predict = autoscaler, predict
        self.window, self.warmup, self.trial_timeout_s = window, warmup, trial_timeout_s
        self.replan_on_resize = replan_on_resize
        self.result = None
        self.error: BaseException | None = None
        self._requests: queue.Queue = queue.Queue()
        self._answers: queue.Queue = queue.Queue()
        self._ended = threading.Event()
        self._thread: threading.Thread | None = None
        self._trial: int | None = None  # the size being measured
        self._samples: list[float] = []
        self._per_worker: dict[int, list[float]] = {}
        self._skip = 0
        self._settled = False

    def on_train_begin(self, control: Control) -> None:
        if self.autoscaler.max_workers > control.max_workers:
            raise AutodistError(f"the autoscaler may choose up to {self.autoscaler.max_workers} "
                                f"workers; the spec has {control.max_workers}")
        self._thread = threading.Thread(target=self._search, args=(control.workers,),
                                        daemon=True, name="autodist-autoscale")
        self._thread.start()

    def on_step_end(self, metrics: StepMetrics, control: Control) -> None:
        if self._settled:
            return
        if self._trial is None:
            self._next(control)
            return
        if metrics.workers != self._trial:
            return  # the resize has not started yet
        if self._skip:
            self._skip -= 1
            return
        self._samples.append(metrics.examples_per_s)
        for task, value in metrics.per_worker.items():
            self._per_worker.setdefault(task, []).append(value)
        if len(self._samples) >= self.window:
            per_worker = {t: statistics.median(v) for t, v in self._per_worker.items()}
            self._answers.put(Observation(self._trial, statistics.median(self._samples),
                                          per_worker))
            self._trial = None
            self._next(control)

    def on_train_end(self, control: Control) -> None:
        self._ended.set()
        self._answers.put(None)
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _next(self, control: Control) -> None:
        """Takes the search's next request: a size to measure, or its result."""
        try:
            kind, value = self._requests.get(timeout=self.trial_timeout_s)
        except queue.Empty:
            raise AutodistError(f"the autoscaler did not ask for a size within "
                                f"{self.trial_timeout_s:g}s") from None
        if kind == "measure":
            self._trial, self._samples, self._skip = value, [], self.warmup
            self._per_worker = {}
            if not control.resize(value, reason="autoscaler trial",
                                  replan=self.replan_on_resize):
                # No tasks to grow onto (the provider's reason is logged): the search
                # ends, and the run stays at its size.
                self._settled, self._trial = True, None
                self._answers.put(None)
                control.log("autoscale_failed", reason=f"could not resize to {value} workers "
                                                       "for a trial")
        else:
            self._settled = True
            if kind == "done":
                self.result = value
                control.log("autoscaled", workers=value.workers, trials=value.num_trials,
                            reason=value.decision.reason)
                control.resize(value.workers, reason="autoscaler's choice",
                               replan=self.replan_on_resize)
                if value.replace:
                    control.replace(value.replace, reason=value.decision.reason,
                                    replan=self.replan_on_resize)
            else:
                self.error = value
                control.log("autoscale_failed", reason=str(value))

    def _search(self, start: int) -> None:
        def measure(workers: int) -> Observation:
            self._requests.put(("measure", workers))
            answer = self._answers.get(timeout=self.trial_timeout_s)
            if answer is None or self._ended.is_set():
                raise _FitEnded()
            return answer

        try:
            if self.predict is None:
                result = self.autoscaler.run(measure, start=start)
            else:
                result = self.autoscaler.run_guided(measure, self.predict, start=start)
            self._requests.put(("done", result))
        except _FitEnded:
            pass
        except Exception as e:  # noqa: BLE001
            # Reported to the driver's thread, which records it.
            self._requests.put(("failed", e))


class _FitEnded(Exception):
    """The fit ended before the autoscaler's search did."""


