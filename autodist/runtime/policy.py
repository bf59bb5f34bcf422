"""Adaptation policies: code that watches a running `fit` and changes it.

A `Policy` gets hooks (train begin and end, every step, every epoch's end)
with the step's metrics, measured by the workers with the step itself (no
extra synchronization): the global loss, the chief's step time and the
throughput it implies, the number of workers, and, with `monitor_every`,
the gradient noise scale and the per-example gradient variance tr(Σ)
(`autodist.kernels.monitoring`). Through its `Control` a policy asks for
actions: resize to n workers, switch the strategy (a given one, a new search
for the current cluster, or another compressor), or stop.

Every action goes through the run's membership protocol
(`autodist.runtime.follow`): all workers apply it at the same step. One
asked for in `on_epoch_end` starts exactly at the next epoch's first step;
one asked for in `on_step_end` starts one step ahead of the chief (the
driver learns of steps after they ran, so a few steps after the one the
policy saw). Synchronous strategies keep their numbers through every action.

    run = autodist.distribute(model, strategy.with_virtual_nodes(256, 8), spec)
    run.fit(x, y, epochs=5, policies=[ScheduledResize({100: 2, 300: 4}),
                                      ThroughputReplan(fraction=0.7)])
"""
from __future__ import annotations

import dataclasses
import math
import queue
import statistics
import threading
from typing import Any, Callable, Mapping, Sequence

from autodist.ir.errors import AutodistError
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.kernels import monitoring


@dataclasses.dataclass(frozen=True)
class StepMetrics:
    """What the workers measured in one step.

    Attributes:
        step: The step's index over the whole run (from 0).
        epoch: Its epoch.
        loss: The global loss of the step.
        seconds: The chief's time of the step.
        examples_per_s: Examples of the step over `seconds`.
        workers: Workers that ran the step.
        plan: The strategy that ran it (0: the run's; k: the k-th switched to).
        noise_scale: On monitored steps, the smoothed estimates
            (`monitoring.NoiseScale`: |G|², tr(Σ) and their ratio B_noise);
            None otherwise.
        gradient_variance: On monitored steps, this step's tr(Σ), the
            per-example gradient variance summed over parameters.
        compute_s: On monitored steps, the slowest task's local compute
            (forward and backward of its virtual nodes), measured in the graph.
        communication_s: On monitored steps, the rest of the step:
            `seconds - compute_s` (synchronization, waiting, the update).
    """

    step: int
    epoch: int
    loss: float
    seconds: float
    examples_per_s: float
    workers: int
    plan: int = 0
    noise_scale: monitoring.NoiseScale | None = None
    gradient_variance: float | None = None
    compute_s: float | None = None
    communication_s: float | None = None


class Policy:
    """Base class of adaptation policies; override the hooks you need.

    Hooks run in the driver (the process that called `fit`), in step order,
    between the steps the workers run, so they should be quick.
    """

    def on_train_begin(self, control: Control) -> None:
        """Before the first step's metrics arrive."""

    def on_step_end(self, metrics: StepMetrics, control: Control) -> None:
        """After every step, with what the workers measured in it."""

    def on_epoch_end(self, epoch: int, logs: Mapping[str, float], control: Control) -> None:
        """After an epoch's last step; actions start at the next epoch's first step."""

    def on_train_end(self, control: Control) -> None:
        """After the last step."""


Replanner = Callable[[GraphItem, ResourceSpec, Strategy], Strategy]


class Control:
    """What a policy can see of a running fit, and the actions it can ask for.

    Args:
        run: The `DistributedRun` whose fit is running.
        global_batch_size: Examples per step.
        replanner: How `replan()` without a strategy finds one: called with
            the GraphItem, the spec (its bandwidths possibly scaled, see
            `replan`) and the current strategy (default: the search's
            tuner ranked by the simulator or the shipped cost model).
    """

    def __init__(self, run, global_batch_size: int, replanner: Replanner | None = None) -> None:
        self.run = run
        self.global_batch_size = global_batch_size  # the latest asked for
        self.initial_batch_size = global_batch_size
        self.replanner = replanner or search_replanner
        self.strategy: Strategy = run.strategy
        self.workers: int = run.resource_spec.num_worker_tasks
        self.metrics: list[StepMetrics] = []
        self.actions: list[dict[str, Any]] = []
        self.stop_requested = False

    @property
    def step(self) -> int:
        """The last step the driver has seen (-1 before the first)."""
        return self.metrics[-1].step if self.metrics else -1

    @property
    def max_workers(self) -> int:
        return self.run.resource_spec.num_worker_tasks

    def resize(self, workers: int, reason: str = "") -> None:
        """Runs on worker tasks 0..workers-1 from the next step boundary all meet."""
        if workers == self.workers:
            return
        self.run.resize(workers)
        self.workers = workers
        self.log("resize", workers=workers, reason=reason)

    def replan(self, strategy: Strategy | None = None, *, bandwidth_scale: float = 1.0,
               reason: str = "") -> Strategy:
        """Switches every worker to `strategy`, or to a new search's pick.

        Args:
            strategy: The strategy to switch to (synchronous, same replicas
                and virtual nodes). None: ask the replanner for the current
                cluster, with every node's bandwidth multiplied by
                `bandwidth_scale` (e.g. the measured slowdown of a link).
            bandwidth_scale: See `strategy`.
            reason: Recorded with the action.

        Returns:
            The strategy switched to (the current one when nothing changes).
        """
        if strategy is None:
            spec = scaled_bandwidth(self.run.resource_spec, bandwidth_scale)
            strategy = _same_batch(self.replanner(self.run.graph_item, spec, self.strategy),
                                   self.strategy)
        if _same_plan(strategy, self.strategy):
            self.log("replan", changed=False, reason=reason)
            return self.strategy
        self.run.replan(strategy)
        self.strategy = strategy
        self.log("replan", changed=True, reason=reason)
        return strategy

    def set_compressor(self, compressor: str, variables: Sequence[str] | None = None,
                       reason: str = "") -> Strategy:
        """Switches the all-reduced dense variables (or `variables`) to `compressor`."""
        strategy = self.strategy.with_compressor(compressor, variables)
        return self.replan(strategy, reason=reason or f"compressor {compressor}")

    def set_batch_size(self, global_batch_size: int, *, learning_rate_rule: str = "linear",
                       num_virtual_nodes: int | None = None, reason: str = "") -> Strategy:
        """Trains with another global batch from the next epoch's first step.

        The current strategy gets the new batch (`with_virtual_nodes`, same
        virtual nodes and mapping unless `num_virtual_nodes` is given) and a
        learning rate scaled from the optimizer's own by the batch's growth
        over the fit's first batch: "linear" (Goyal et al.), "sqrt" or
        "none". Later epochs have ceil(examples / batch) steps.

        Raises:
            AutodistError: an unknown rule, or a batch that is not a positive
                multiple of the virtual nodes.
        """
        rules = {"linear": lambda r: r, "sqrt": math.sqrt, "none": lambda r: 1.0}
        if learning_rate_rule not in rules:
            raise AutodistError(f"learning_rate_rule must be one of {sorted(rules)}. "
                                f"Received: {learning_rate_rule!r}")
        current = self.strategy
        nodes = num_virtual_nodes or current.num_virtual_nodes
        if not isinstance(global_batch_size, int) or global_batch_size < 1 or \
                global_batch_size % nodes:
            raise AutodistError(f"set_batch_size needs a positive multiple of the {nodes} "
                                f"virtual nodes. Received: {global_batch_size!r}")
        if global_batch_size == self.global_batch_size:
            return current
        devices = current.virtual_node_devices if nodes == current.num_virtual_nodes else None
        strategy = current.with_virtual_nodes(global_batch_size, nodes, devices)
        base = self.run.graph_item.optimizer.hyperparameters.get("learning_rate")
        schedule = self.run.graph_item.optimizer.learning_rate_schedule.class_name
        if schedule and learning_rate_rule != "none":
            raise AutodistError(f"learning_rate_rule={learning_rate_rule!r} scales a fixed "
                                f"learning rate, but the optimizer's is a schedule ({schedule}); "
                                "pass learning_rate_rule='none' or build the batch growth "
                                "into the schedule")
        if base is not None:
            factor = rules[learning_rate_rule](global_batch_size / self.initial_batch_size)
            strategy = strategy.with_hyperparameters(learning_rate=base * factor)
        self.run.replan(strategy)
        self.strategy = strategy
        self.log("set_batch_size", global_batch_size=global_batch_size,
                 learning_rate=strategy.hyperparameters.get("learning_rate"),
                 reason=reason)
        self.global_batch_size = global_batch_size
        return strategy

    def stop(self, reason: str = "") -> None:
        """Stops every worker at the next step boundary all meet."""
        self.stop_requested = True
        self.log("stop", reason=reason)

    def log(self, action: str, **details: Any) -> None:
        """Records an action (or an event) in `actions` (History.actions)."""
        self.actions.append({"step": self.step, "action": action, **details})


def search_replanner(graph_item: GraphItem, spec: ResourceSpec, current: Strategy) -> Strategy:
    """The search's pick for `spec` (simulator or shipped cost model, no trials)."""
    from autodist.search.tuner import Tuner  # pylint: disable=import-outside-toplevel

    batch = current.global_batch_size
    return Tuner(graph_item, spec, batch_size=batch, search_budget=2000).tune(0).strategy


def scaled_bandwidth(spec: ResourceSpec, scale: float) -> ResourceSpec:
    """`spec` with every node's bandwidth multiplied by `scale` (unknown stays unknown)."""
    if not scale > 0 or math.isinf(scale):
        raise AutodistError(f"bandwidth_scale must be a positive number. Received: {scale!r}")
    if scale == 1.0:
        return spec
    proto = spec.proto.__class__()
    proto.CopyFrom(spec.proto)
    for node in proto.nodes:
        if node.network_bandwidth_gbps:
            node.network_bandwidth_gbps *= scale
    return ResourceSpec(proto)


def _same_plan(a: Strategy, b: Strategy) -> bool:
    """Whether two strategies distribute the same way (ids and predictions aside)."""
    return a.proto.graph_config == b.proto.graph_config and \
        list(a.proto.variables) == list(b.proto.variables)


def _same_batch(strategy: Strategy, like: Strategy) -> Strategy:
    """`strategy` with the virtual nodes and hyper-parameter overrides of `like`."""
    if like.global_batch_size is not None:
        strategy = strategy.with_virtual_nodes(like.global_batch_size, like.num_virtual_nodes)
    return strategy.with_hyperparameters(**like.hyperparameters)


# ------------------------------------------------------------- built-ins
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

    The autoscaler's search runs in a helper thread that waits for the
    measurements this policy collects from the steps; every wait is bounded
    by `trial_timeout_s`, and the thread ends with the fit.

    Args:
        autoscaler: The decision logic (sizes within the spec's workers).
        predict: Predicted throughput at n workers, for the guided mode.
        window: Steps measured per trial.
        warmup: Steps skipped after each resize.
        trial_timeout_s: Bound on one trial.
    """

    def __init__(self, autoscaler, predict: Callable[[int], float] | None = None, *,
                 window: int = 5, warmup: int = 2, trial_timeout_s: float = 600.0) -> None:
        if window < 1 or warmup < 0:
            raise AutodistError(f"window must be >= 1 and warmup >= 0. Received: "
                                f"{window!r}, {warmup!r}")
        self.autoscaler, self.predict = autoscaler, predict
        self.window, self.warmup, self.trial_timeout_s = window, warmup, trial_timeout_s
        self.result = None
        self.error: BaseException | None = None
        self._requests: queue.Queue = queue.Queue()
        self._answers: queue.Queue = queue.Queue()
        self._ended = threading.Event()
        self._thread: threading.Thread | None = None
        self._trial: int | None = None  # the size being measured
        self._samples: list[float] = []
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
        if len(self._samples) >= self.window:
            self._answers.put(statistics.median(self._samples))
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
            control.resize(value, reason="autoscaler trial")
        else:
            self._settled = True
            if kind == "done":
                self.result = value
                control.log("autoscaled", workers=value.workers, trials=value.num_trials,
                            reason=value.decision.reason)
                control.resize(value.workers, reason="autoscaler's choice")
            else:
                self.error = value
                control.log("autoscale_failed", reason=str(value))

    def _search(self, start: int) -> None:
        def measure(workers: int) -> float:
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
        except Exception as e:  # pylint: disable=broad-except
            # Reported to the driver's thread, which records it.
            self._requests.put(("failed", e))


class _FitEnded(Exception):
    """The fit ended before the autoscaler's search did."""


class PolicyDriver:
    """Runs the policies of one fit from the chief's progress records (driver side).

    Args:
        control: The fit's Control.
        policies: The policies, called in order.
        steps_per_epoch: Steps of one epoch.
        noise_decay: Smoothing of the noise scale (see `SmoothedNoiseScale`).
    """

    def __init__(self, control: Control, policies: Sequence[Policy], steps_per_epoch: int,
                 noise_decay: float = 0.9) -> None:
        for policy in policies:
            if not isinstance(policy, Policy):
                raise AutodistError(f"policies must be autodist Policy objects. "
                                    f"Received: {policy!r}")
        self.control = control
        self.policies = list(policies)
        self.steps_per_epoch = steps_per_epoch
        self._noise = monitoring.SmoothedNoiseScale(noise_decay)

    def begin(self) -> None:
        for policy in self.policies:
            policy.on_train_begin(self.control)

    def step(self, record: Mapping[str, Any]) -> None:
        """One progress record (a step's global loss, time, workers, monitor)."""
        epoch, in_epoch = int(record["epoch"]), int(record["step"])
        seconds = float(record["time"])
        examples = int(record.get("examples", self.control.global_batch_size))
        smoothed = variance = compute = communication = None
        if record.get("monitor", {}).get("compute_s"):
            compute = max(record["monitor"]["compute_s"])
            communication = max(0.0, seconds - compute)
        if "monitor" in record:
            estimate = monitoring.noise_scale_fit(record["monitor"]["batches"],
                                                  record["monitor"]["sq_norms"])
            if estimate is not None:
                smoothed = self._noise.update(estimate)
                variance = estimate.trace_sigma
        metrics = StepMetrics(
            step=epoch * self.steps_per_epoch + in_epoch, epoch=epoch,
            loss=float(record["loss"]), seconds=seconds,
            examples_per_s=examples / seconds if seconds > 0 else 0.0,
            workers=int(record.get("workers", self.control.workers)),
            plan=int(record.get("plan", 0)), noise_scale=smoothed, gradient_variance=variance,
            compute_s=compute, communication_s=communication)
        self.control.metrics.append(metrics)
        for policy in self.policies:
            policy.on_step_end(metrics, self.control)

    def epoch_end(self, epoch: int, logs: Mapping[str, float]) -> None:
        for policy in self.policies:
            policy.on_epoch_end(epoch, logs, self.control)

    def end(self) -> None:
        for policy in self.policies:
            policy.on_train_end(self.control)
