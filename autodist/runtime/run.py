"""DistributedRun: train a Keras model with a Strategy on a cluster, Keras-like."""
from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import uuid
import warnings
from typing import Any, Sequence, Unpack

import numpy as np

from autodist.adapt.driver import PolicyDriver
from autodist.adapt.policy_interface import Control
from autodist.adapt.task_providers import LocalProcesses, ServedHosts, TaskProvider
from autodist.ir.errors import AutodistError
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.kernels.optimizers import check_supported as check_optimizer
from autodist.launch.errors import TaskFailedError
from autodist.launch.job import JobDir
from autodist.launch.local import check_local
from autodist.launch.signing import load_secret
from autodist.launch.tf_config import check_this_is_the_chief
from autodist.runtime import (checkpoint, fit_input, keras_parity, recovery,
                              steps_per_execution, validation)
from autodist.runtime.change_requests import ChangeRequests
from autodist.runtime.cluster_jobs import ClusterJobs, discard
from autodist.runtime.compile_state import CompileState, check_capture_matches
from autodist.runtime.elastic import segments
from autodist.runtime.history import History, read_results
from autodist.runtime.history_events import PolicyAction, Recovery
from autodist.runtime.metric_logs import MetricLogs
from autodist.runtime.model_state import ModelState
from autodist.runtime.options import FitArguments, FitOptions
from autodist.runtime.progress import Progress, learning_rate_of
from autodist.runtime.records import WorkerResult
from autodist.runtime.run_config import RunConfig

LAUNCH_MODES = ("local", "remote")


class DistributedRun:
    """A Keras model, a Strategy and a ResourceSpec, ready to train.

    Args:
        model: A compiled Keras 3 model. Trained weights are written back to it.
        strategy: How to distribute it (validated against the model here).
        resource_spec: The cluster; local specs are launched as processes.
        graph_item: The model's capture, if already made.
        job_dir: Where job files and task logs go (default: a new temp dir,
            removed after a successful fit). Created with mode 0700; an
            existing directory must be this user's and closed to others.
        step_timeout_s: Bound on one step of any task (no hang). A local task
            that sends no heartbeat for half of it (5 to 60 s: stopped or
            hung) is killed and named, as a dead task.
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
        allow_exposed: A local cluster's tasks run in a private network
            namespace, out of other hosts' reach (`autodist.launch.private_network`);
            where none can be made, `fit` raises `ExposedNetworkError`
            unless this is True (or `AUTODIST_ALLOW_EXPOSED=1`): then they
            run reachable, with a warning naming their ports.
        secret_file: launch="remote": the cluster's shared secret, which
            signs the jobs shipped to `autodist serve` (default: the file
            named by `AUTODIST_SECRET_FILE`, else `AUTODIST_SECRET`; without
            one, jobs go unsigned and only `autodist serve --insecure` runs
            them).
        keep_optimizer_state: After each fit the trained optimizer state
            (slots, update count) returns into the model's optimizer, and the
            next fit goes on from it, as with Keras' fit. False leaves the
            model's optimizer as it was (measurements that must not change
            the model).
        task_provider: Which worker tasks `resize(n)` (and so a policy's or
            the autoscaler's resize) takes when the run grows and gives back
            when it shrinks (`autodist.adapt.task_providers`). Default:
            under launch="remote", `ServedHosts.from_spec(resource_spec)` (a
            grow takes only slots whose `autodist serve` answers, so it may
            land on a host served after launch; the members that joined last
            leave first); otherwise `LocalProcesses` (the lowest-numbered
            idle tasks join, the highest-numbered members leave).
    """

    def __init__(self, model, strategy: Strategy, resource_spec: ResourceSpec, *,
                 graph_item: GraphItem | None = None, job_dir: str | None = None,
                 step_timeout_s: float = 60.0, startup_timeout_s: float = 120.0,
                 task_step_delay_s: dict[int, float] | None = None,
                 launch: str = "local", allow_exposed: bool = False,
                 secret_file: str | None = None, keep_optimizer_state: bool = True,
                 task_provider: TaskProvider | None = None) -> None:
        from autodist.ir.capture import capture

        if launch not in LAUNCH_MODES:
            raise AutodistError(f"launch must be one of {LAUNCH_MODES}. Received: {launch!r}")
        if launch == "remote":
            check_this_is_the_chief(resource_spec)
            self._secret = load_secret(secret_file)
        else:
            check_local(resource_spec)
            _warn_if_oversubscribed(resource_spec)
            self._secret = None
        self.launch = launch
        self.allow_exposed = allow_exposed
        self.keep_optimizer_state = keep_optimizer_state

        self.model = model
        if graph_item is not None:
            check_capture_matches(model, graph_item.variable_names)
        self.graph_item = graph_item or capture(model)
        # The model's compile and trainable variables as captured: a fit refuses a change.
        self._compiled = CompileState(model)
        self.strategy = strategy
        self.resource_spec = resource_spec
        strategy.validate(self.graph_item, resource_spec)
        check_optimizer(self.graph_item.optimizer)
        keras_parity.check(model, self.graph_item, strategy)
        self.job_dir = job_dir
        self.step_timeout_s = step_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.last_job_dir: pathlib.Path | None = None
        self.task_step_delay_s = {str(k): float(v) for k, v in (task_step_delay_s or {}).items()}
        self._state = ModelState(model, self.graph_item, keep_optimizer_state)
        if task_provider is None:
            task_provider = ServedHosts.from_spec(resource_spec) if launch == "remote" else \
                LocalProcesses(resource_spec.num_worker_tasks)
        self._requests = ChangeRequests(self.graph_item, strategy, resource_spec, task_provider)
        self._jobs = ClusterJobs(resource_spec, launch=launch, allow_exposed=allow_exposed,
                                 secret=self._secret, step_timeout_s=step_timeout_s,
                                 startup_timeout_s=startup_timeout_s,
                                 request_stop=self._requests.stop)
        # Passes this run's fits started on each dataset (by its seed generators' names).
        self._dataset_passes: dict[tuple[str, ...], int] = {}
        self._metric_logs: MetricLogs | None = None

    def fit(self, x: Any, y: Any = None, **arguments: Unpack[FitArguments]) -> History:
        """Trains on the cluster and writes the trained weights into the model.

        Callbacks (`keras.callbacks.Callback`) run here, in the driver, in a
        `keras.callbacks.CallbackList` with Keras' hooks and logs, Keras'
        own progress bar (`verbose`) and the fit's `History`:
        `on_train_begin`, `on_epoch_begin(epoch)`, `on_train_batch_begin` and
        `on_train_batch_end(batch, {"loss": running mean of the epoch})`
        (once the step has run on the workers: the driver learns of a step
        after it ran), `on_epoch_end(epoch, logs)` and `on_train_end`.
        Before `on_epoch_end` the model holds that epoch's trained weights
        (the chief sends them), so `ModelCheckpoint` saves them and
        `EarlyStopping(restore_best_weights=True)` keeps and restores the
        best; the final weights are in the model before the last epoch's
        `on_epoch_end` and `on_train_end`. Inside an epoch the model keeps
        the weights of the epoch's start. Setting `model.stop_training =
        True` stops every worker cleanly: in `on_epoch_end`, at that
        epoch's end exactly (the workers wait for it); inside an epoch,
        some steps later (the driver learns of steps after they ran,
        polling every 0.1 s, and the workers then stop at the next step
        boundary they can all meet). History covers the steps that ran and
        the weights written back are those after the last of them.

        Validation runs in the driver, as Keras' `fit` runs it: at the end
        of each epoch `validation_freq` selects, `model.evaluate` on the
        validation data with the model holding that epoch's weights; its
        results join the epoch's logs as ``val_*``.

        Ctrl-C (KeyboardInterrupt) stops the run as Keras does, keeping the
        progress: the chief stops at its next step and the model gets the
        weights trained so far (when the chief sends them within
        `step_timeout_s`); then the interrupt goes on.

        Args:
            x: Input array, a list of arrays for a multi-input model, a
                `tf.data.Dataset` of `(x, y)` batches (each one global
                batch, as in Keras; see `autodist.runtime.datasets`), or a
                `ShardedDataset` (each worker task builds and reads its own
                share of every global batch; see
                `autodist.runtime.sharded_input`), or a `keras.utils.PyDataset`
                or Python generator of such batches (read in the driver
                before launch as Keras' fit reads it; see
                `autodist.runtime.python_data`).
            y: Target array (None with a dataset).
            **arguments: The options below (`FitArguments`), by keyword.

        Keyword Args:
            batch_size: The global batch (split over all replicas); default
                the strategy's fixed global batch when it has virtual nodes
                (any other value is an error), else 32; not given with a
                dataset (its batches are the batches).
            epochs: Passes over the data.
            steps_per_epoch: Steps per epoch (default: all batches). With the
                model's `compile(steps_per_execution=k)`, whole groups of k
                (ceil(steps_per_epoch / k) * k steps), as Keras runs them; the
                batch hooks are then called once per group, as in Keras.
            shuffle: As Keras: shuffle the examples of each pass over arrays
                (True, the default), or each batch's rows ("batch"); ignored
                with a dataset (its own `shuffle` reads as in Keras). With
                TensorFlow's global seed set (`keras.utils.set_random_seed`)
                the order is Keras' own, so the run equals Keras `fit`;
                without one Keras' order is random and the run draws its own
                (seeded by `seed`).
            seed: Seeds the shuffling where Keras' order is random.
            verbose: 1 shows a progress line.
            timeout_s: Bound on the whole fit.
            checkpoint_dir: The chief writes checkpoints here (see
                `autodist.runtime.checkpoint`), atomically and durably.
            checkpoint_every_steps: Steps between checkpoints (default: at the
                end of each epoch).
            checkpoints_to_keep: Keep only the newest this many checkpoints
                in `checkpoint_dir` (default: all).
            initial_checkpoint: Continue from this checkpoint: variables,
                optimizer slots and update count (else the model's weights
                and fresh optimizer state). Its files are verified against
                its manifest first.
            callbacks: Keras callbacks run by the driver (see above). With
                callbacks the workers report every step and wait for the
                driver at each epoch's end (up to `step_timeout_s`).
            resize_at: Elastic training: global step -> the workers from
                that step on: a number n (the previous members grown or
                shrunk to n: the highest-numbered members leave first, the
                lowest-numbered idle tasks join first) or a list of worker
                task indices with the chief, 0 (e.g. [0, 2] drops worker
                1); step 0 sets the starting membership, default all. At each change the members
                rebuild their programs in place (no process restarts, no
                disk) and continue from the chief's state; the strategy
                needs virtual nodes (B and V stay fixed, so the run follows
                the fixed-size trajectory) and synchronous updates. A
                worker outside the starting membership is waited for only
                when the run grows onto it (under launch="remote" its slot's
                `autodist serve` may start after launch: it gets the job
                once it answers); one that leaves for good ends at its
                leave; one no step includes takes no part. See
                `autodist.runtime.elastic` and docs/elastic.md. With
                callbacks, only step 0 (the starting members) may be
                given: the other workers idle until a resize includes
                them, and are waited for only then (under launch="remote"
                their slots need not be served at launch).
            elastic: Allow `resize(workers)` and `replan(strategy)` while this fit
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
            policies: Adaptation policies (`autodist.adapt.policy_interface`) run by
                the driver on every step's metrics; they may resize,
                re-plan, change a compressor or stop. Implies
                `elastic=True`; their actions are in `History.actions`.
            replanner: How a policy's `control.replan()` finds a strategy
                (default: the search, `policy.search_replanner`).
            validation_data: (x, y), (x, y, sample_weight) or a dataset,
                evaluated at epochs' ends (see above).
            validation_split: The last fraction of the examples (before any
                shuffling) held out for validation, as in Keras (arrays only).
            validation_batch_size: Batch of the validation pass (default
                `batch_size`).
            validation_steps: Batches of the validation pass (default all).
            validation_freq: Validate every this many epochs, or at these
                (1-based) epochs.
            initial_epoch: The epoch to start at (as Keras: epochs
                `initial_epoch`..`epochs - 1` run; shuffling uses their
                indices).
            sample_weight: Per-example weights of the loss and the weighted
                metrics (one array, applied to every output), as in Keras.
            class_weight: Class index -> weight: each example weighs its
                class's weight, as Keras makes it (one output only).
            monitor_every: Every this many steps, measure the gradient noise
                scale inside the step (no extra communication): each
                replica's and virtual node's squared gradient norm, fitted
                to |G|² + tr(Σ)/b over their batch sizes
                (`autodist.kernels.monitoring`); in `History.noise_scale`.
                Needs a replica with two or more virtual nodes. 0: off.
            on_failure: "stop": a task that dies (or stops responding) fails
                `fit` with a `TaskFailedError` naming it and its log; the model
                keeps what was trained, as after Ctrl-C: the weights after the
                last step every replica completed (steps are atomic), or where
                the chief or a parameter server died, the newest checkpoint of
                `checkpoint_dir`; the error says which. "continue": when
                a non-chief worker dies the job goes on without it from the
                last completed step (no applied update lost; the global
                batch stays the same): the chief saves the state, the
                survivors restart from it (`autodist.runtime.recovery`).
                A dead chief or parameter server restarts the job from the
                newest checkpoint of `checkpoint_dir` (without it, fit
                raises). Under launch="remote" a worker whose host or
                `autodist serve` died is left out likewise (the strategy must
                be elastic); the served tasks must take further jobs
                (`autodist serve` without `--max-jobs`, or enough).
                Synchronous strategies, no callbacks.

        Returns:
            The History (a `keras.callbacks.History`, also set as
            `model.history`), with per-epoch logs and per-step losses and times.
        Raises:
            ModelChangedError: the model was compiled again, or its trainable
                variables changed (`layer.trainable = ...`), since the run
                captured it: the run would train the captured variables with
                the captured optimizer. Call `autodist.optimize(model)` again
                (`autodist.runtime.compile_state`).
        """
        self._compiled.check(self.model, "this DistributedRun")
        options = FitOptions.from_arguments(arguments)
        not_resizable = options.check(self.strategy, self.graph_item, self.resource_spec,
                                      self.launch)
        self._check_learning_rate()
        x, y = validation.split_off(x, y, options)
        # As Keras' fit with compile(steps_per_execution=k): epochs of whole groups of k.
        keras_steps = options.steps_per_epoch
        options.steps_per_epoch = steps_per_execution.steps_run(
            keras_steps, steps_per_execution.of(self.model))
        ready = fit_input.prepare(x, y, options, self._input_context())
        keras_parity.check_batch_parts(self.graph_item, self.strategy, ready.global_batch_size)
        members = tuple(range(self.resource_spec.num_worker_tasks))
        if options.membership_may_change:
            members = segments(sum(ready.epoch_steps), self.resource_spec.num_worker_tasks,
                               options.resize_at, options.switch_plans()[1])[0].members
        config = options.run_config(
            global_batch_size=ready.global_batch_size, shuffle=ready.shuffle,
            step_timeout_s=self.step_timeout_s, startup_timeout_s=self.startup_timeout_s,
            task_step_delay_s=self.task_step_delay_s)
        init_values = self._state.initial_values()
        if options.initial_checkpoint:
            init_values.update(checkpoint.continued(checkpoint.load(options.initial_checkpoint)))
        path, job = self._new_job(config, init_values, ready.data)
        finished = False
        try:
            self._requests.open(job, config, members=members, batch=ready.global_batch_size,
                                num_examples=ready.num_examples, streaming=ready.streaming,
                                not_resizable=not_resizable)
            history, outcome, control, metric_logs = self._train(job, config, options, ready,
                                                                 keras_steps)
            finished = True
        except KeyboardInterrupt:
            self._state.keep_interrupted(job)
            raise
        except TaskFailedError as error:
            # As after Ctrl-C, what was trained is kept: the error says which step.
            raise self._state.keep_failed(job, options.checkpoint_dir, error) from error
        finally:
            self._requests.close()
            if self.job_dir is None and not finished:
                discard(path)
        read_results(history, outcome.job, options.job_epochs, outcome.spec,
                     outcome.earlier_losses, outcome.earlier_times, options.initial_epoch,
                     None if outcome.recoveries else metric_logs)
        ready.after_fit(len(history.epoch))
        history.recoveries = [Recovery.from_dict(r) for r in outcome.recoveries]
        if outcome.recoveries:  # the failed jobs' metric states are lost: no estimates
            for key in [k for k in history.history if k != "loss"]:
                del history.history[key]
        history.actions = [PolicyAction.from_dict(a) for a in control.actions] \
            if control is not None else []
        if self.job_dir is None:
            shutil.rmtree(path, ignore_errors=True)
        return history

    def _train(self, job: JobDir, config: RunConfig, options: FitOptions,
               ready: fit_input.FitInput, keras_steps: int | None
               ) -> tuple[History, recovery.Outcome, Control | None, MetricLogs | None]:
        """Runs the job with the driver following it (callbacks, progress, policies) and
        the trained state written back into the model; `keras_steps` is fit's own
        `steps_per_epoch` (the callbacks' `params["steps"]`, as in Keras)."""
        control = driver = None
        if options.policies:
            control = Control(self, ready.global_batch_size, options.replanner)
            control.members = self._requests.members
            driver = PolicyDriver(control, options.policies)
        history = History()
        # One per run while the model's metrics stay the same objects (no retracing).
        self._metric_logs = self._metric_logs.reused(self.model, self.graph_item) \
            if self._metric_logs is not None else MetricLogs(self.model, self.graph_item)
        metric_logs = self._metric_logs or None
        progress = Progress(
            job, epochs=options.job_epochs, steps_per_epoch=keras_steps or ready.epoch_steps[0],
            steps_per_execution=steps_per_execution.of(self.model),
            verbose=options.verbose, model=self.model, callbacks=options.callbacks,
            history=history, policies=driver, followed=options.followed,
            epoch_weights=config.epoch_weights, load_weights=self._state.load_weights,
            validate=validation.validator(
                self.model, options, None if ready.streaming else ready.global_batch_size,
                lambda: progress.callbacks) if options.validates else None,
            metric_logs=metric_logs, initial_epoch=options.initial_epoch,
            wait_s=self.step_timeout_s + self.startup_timeout_s,
            fixed_rate=self._fixed_rate(), read_state=self._state.read_state)
        progress.begin()
        if progress.fixed_rate is None and progress.learning_rate is not None:
            # The model's rate after on_train_begin and the first on_epoch_begin.
            config = dataclasses.replace(config, learning_rate=progress.learning_rate)
            job.write_config(config)
        if options.on_failure == "continue":
            recovering = dict(
                run_cluster=lambda job_k, spec_k, absent: self._jobs.run(
                    job_k, options.timeout_s, progress.update, spec_k, absent,
                    recovering=True),
                write_job=lambda job_k, strategy_k, spec_k, config_k, values: job_k.write(
                    self.graph_item, strategy_k, spec_k, config_k, values, ready.data.inputs,
                    ready.data.targets, ready.data.dataset, ready.data.order),
                on_new_job=progress.follow)
            recover = recovery.run_recovering_remote if self.launch == "remote" else \
                recovery.run_recovering
            outcome = recover(job, self.strategy, self.resource_spec,
                              checkpoint_dir=options.checkpoint_dir, **recovering)
        else:
            self._jobs.run(job, options.timeout_s, progress.update)
            outcome = recovery.Outcome(job, self.resource_spec)
        progress.finish_epochs()
        self._state.write_back(outcome.job)
        progress.finish()
        return history, outcome, control, metric_logs

    def resize(self, workers: int | Sequence[int]) -> tuple[int, ...]:
        """Asks the running `fit(..., elastic=True)` to go on with other workers.

        Call it from a callback (a policy) while `fit` runs. The new
        membership starts one step ahead of the chief, at a step boundary
        all workers meet; the global batch and the virtual nodes stay fixed,
        so the numbers do not change. History's `resizes` lists when it
        happened and on which tasks.

        Args:
            workers: A number n: the current members grown or shrunk to n
                by the run's `task_provider` (by default under a local
                launch, shrinking drops the highest-numbered members and
                growing adds the lowest-numbered idle tasks; under
                launch="remote", growing adds only tasks whose slot's
                `autodist serve` answers, and shrinking drops the last to
                join first). Or the worker task indices to run on, e.g.
                [0, 2, 3] to drop worker 1; they must include the chief,
                task 0 (a task named whose slot is not served is waited
                for when the run grows onto it, and fails the fit, naming
                it, if it never comes).

        Returns:
            The member tasks asked for.

        Raises:
            TaskProviderError: a grow to n for which the provider has fewer
                tasks available (it names them and, under launch="remote",
                the slots that do not answer); the run goes on unchanged.
            AutodistError: no elastic fit with callbacks is running, the
                strategy cannot resize (`elastic.check_elastic`), `workers`
                is not in 1..(workers of the spec), or the tasks are
                unknown, repeated or leave out the chief.
        """
        return self._requests.resize(workers)

    @property
    def task_provider(self) -> TaskProvider:
        """Which worker tasks `resize(n)` takes and gives back (see the constructor)."""
        return self._requests.provider

    def replan(self, strategy: Strategy) -> None:
        """Asks the running `fit(..., elastic=True)` to switch to `strategy`.

        Call it from a callback (a policy) while `fit` runs. From a step
        boundary all workers meet (one step ahead of the chief; at an
        epoch's end when called from `on_epoch_end`), every worker runs the
        new strategy's program, starting from the chief's state in memory:
        variables, optimizer slots, step count, per-virtual-node state. In
        synchronous training the weights are those the run would have had
        without the switch. Error-feedback residuals stay with the
        variables the new strategy also compresses with error feedback,
        and are dropped for the others (`autodist.runtime.residuals`).

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
        self._requests.replan(strategy)

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
        data, batch_size = fit_input.probe_input(x, y, batch_size, steps,
                                                 self._input_context())
        config = RunConfig(global_batch_size=batch_size, step_timeout_s=self.step_timeout_s,
                           startup_timeout_s=self.startup_timeout_s, job_timeout_s=timeout_s,
                           job_id=uuid.uuid4().hex, probe_steps=steps)
        path, job = self._new_job(config, self._state.initial_values(), data)
        try:
            self._jobs.run(job, timeout_s, lambda: None)
            throughputs = {}
            for i in range(self.resource_spec.num_worker_tasks):
                for device, probe in WorkerResult.from_json(
                        job.result(i).read_bytes()).probe.items():
                    throughputs[device] = probe.examples / float(np.median(probe.seconds))
        except BaseException:
            if self.job_dir is None:
                discard(path)
            raise
        if self.job_dir is None:
            shutil.rmtree(path, ignore_errors=True)
        return throughputs

    # ------------------------------------------------------------ helpers
    def _check_learning_rate(self) -> None:
        """The model's learning rate must still be of the captured kind (a fixed rate or
        a schedule); a fixed rate may have changed since (the run trains with the
        model's, as Keras does)."""
        captured = self.graph_item.optimizer
        fixed = "learning_rate" in captured.hyperparameters
        current = learning_rate_of(self.model)
        if "learning_rate" in self.strategy.hyperparameters or \
                getattr(self.model, "optimizer", None) is None:
            return
        if fixed and current is None or not fixed and current is not None:
            kinds = ("a fixed rate", "a schedule")
            raise AutodistError(
                f"the model's learning rate is {kinds[current is None]} but it was "
                f"{kinds[not fixed]} when the model was captured: capture the model again")

    def _fixed_rate(self) -> str | None:
        """Why callbacks may not change this run's learning rate, or None."""
        if "learning_rate" not in self.graph_item.optimizer.hyperparameters:
            return "the optimizer's learning rate is a schedule"
        if "learning_rate" in self.strategy.hyperparameters:
            return "the strategy sets it (strategy.with_hyperparameters(learning_rate=...))"
        return None

    def _new_job(self, config: RunConfig, init_values: dict[str, np.ndarray],
                 data: fit_input.JobData) -> tuple[pathlib.Path, JobDir]:
        job = JobDir.create(self.job_dir)
        self.last_job_dir = job.path
        job.write(self.graph_item, self.strategy, self.resource_spec, config,
                  init_values, data.inputs, data.targets, data.dataset, data.order)
        return job.path, job

    def _input_context(self) -> fit_input.InputContext:
        return fit_input.InputContext(self.model, self.graph_item, self.strategy,
                                      self.resource_spec.num_worker_tasks, self._dataset_passes)


def _warn_if_oversubscribed(spec: ResourceSpec) -> None:
    """A local cluster of more compute replicas than this machine has cores: every step
    waits for processes that share them (16 workers on 2 cores ran 34x slower per step)."""
    cores = os.cpu_count() or 1
    replicas = len(spec.replica_devices)
    if replicas > cores and not any("/device:GPU:" in d for d in spec.replica_devices):
        warnings.warn(
            f"the local cluster runs {replicas} CPU replicas on this machine's {cores} cores: "
            "they share the cores, so each step is slower than on fewer replicas (the numbers "
            "trained are the same). Use ResourceSpec.local(workers=...) of at most the cores, "
            "or virtual nodes (strategy.with_virtual_nodes) for a fixed global batch",
            UserWarning, stacklevel=3)
