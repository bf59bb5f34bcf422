"""DistributedRun: train a Keras model with a Strategy on a cluster, Keras-like."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import sys
import tempfile
import uuid
from typing import Any, Mapping, Sequence

import numpy as np

from autodist.ir.errors import AutodistError
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.kernels import monitoring
from autodist.kernels.optimizers import check_supported as check_optimizer
from autodist.runtime import checkpoint, datasets
from autodist.runtime import targets as targets_
from autodist.runtime import data as batching
from autodist.runtime import follow, recovery
from autodist.runtime.elastic import check_elastic, check_switch, segments
from autodist.runtime.policy import Control, Policy, PolicyDriver, Replanner
from autodist.runtime.job import JobDir, RunConfig
from autodist.runtime.launcher import LocalCluster, TaskFailedError, check_local
from autodist.runtime.remote import RemoteCluster, check_this_is_the_chief

LAUNCH_MODES = ("local", "remote")
_HOOKS = ("set_model", "set_params", "on_train_begin", "on_epoch_begin", "on_train_batch_begin",
          "on_train_batch_end", "on_epoch_end", "on_train_end")


@dataclasses.dataclass
class History:
    """What `fit` returns.

    Attributes:
        history: {"loss": [mean loss of each epoch, over examples]}, as Keras' History
            (an epoch cut short by a stop request counts with the steps it ran).
        step_losses: The global loss of every step (weighted over replicas).
        step_times: The chief's time of every step, in seconds.
        epoch: Epoch indices.
        max_lead: Per worker task, the most steps it started ahead of the
            slowest task (asynchronous and bounded-staleness runs; 0 otherwise).
        resizes: Elastic runs and strategy switches: per membership change,
            {"step": first step of the new membership, "workers": its size,
            "plan": its strategy (0: the run's, k: the k-th switched to), "seconds": the
            chief's time from the end of the previous step to the start of
            that step (state hand-over, new program and session)}.
        noise_scale: Runs with `monitor_every`: per monitored step, {"step",
            "gradient_sq" (|G|²), "trace_sigma" (tr Σ, the per-example
            gradient variance), "noise_scale" (their ratio), "smoothed" (the
            ratio of their moving averages, decay 0.9), "compute_s" (the
            slowest task's local forward and backward, timed in the graph)
            and "communication_s" (the rest of the chief's step time)}.
        actions: Runs with policies: each action a policy asked for,
            {"step": the last step the driver had seen, "action": "resize",
            "replan" or "stop", and its details and reason}.
        recoveries: Runs with `on_failure="continue"`: per failure, {"step":
            the step the job resumed at, "failed_task": the dead worker's
            task index at that time, "workers": workers after it,
            "estimated_loss_steps": steps whose global loss is the chief's
            estimate (its replicas' mean loss), because the dead worker
            completed them but died before recording its loss}.
    """

    history: dict[str, list[float]]
    step_losses: list[float]
    step_times: list[float]
    epoch: list[int]
    max_lead: list[int] = dataclasses.field(default_factory=list)
    resizes: list[dict[str, float]] = dataclasses.field(default_factory=list)
    recoveries: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    noise_scale: list[dict[str, float]] = dataclasses.field(default_factory=list)
    actions: list[dict[str, Any]] = dataclasses.field(default_factory=list)


class DistributedRun:
    """A Keras model, a Strategy and a ResourceSpec, ready to train.

    Args:
        model: A compiled Keras 3 model. Trained weights are written back to it.
        strategy: How to distribute it (validated against the model here).
        resource_spec: The cluster; local specs are launched as processes.
        graph_item: The model's capture, if already made.
        job_dir: Where job files and task logs go (default: a new temp dir,
            removed after a successful fit).
        step_timeout_s: Bound on one step of any task (no hang).
        startup_timeout_s: Bound on the cluster coming up.
        task_step_delay_s: Worker task -> seconds of sleep before each step,
            to emulate a slow worker (tests, benchmarks).
        launch: How the cluster's tasks start. "local": every task is a
            process started here (the spec's addresses must be local).
            "remote": a multi-host run; the other tasks already run
            `autodist serve --tf-config` (or `--cluster FILE --task J:I`) on
            their hosts, this process is the chief's host (TF_CONFIG task
            chief:0, or worker:0 without a chief job): `fit` ships each
            other task its job over TensorFlow and starts worker task 0
            here. Every node of the spec needs its port.
    """

    def __init__(self, model, strategy: Strategy, resource_spec: ResourceSpec, *,
                 graph_item: GraphItem | None = None, job_dir: str | None = None,
                 step_timeout_s: float = 60.0, startup_timeout_s: float = 120.0,
                 task_step_delay_s: dict[int, float] | None = None,
                 launch: str = "local") -> None:
        from autodist.ir.capture import capture  # pylint: disable=import-outside-toplevel

        if launch not in LAUNCH_MODES:
            raise AutodistError(f"launch must be one of {LAUNCH_MODES}. Received: {launch!r}")
        if launch == "remote":
            check_this_is_the_chief(resource_spec)
        else:
            check_local(resource_spec)
        self.launch = launch

        self.model = model
        self.graph_item = graph_item or capture(model)
        self.strategy = strategy
        self.resource_spec = resource_spec
        strategy.validate(self.graph_item, resource_spec)
        check_optimizer(self.graph_item.optimizer)
        self.job_dir = job_dir
        self.step_timeout_s = step_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.last_job_dir: pathlib.Path | None = None
        self.task_step_delay_s = {str(k): float(v) for k, v in (task_step_delay_s or {}).items()}
        # The job and config of a followed fit while it runs (for `resize`).
        self._following: tuple[JobDir, RunConfig] | None = None
        self._resize_sequence = 0
        # The membership the running fit was last asked for (None: unchanged).
        self._requested_workers: int | None = None
        self._requested_strategy: str | None = None
        self._requested_batch = 0
        self._num_examples = 0
        self._resizable: AutodistError | None = None

    def fit(self, x: Any, y: Any = None, *, batch_size: int | None = None, epochs: int = 1,
            steps_per_epoch: int | None = None, shuffle: bool = False, seed: int = 0,
            verbose: int = 1, timeout_s: float = 3600.0, checkpoint_dir: str | None = None,
            checkpoint_every_steps: int | None = None,
            initial_checkpoint: str | None = None,
            callbacks: Sequence[Any] | None = None,
            resize_at: Mapping[int, int] | None = None,
            elastic: bool = False,
            switch_at: Mapping[int, Strategy] | None = None,
            policies: Sequence[Policy] | None = None,
            replanner: Replanner | None = None,
            on_failure: str = "stop",
            monitor_every: int = 0) -> History:
        """Trains on the cluster and writes the trained weights into the model.

        Callbacks (`keras.callbacks.Callback`) run here, in the driver, with
        Keras' hooks and logs: `set_model(model)`, `set_params({"epochs",
        "steps", "verbose"})`, `on_train_begin`, `on_epoch_begin(epoch)`,
        `on_train_batch_begin(batch)` and `on_train_batch_end(batch, {"loss":
        running mean of the epoch})` (both once the step has run on the
        workers: the driver learns of a step after it ran), `on_epoch_end(epoch,
        {"loss": epoch mean})` and `on_train_end`. Setting
        `model.stop_training = True` (e.g. `keras.callbacks.EarlyStopping(
        monitor="loss")`) stops every worker cleanly: in `on_epoch_end`, at
        that epoch's end exactly (the workers wait for it); inside an epoch,
        some steps later (the driver learns of steps after they ran, polling
        every 0.1 s, and the workers then stop at the next step boundary
        they can all meet). History covers the steps that ran and the
        weights written back are those after the last of them.

        The model's weights are not updated during the run (they come back
        at the end), so callbacks that read them mid-run, such as
        `ModelCheckpoint` or `EarlyStopping(restore_best_weights=True)`, see
        the initial weights: use `checkpoint_dir=` for checkpoints instead.

        Args:
            x: Input array, a list of arrays for a multi-input model, or a
                finite `tf.data.Dataset` of `(x, y)` batches (each one global
                batch, as in Keras; see `autodist.runtime.datasets`).
            y: Target array (None with a dataset).
            batch_size: The global batch (split over all replicas); default
                the strategy's fixed global batch when it has virtual nodes
                (any other value is an error), else 32; not given with a
                dataset (its batches are the batches).
            epochs: Passes over the data.
            steps_per_epoch: Steps per epoch (default: all batches).
            shuffle: Shuffle each epoch with a seeded permutation (the order
                differs from Keras' own shuffling; use False to compare).
            seed: Seed of the shuffling.
            verbose: 1 shows a progress line.
            timeout_s: Bound on the whole fit.
            checkpoint_dir: The chief writes checkpoints here (see
                `autodist.runtime.checkpoint`), atomically.
            checkpoint_every_steps: Steps between checkpoints (default: at the
                end of each epoch).
            initial_checkpoint: Continue from this checkpoint: variables,
                optimizer slots and update count (else the model's weights
                and fresh optimizer state).
            callbacks: Keras callbacks run by the driver (see above). With
                callbacks the workers report every step and wait for the
                driver at each epoch's end (up to `step_timeout_s`).
            resize_at: Elastic training: global step -> number of workers
                from that step on (workers 0..n-1 of the spec; step 0 sets
                the starting size, default all). At each change the members
                rebuild their programs in place (no process restarts, no
                disk) and continue from the chief's state; the strategy
                needs virtual nodes (B and V stay fixed, so the run follows
                the fixed-size trajectory) and synchronous updates. Every
                worker's process starts at launch and idles while it is not
                a member. See `autodist.runtime.elastic`. With callbacks,
                only step 0 (the starting size) may be given.
            elastic: Allow `resize(n)` and `replan(strategy)` while this fit
                runs, from a callback (a policy): the workers meet the new
                membership one step ahead of the chief. Needs callbacks;
                resizing needs an elastic strategy (as `resize_at`).
            switch_at: Global step -> strategy from that step on. At each
                switch every worker builds the new strategy's program in
                place and continues from the chief's state (variables,
                slots, step; PS variables re-placed as the new strategy
                says), so a synchronous run keeps the weights it would have
                had without the switch. Strategies must be synchronous,
                on the same replicas, with the same virtual nodes.
            policies: Adaptation policies (`autodist.runtime.policy`) run by
                the driver on every step's metrics; they may resize,
                re-plan, change a compressor or stop. Implies
                `elastic=True`; their actions are in `History.actions`.
            replanner: How a policy's `control.replan()` finds a strategy
                (default: the search, `policy.search_replanner`).
            monitor_every: Every this many steps, measure the gradient noise
                scale inside the step (no extra communication): each
                replica's and virtual node's squared gradient norm, fitted
                to |G|² + tr(Σ)/b over their batch sizes
                (`autodist.kernels.monitoring`); in `History.noise_scale`.
                Needs a replica with two or more virtual nodes. 0: off.
            on_failure: "stop": a worker that dies fails `fit` with an error
                naming it and its log. "continue": steps are atomic, and when
                a non-chief worker dies the job goes on without it from the
                last completed step (no applied update lost; the global
                batch stays the same): the chief saves the state, the
                survivors restart from it (`autodist.runtime.recovery`).
                Synchronous strategies, local launch, no callbacks.

        Returns:
            A History with per-step and per-epoch losses.
        """
        if policies:
            elastic = True
            callbacks = list(callbacks or [])
        for callback in callbacks or []:
            if not all(hasattr(callback, hook) for hook in _HOOKS):
                raise AutodistError("callbacks must be keras.callbacks.Callback objects. "
                                    f"Received: {callback!r}")
        self._check_learning_rate()
        inputs, targets, batch_size = self._arrays(x, y, batch_size)
        n = len(targets)
        if checkpoint_every_steps is not None and checkpoint_every_steps < 1:
            raise AutodistError("checkpoint_every_steps must be >= 1. "
                                f"Received: {checkpoint_every_steps}")
        steps = batching.steps_per_epoch(n, batch_size, steps_per_epoch)
        sizes = [len(batching.batch_rows(np.arange(n), s, batch_size)) for s in range(steps)]
        self._check_batches(sizes, n, batch_size)
        if not isinstance(monitor_every, int) or monitor_every < 0:
            raise AutodistError(f"monitor_every must be an integer >= 0. Received: "
                                f"{monitor_every!r}")
        if monitor_every and self.strategy.num_virtual_nodes <= len(self.strategy.replicas):
            raise AutodistError(
                "monitor_every estimates the noise scale from two batch sizes: the virtual "
                "nodes' and their replica's. It needs a replica with two or more virtual "
                f"nodes; the strategy has {self.strategy.num_virtual_nodes} virtual nodes on "
                f"{len(self.strategy.replicas)} replicas")
        if on_failure not in ("stop", "continue"):
            raise AutodistError(f"on_failure must be 'stop' or 'continue'. Received: "
                                f"{on_failure!r}")
        if on_failure == "continue":
            self._check_recoverable(callbacks, resize_at or switch_at)
        self._resizable = None
        if resize_at or elastic:
            if callbacks and resize_at and set(map(int, resize_at)) != {0}:
                raise AutodistError("with callbacks, resize_at may only give the starting size "
                                    "(step 0); resize later with run.resize(n) from a callback")
            if elastic and not (callbacks or policies):
                raise AutodistError("elastic=True resizes on request from a callback "
                                    "(run.resize(n)); without callbacks use resize_at")
            try:
                check_elastic(self.strategy, self.resource_spec)
            except AutodistError as e:
                if resize_at:
                    raise
                self._resizable = e  # replan works; resize(n) raises this
        plans: list[str] = []
        switch_plans: dict[str, int] = {}
        for step, new in sorted((switch_at or {}).items()):
            if not isinstance(new, Strategy):
                raise AutodistError(f"switch_at[{step}] must be a Strategy. Received: {new!r}")
            check_switch(self.strategy, new, self.graph_item, self.resource_spec)
            if resize_at:
                check_elastic(new, self.resource_spec)
            if new.to_text() not in plans:
                plans.append(new.to_text())
            switch_plans[str(int(step))] = plans.index(new.to_text()) + 1
        if switch_at and (callbacks or policies):
            raise AutodistError("with callbacks, switch strategies with run.replan(strategy) "
                                "from a callback (fit(..., elastic=True)), not switch_at")
        if resize_at or elastic or switch_at:
            segments(steps * epochs, self.resource_spec.num_worker_tasks, resize_at,
                     switch_plans)
        config = RunConfig(global_batch_size=batch_size, epochs=epochs,
                           steps_per_epoch=steps_per_epoch, shuffle=shuffle, seed=seed,
                           step_timeout_s=self.step_timeout_s,
                           startup_timeout_s=self.startup_timeout_s,
                           checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None,
                           checkpoint_every_steps=checkpoint_every_steps,
                           task_step_delay_s=self.task_step_delay_s or None,
                           follow_steps=bool(callbacks or policies), job_timeout_s=timeout_s,
                           job_id=uuid.uuid4().hex,
                           resize_at={str(k): v for k, v in resize_at.items()}
                           if resize_at else None, on_failure=on_failure,
                           elastic=bool(elastic or resize_at or switch_at),
                           monitor_every=monitor_every, switch_at=switch_plans or None,
                           plans=plans or None)
        init_values = self._initial_values()
        if initial_checkpoint:
            init_values.update(checkpoint.load(initial_checkpoint))
        path, job = self._new_job(config, init_values, inputs, targets)
        control = None
        driver = None
        if policies:
            control = Control(self, batch_size, replanner)
            control.workers = int({int(k): v for k, v in (resize_at or {}).items()}.get(
                0, control.workers))
            driver = PolicyDriver(control, policies, len(sizes))
        progress = _Progress(job, sizes, epochs, verbose, self.model, list(callbacks or []),
                             driver)
        self._following = (job, config) if callbacks or policies else None
        self._requested_workers = self._requested_strategy = None
        self._requested_batch, self._num_examples = batch_size, n
        try:
            progress.begin()
            spec, strategy = self.resource_spec, self.strategy
            earlier_losses: list[float] = []
            earlier_times: list[float] = []
            recoveries: list[dict[str, Any]] = []
            while True:
                try:
                    self._run_cluster(job, timeout_s, progress.update, spec,
                                      wait_for_chief=on_failure == "continue")
                    break
                except TaskFailedError as error:
                    dead = recovery.dead_worker(error.task) if on_failure == "continue" else None
                    resumed = recovery.resume_point(job) if dead is not None else None
                    if resumed is None:
                        raise
                    values, next_step = resumed
                    try:
                        strategy = recovery.strategy_without(strategy, dead)
                    except AutodistError as e:
                        raise error from e
                    done = next_step - config.start_step
                    losses, times, estimated = recovery.completed_losses(
                        job, spec.num_worker_tasks, config.start_step, done)
                    spec = recovery.without_worker(spec, dead)
                    earlier_losses += losses
                    earlier_times += times
                    recoveries.append({"step": next_step, "failed_task": dead,
                                       "workers": spec.num_worker_tasks,
                                       "estimated_loss_steps": estimated})
                    config = dataclasses.replace(config, start_step=next_step,
                                                 job_id=uuid.uuid4().hex)
                    path_k = path / f"recovery-{len(recoveries)}"
                    path_k.mkdir(parents=True, exist_ok=True)
                    job = JobDir(path_k)
                    job.write(self.graph_item, strategy, spec, config, values, inputs, targets)
                    progress.follow(job)
            progress.finish()
        finally:
            self._following = None
        history = self._history(job, sizes, epochs, spec, earlier_losses, earlier_times)
        history.recoveries = recoveries
        history.actions = control.actions if control is not None else []
        self._write_back(job)
        if self.job_dir is None:
            shutil.rmtree(path, ignore_errors=True)
        return history

    def resize(self, workers: int) -> None:
        """Asks the running `fit(..., elastic=True)` to go on with `workers` workers.

        Call it from a callback (a policy) while `fit` runs. The new
        membership (worker tasks 0..workers-1) starts one step ahead of the
        chief, at a step boundary all workers meet; the global batch and the
        virtual nodes stay fixed, so the numbers do not change. History's
        `resizes` lists when it happened.

        Raises:
            AutodistError: no elastic fit with callbacks is running, the
                strategy cannot resize (`elastic.check_elastic`), or
                `workers` is not in 1..(workers of the spec).
        """
        self._following_elastic("resize(n)")
        if self._resizable is not None:
            raise self._resizable
        limit = self.resource_spec.num_worker_tasks
        if not isinstance(workers, int) or not 1 <= workers <= limit:
            raise AutodistError(f"resize needs a number of workers in 1..{limit} (the spec's "
                                f"worker tasks). Received: {workers!r}")
        self._requested_workers = workers
        self._request_change()

    def replan(self, strategy: Strategy) -> None:
        """Asks the running `fit(..., elastic=True)` to switch to `strategy`.

        Call it from a callback (a policy) while `fit` runs. From a step
        boundary all workers meet (one step ahead of the chief; at an
        epoch's end when called from `on_epoch_end`), every worker runs the
        new strategy's program, starting from the chief's state in memory:
        variables, optimizer slots, step count, per-virtual-node state. In
        synchronous training the weights are those the run would have had
        without the switch. Compressor residuals start again at zero.

        A strategy with another global batch (`with_virtual_nodes(B2, V)`,
        with the learning rate it needs in `with_hyperparameters`) starts
        at the next epoch's first step: epochs keep one batch size, and
        later epochs have ceil(examples / B2) steps.

        Args:
            strategy: A synchronous strategy on the same replicas (e.g. a new
                search's pick, or the current strategy with another
                compressor), with the same virtual nodes or a new global
                batch.

        Raises:
            AutodistError: no elastic fit with callbacks is running, or the
                strategy does not fit the run (`elastic.check_switch`).
        """
        self._following_elastic("replan(strategy)")
        _, config = self._following
        batch = strategy.global_batch_size or config.global_batch_size
        changes_batch = batch != self._requested_batch
        check_switch(self.strategy, strategy, self.graph_item, self.resource_spec,
                     batch_change=changes_batch)
        if changes_batch:
            last = self._num_examples % batch
            if strategy.global_batch_size is None or 0 < last < strategy.num_virtual_nodes:
                raise AutodistError(
                    f"a new global batch ({batch}) needs a strategy with virtual nodes "
                    "(strategy.with_virtual_nodes(B, V)) whose last batch of an epoch "
                    f"({self._num_examples} examples) holds at least V examples")
        if self._resizable is None:
            check_elastic(strategy, self.resource_spec)
        self._requested_batch = batch
        self._requested_strategy = strategy.to_text()
        self._request_change()

    def _following_elastic(self, what: str) -> None:
        following = self._following
        if following is None or not following[1].elastic:
            raise AutodistError(f"{what} works while fit(..., elastic=True, callbacks=[...]) "
                                "runs (call it from a callback)")

    def _request_change(self) -> None:
        self._resize_sequence += 1
        follow.request_change(self._following[0], self._resize_sequence,
                              self._requested_workers, self._requested_strategy)

    def _check_recoverable(self, callbacks, schedule) -> None:
        if callbacks or schedule or self.launch != "local":
            raise AutodistError("on_failure='continue' needs a local launch without "
                                "callbacks, resize_at or switch_at")
        kinds = set()
        for config in self.strategy.variables:
            for i, sync in enumerate(config.shards):
                kinds.add(sync.WhichOneof("kind"))
                if sync.WhichOneof("kind") == "ps" and (not sync.ps.sync or sync.ps.staleness):
                    raise AutodistError(
                        f"on_failure='continue' needs synchronous training; variable "
                        f"{config.var_name!r} shard {i} is updated asynchronously")
        if kinds == {"ps", "all_reduce"}:
            raise AutodistError("on_failure='continue' needs a strategy that is all "
                                "parameter-server or all all-reduce (a mixed step runs in "
                                "two parts, which a failure could split)")

    def measure_throughput(self, x: Any, y: Any = None, *, batch_size: int | None = None,
                           steps: int = 3, timeout_s: float = 600.0) -> dict[str, float]:
        """Measures each replica's speed on the cluster, without training.

        Every worker runs its replicas' forward and backward passes (all
        their virtual nodes, reading the variables where the strategy puts
        them) on the first `steps` global batches after one warm-up batch;
        no update is applied and the model is unchanged.

        Args:
            x, y, batch_size: As in `fit`.
            steps: Timed batches (median taken), >= 1.
            timeout_s: Bound on the whole measurement.

        Returns:
            Replica device -> examples per second of its forward and backward
            passes (the input of `autodist.search.virtual_nodes.balance`).
        """
        if not isinstance(steps, int) or steps < 1:
            raise AutodistError(f"steps must be an integer >= 1. Received: {steps!r}")
        inputs, targets, batch_size = self._arrays(x, y, batch_size)
        n = len(targets)
        self._check_batches([len(batching.batch_rows(np.arange(n), 0, batch_size))], n,
                            batch_size)
        config = RunConfig(global_batch_size=batch_size, step_timeout_s=self.step_timeout_s,
                           startup_timeout_s=self.startup_timeout_s, job_timeout_s=timeout_s,
                           job_id=uuid.uuid4().hex, probe_steps=steps)
        path, job = self._new_job(config, self._initial_values(), inputs, targets)
        self._run_cluster(job, timeout_s, lambda: None)
        throughputs = {}
        for i in range(self.resource_spec.num_worker_tasks):
            for device, probe in json.loads(job.result(i).read_text())["probe"].items():
                throughputs[device] = probe["examples"] / float(np.median(probe["seconds"]))
        if self.job_dir is None:
            shutil.rmtree(path, ignore_errors=True)
        return throughputs

    # ------------------------------------------------------------ helpers
    def _check_learning_rate(self) -> None:
        """The model's learning rate must still be the captured one (or overridden)."""
        captured = self.graph_item.optimizer.hyperparameters.get("learning_rate")
        current = learning_rate_of(self.model)
        if captured is None or current is None or "learning_rate" in self.strategy.hyperparameters:
            return
        if not np.isclose(current, captured, rtol=1e-6, atol=0.0):
            raise AutodistError(
                f"the model's learning rate is {current:g} but it was {captured:g} when the "
                "model was captured, and the cluster trains with the captured one: capture "
                "again, or set it with strategy.with_hyperparameters(learning_rate=...)")

    def _arrays(self, x, y, batch_size: int | None):
        """(inputs, targets, global batch) from fit's arguments, checked."""
        if datasets.is_dataset(x):
            if y is not None or batch_size is not None:
                raise AutodistError("with a dataset, pass neither y nor batch_size: the "
                                    "dataset yields (x, y) batches. Received "
                                    f"y={'an array' if y is not None else None}, "
                                    f"batch_size={batch_size!r}")
            x, y, batch_size = datasets.dataset_arrays(x, [i.name for i in self._x_infos()])
        if y is None:
            raise AutodistError("fit needs targets y (or a dataset of (x, y) batches)")
        fixed = self.strategy.global_batch_size
        if fixed is not None and batch_size not in (None, fixed):
            raise AutodistError(
                f"the strategy fixes the global batch at {fixed} examples "
                f"({self.strategy.num_virtual_nodes} virtual nodes); fit received batch_size "
                f"{batch_size}. Leave batch_size out or change the strategy's virtual nodes")
        batch_size = (fixed or 32) if batch_size is None else batch_size
        inputs = self._inputs(x)
        targets = targets_.pack(y, self._target_infos(), self._cast)
        n = len(targets)
        if any(len(a) != n for a in inputs):
            raise AutodistError(f"x and y have different numbers of examples: "
                                f"{[len(a) for a in inputs]} vs {n}")
        if batch_size < 1:
            raise AutodistError(f"batch_size must be >= 1. Received: {batch_size}")
        return inputs, targets, batch_size

    def _check_batches(self, sizes: list[int], n: int, batch_size: int) -> None:
        if min(sizes) < self.strategy.num_virtual_nodes:
            raise AutodistError(
                f"the last batch of an epoch has {min(sizes)} examples ({n} examples, batch "
                f"{batch_size}), fewer than the {self.strategy.num_virtual_nodes} "
                "virtual nodes or replicas that split it; drop the remainder "
                "(steps_per_epoch) or change the number of examples")

    def _new_job(self, config: RunConfig, init_values, inputs, targets):
        path = pathlib.Path(self.job_dir or tempfile.mkdtemp(prefix="autodist-job-"))
        path.mkdir(parents=True, exist_ok=True)
        job = JobDir(path)
        self.last_job_dir = path
        job.write(self.graph_item, self.strategy, self.resource_spec, config,
                  init_values, inputs, targets)
        return path, job

    def _run_cluster(self, job: JobDir, timeout_s: float, on_poll,
                     spec: ResourceSpec | None = None, wait_for_chief: bool = False) -> None:
        """Runs the job to its end. With `wait_for_chief`, a failed worker leaves the
        chief time to save its state (it learns of the failure within a step's
        timeout) before the cluster is torn down."""
        spec = spec or self.resource_spec
        cluster = (LocalCluster(job, spec) if self.launch == "local" else
                   RemoteCluster(job, spec, startup_timeout_s=self.startup_timeout_s))
        with cluster:
            cluster.wait_ready(self.startup_timeout_s)
            try:
                cluster.wait_workers(timeout_s, on_poll=on_poll)
            except TaskFailedError as error:
                if wait_for_chief and recovery.dead_worker(error.task) is not None:
                    cluster.wait_exit("worker", 0, self.step_timeout_s + 30.0)
                raise

    def _x_infos(self):
        return [i for i in self.graph_item.inputs if i.role != "y"]

    def _target_infos(self):
        return [i for i in self.graph_item.inputs if i.role == "y"]

    def _inputs(self, x) -> list[np.ndarray]:
        arrays = list(x) if isinstance(x, (list, tuple)) else [x]
        infos = self._x_infos()
        if len(arrays) != len(infos):
            raise AutodistError(f"the model takes {len(infos)} inputs "
                                f"({[i.name for i in infos]}); received {len(arrays)}")
        return [self._cast(np.asarray(a), info) for a, info in zip(arrays, infos)]

    @staticmethod
    def _cast(array: np.ndarray, info) -> np.ndarray:
        expected = list(info.shape)[1:]
        if list(array.shape[1:]) != expected:
            raise AutodistError(f"input {info.name!r} needs examples of shape {expected}; "
                                f"received an array of shape {list(array.shape)}")
        return np.ascontiguousarray(array.astype(info.dtype, copy=False))

    def _initial_values(self) -> dict[str, np.ndarray]:
        from autodist.ir.capture import keras_variable_names  # pylint: disable=C0415

        trainable, state = keras_variable_names(self.model)
        values = {n: np.asarray(v.numpy()) for n, v in zip(trainable,
                                                             self.model.trainable_variables)}
        non_trainable = [v for v in self.model.variables if not v.trainable]
        values.update({n: np.asarray(v.numpy()) for n, v in zip(state, non_trainable)})
        return values

    def _write_back(self, job: JobDir) -> None:
        from autodist.ir.capture import keras_variable_names  # pylint: disable=C0415

        trainable, state = keras_variable_names(self.model)
        non_trainable = [v for v in self.model.variables if not v.trainable]
        with np.load(job.file("final_weights.npz")) as weights:
            for name, var in list(zip(trainable, self.model.trainable_variables)) + \
                    list(zip(state, non_trainable)):
                if name in weights.files:
                    var.assign(weights[name])

    def _history(self, job: JobDir, batch_sizes: list[int], epochs: int,
                 spec: ResourceSpec | None = None, earlier_losses: Sequence[float] = (),
                 earlier_times: Sequence[float] = ()) -> History:
        spec = spec or self.resource_spec
        results = [json.loads(job.result(i).read_text())
                   for i in range(spec.num_worker_tasks)
                   if job.result(i).exists()]
        # Every worker ran the same steps, except asynchronous ones stopped early.
        done = min(len(r["losses"]) for r in results)
        losses = list(earlier_losses) + np.sum([r["losses"][:done] for r in results],
                                               axis=0).tolist()
        done += len(earlier_losses)
        steps = len(batch_sizes)
        # The chief's epochs (their batch may have changed with the strategy).
        starts = results[0].get("epoch_starts") or [e * steps for e in range(epochs + 1)]
        examples = list(results[0].get("step_examples") or [])
        examples = examples if len(examples) >= done else \
            [batch_sizes[i % steps] for i in range(done)]
        # As Keras: the epoch loss is the mean over examples (batches weighted by size).
        ran = sum(1 for start in starts[:epochs] if start < done)
        epoch_losses = []
        for e in range(ran):
            end = min(starts[e + 1], done)
            epoch_losses.append(float(np.average(losses[starts[e]:end],
                                                 weights=examples[starts[e]:end])))
        return History(history={"loss": epoch_losses}, step_losses=losses,
                       step_times=list(earlier_times) + results[0]["step_times"][:done],
                       epoch=list(range(ran)),
                       max_lead=[int(r.get("max_lead", 0)) for r in results],
                       resizes=results[0].get("resizes", []),
                       noise_scale=_noise_scale(results))


def _noise_scale(results: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Noise-scale estimates and the step's split per monitored step, from every worker."""
    by_step: dict[int, tuple[list[float], list[float], list[float]]] = {}
    for result in results:
        for record in result.get("monitor", []):
            batches, norms, compute = by_step.setdefault(int(record["step"]), ([], [], []))
            batches += record["batches"]
            norms += record["sq_norms"]
            compute += record.get("compute_s", [])
    times = results[0]["step_times"] if results else []
    smooth = monitoring.SmoothedNoiseScale(decay=0.9)
    out = []
    for step in sorted(by_step):
        batches, norms, compute = by_step[step]
        estimate = monitoring.noise_scale_fit(batches, norms)
        if estimate is None:
            continue
        record = {"step": step, "gradient_sq": estimate.gradient_sq,
                  "trace_sigma": estimate.trace_sigma, "noise_scale": estimate.noise_scale,
                  "smoothed": smooth.update(estimate).noise_scale}
        if compute and step < len(times):
            record["compute_s"] = max(compute)
            record["communication_s"] = max(0.0, times[step] - max(compute))
        out.append(record)
    return out


def learning_rate_of(model) -> float | None:
    """The value of a Keras model's fixed learning rate (None: a schedule, or no optimizer)."""
    optimizer = getattr(model, "optimizer", None)
    rate = getattr(optimizer, "_learning_rate", None)
    if rate is None or callable(rate) or not hasattr(rate, "numpy"):
        return None
    return float(np.asarray(rate.numpy()))


def _rate_text(rate: float | None) -> str:
    return "a schedule" if rate is None else f"{rate:g}"


class _Progress:
    """Follows the chief's progress file: the progress line and the callbacks.

    The chief appends one JSON line per step. Without callbacks its loss is
    the chief's own estimate; with callbacks (a followed run) it is the
    global loss, and this object also writes the driver's decisions back
    (`autodist.runtime.follow`).
    """

    def __init__(self, job: JobDir, batch_sizes: list[int], epochs: int, verbose: int,
                 model, callbacks: list[Any], policies: PolicyDriver | None = None) -> None:
        self.job = job
        self.path = job.file("progress.jsonl")
        self.sizes = batch_sizes
        self.epochs = epochs
        self.total = len(batch_sizes) * epochs
        self.verbose = verbose
        self.model = model
        self.callbacks = callbacks
        self.policies = policies
        self.followed = bool(callbacks) or policies is not None
        self.seen = 0
        self._offset = 0
        self._last: dict[str, Any] | None = None
        self._epoch_open: int | None = None
        self._sum = 0.0
        self._count = 0
        self._logs: dict[str, float] = {}
        self._stop_sent = False

    def begin(self) -> None:
        if not self.followed:
            return
        self.model.stop_training = False
        params = {"epochs": self.epochs, "steps": len(self.sizes), "verbose": self.verbose}
        for callback in self.callbacks:
            callback.set_model(self.model)
            callback.set_params(params)
        self._call("on_train_begin", {})
        if self.policies is not None:
            self.policies.begin()
            self._check_stop()

    def update(self) -> None:
        """Reads the records written since the last call; shows and dispatches them."""
        records = self._read_new()
        if not records:
            return
        self._last = records[-1]
        if self.followed:
            for record in records:
                self._step(record)
        if self.verbose:
            width = 30
            done = int(width * self.seen / max(self.total, 1))
            sys.stdout.write(f"\r{self.seen}/{self.total} [{'=' * done}{'.' * (width - done)}] "
                             f"- loss: {self._last['loss']:.4f} - "
                             f"{self._last['time'] * 1e3:.1f} ms/step")
            sys.stdout.flush()

    def finish(self) -> None:
        self.update()
        if self.followed:
            if self._epoch_open is not None:  # stopped inside an epoch: Keras still ends it
                self._end_epoch(self._epoch_open)
            self._call("on_train_end", dict(self._logs))
            if self.policies is not None:
                self.policies.end()
        if self.verbose:
            sys.stdout.write("\n")

    def follow(self, job: JobDir) -> None:
        """Reads the progress of `job` from now on (a job resumed after a failure)."""
        self.update()
        self.job = job
        self.path = job.file("progress.jsonl")
        self._offset = 0

    def _read_new(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # only whole lines: the chief may be mid-write
        self._offset += end
        records = [json.loads(line) for line in chunk[:end].splitlines() if line.strip()]
        self.seen += len(records)
        return records

    def _step(self, record: dict[str, Any]) -> None:
        epoch, step = int(record["epoch"]), int(record["step"])
        if self._epoch_open != epoch:
            self._epoch_open, self._sum, self._count = epoch, 0.0, 0
            self._call("on_epoch_begin", epoch, {})
        # Keras' batch logs hold the running mean of the epoch, batches weighted by size.
        examples = int(record.get("examples", self.sizes[step]))
        self._sum += float(record["loss"]) * examples
        self._count += examples
        self._call("on_train_batch_begin", step, {})
        self._call("on_train_batch_end", step, {"loss": self._sum / self._count})
        if self.policies is not None:
            self.policies.step(record)
            self._check_stop()
        if record.get("last", step == len(self.sizes) - 1):
            self._end_epoch(epoch)

    def _end_epoch(self, epoch: int) -> None:
        self._logs = {"loss": self._sum / max(self._count, 1)}
        self._epoch_open = None
        self._call("on_epoch_end", epoch, dict(self._logs))
        if self.policies is not None:
            self.policies.epoch_end(epoch, dict(self._logs))
            self._check_stop()
        if epoch < self.epochs - 1:
            follow.write_decision(self.job, epoch, stop=bool(self.model.stop_training))

    def _check_stop(self) -> None:
        if self.policies.control.stop_requested:
            self.model.stop_training = True
        self._send_stop_if_asked()

    def _call(self, hook: str, *args) -> None:
        for callback in self.callbacks:
            rate = learning_rate_of(self.model)
            getattr(callback, hook)(*args)
            if learning_rate_of(self.model) != rate:
                # The workers ran ahead with the captured rate; Keras would change it now.
                raise AutodistError(
                    f"callback {type(callback).__name__} changed the optimizer's learning "
                    f"rate in {hook} (from {_rate_text(rate)} to "
                    f"{_rate_text(learning_rate_of(self.model))}); "
                    "a distributed run trains with the rate it was launched with. Use a "
                    "keras.optimizers.schedules.LearningRateSchedule, or a policy that "
                    "re-plans with strategy.with_hyperparameters(learning_rate=...)")
        self._send_stop_if_asked()

    def _send_stop_if_asked(self) -> None:
        if self.model.stop_training and not self._stop_sent:
            follow.request_stop(self.job)
            self._stop_sent = True

