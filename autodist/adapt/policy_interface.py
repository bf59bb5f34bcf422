"""The policy interface: what a policy sees of a running `fit` and how it changes it.

A `Policy` gets hooks (train begin and end, every step, every epoch's end)
with the step's metrics, measured by the workers with the step itself (no
extra synchronization): the global loss, the chief's step time and the
throughput it implies, the number of workers, and, with `monitor_every`,
the gradient noise scale and the per-example gradient variance tr(Σ)
(`autodist.kernels.monitoring`). Through its `Control` a policy asks for
actions: resize to n workers or to given worker tasks, replace stragglers,
switch the strategy (a given one, a new search for the current members, or
another compressor), or stop.

Every action goes through the run's membership protocol
(`autodist.runtime.follow`): all workers apply it at the same step. One
asked for in `on_epoch_end` starts exactly at the next epoch's first step;
one asked for in `on_step_end` starts one step ahead of the chief (the
driver learns of steps after they ran, so a few steps after the one the
policy saw). Synchronous strategies keep their numbers through every action.

The built-in policies are in `autodist.adapt.builtin_policies` (``autodist.policies``):

    run = autodist.distribute(model, strategy.with_virtual_nodes(256, 8), spec)
    run.fit(x, y, epochs=5, policies=[ScheduledResize({100: 2, 300: 4}),
                                      ThroughputReplan(fraction=0.7)])
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

from autodist.adapt.members import lift, member_spec
from autodist.adapt.task_providers import TaskProviderError
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
        per_worker: On monitored steps, each member worker's examples over
            its local compute time, by task index (a straggler shows as a
            low value); else empty.
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
    per_worker: Mapping[int, float] = dataclasses.field(default_factory=dict)
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
            the GraphItem, the spec of the current members (PS-only nodes
            kept, bandwidths possibly scaled, see `replan`) and the current
            strategy (default: the search's tuner ranked by the simulator or
            the shipped cost model).
    """

    def __init__(self, run, global_batch_size: int, replanner: Replanner | None = None) -> None:
        self.run = run
        self.global_batch_size = global_batch_size  # the latest asked for
        self.initial_batch_size = global_batch_size
        self.replanner = replanner or search_replanner
        self.strategy: Strategy = run.strategy
        # The member worker tasks last asked for.
        self.members: tuple[int, ...] = tuple(range(run.resource_spec.num_worker_tasks))
        self.metrics: list[StepMetrics] = []
        self.actions: list[dict[str, Any]] = []
        self.stop_requested = False

    @property
    def step(self) -> int:
        """The last step the driver has seen (-1 before the first)."""
        return self.metrics[-1].step if self.metrics else -1

    @property
    def workers(self) -> int:
        """How many member workers were last asked for."""
        return len(self.members)

    @property
    def max_workers(self) -> int:
        return self.run.resource_spec.num_worker_tasks

    def resize(self, workers: int | Sequence[int], reason: str = "",
               replan: bool = False) -> bool:
        """Runs on other workers from the next step boundary all meet.

        A grow to n workers takes the tasks the run's task provider has
        available (`DistributedRun.task_provider`; under launch="remote",
        slots whose `autodist serve` answers). Where it has too few, the
        request is refused: logged as a "resize_refused" action with the
        provider's reason, and the run goes on with its members.

        Args:
            workers: A number n (the current members grown or shrunk to n:
                see `DistributedRun.resize`) or the worker tasks to run on,
                with the chief (task 0).
            reason: Recorded with the action.
            replan: Also switch to a fresh plan for the new members
                (`replan()`), from the same step boundary or the next.

        Returns:
            False when the request was refused, else True.
        """
        if workers in (self.workers, list(self.members), self.members):
            return True
        try:
            self.members = tuple(self.run.resize(workers))
        except TaskProviderError as e:
            self.log("resize_refused", workers=workers, members=list(self.members),
                     reason=f"{reason}: {e}" if reason else str(e))
            return False
        self.log("resize", workers=self.workers, members=list(self.members), reason=reason)
        if replan:
            self.replan(reason=f"new members {list(self.members)}")
        return True

    def replace(self, tasks: Sequence[int], reason: str = "", replan: bool = False) -> None:
        """Takes the workers `tasks` out of the run (stragglers), swapping in spares.

        Each member in `tasks` leaves; for each, an idle worker task the
        run's task provider has available (not in `tasks`; under
        launch="remote" only slots whose `autodist serve` answers), if any,
        joins in its place. The
        chief (task 0) holds the run's state and never leaves: it is logged
        ("keep_chief") and kept.

        Args:
            tasks: Worker task indices, e.g. `Decision.replace`.
            reason: Recorded with the action.
            replan: Also switch to a fresh plan for the new members.
        """
        if 0 in tasks:
            self.log("keep_chief", reason="the chief (worker 0) was flagged but holds the "
                                          "run's state and cannot leave")
        leaving = [t for t in self.members if t in tasks and t != 0]
        if not leaving:
            return
        spares = [t for t in self.run.task_provider.available(self.members) if t not in tasks]
        joining = spares[:len(leaving)]
        members = sorted(set(self.members) - set(leaving) | set(joining))
        self.resize(members, reason=reason or f"replace workers {leaving} with {joining}",
                    replan=replan)

    def replan(self, strategy: Strategy | None = None, *, bandwidth_scale: float = 1.0,
               reason: str = "") -> Strategy:
        """Switches every worker to `strategy`, or to a new search's pick.

        Args:
            strategy: The strategy to switch to (synchronous, same replicas
                and virtual nodes). None: ask the replanner for the current
                members (the spec restricted to them,
                `autodist.adapt.members`), with every node's bandwidth
                multiplied by `bandwidth_scale` (e.g. the measured slowdown
                of a link); the plan is lifted back to the whole spec with
                the run's global batch and virtual nodes.
            bandwidth_scale: See `strategy`.
            reason: Recorded with the action.

        Returns:
            The strategy switched to (the current one when nothing changes).
        """
        if strategy is None:
            spec = scaled_bandwidth(member_spec(self.run.resource_spec, self.members),
                                    bandwidth_scale)
            strategy = lift(self.replanner(self.run.graph_item, spec, self.strategy),
                            self.members, self.strategy, self.run.resource_spec)
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
    from autodist.search.tuner import Tuner

    batch = current.global_batch_size
    return Tuner(graph_item, spec, batch_size=batch, search_budget=2000).tune(0).strategy


def scaled_bandwidth(spec: ResourceSpec, scale: float) -> ResourceSpec:
    """`spec` with every node's bandwidth multiplied by `scale` (unknown stays unknown)."""
    if not scale > 0 or math.isinf(scale):
        raise AutodistError(f"bandwidth_scale must be a positive number. Received: {scale!r}")
    if scale == 1.0:
        return spec
    return spec.with_bandwidth_scaled(scale)


def _same_plan(a: Strategy, b: Strategy) -> bool:
    """Whether two strategies distribute the same way (ids and predictions aside)."""
    return a.distributes_like(b)

