"""DistributedRun: train a Keras model with a Strategy on a cluster, Keras-like."""
from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import shutil
import sys
import time
import uuid
import warnings
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from autodist.adapt.driver import PolicyDriver
from autodist.adapt.policy import Control, Policy, Replanner
from autodist.ir.errors import AutodistError
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.kernels.optimizers import check_supported as check_optimizer
from autodist.launch import heartbeats
from autodist.launch.errors import TaskFailedError
from autodist.launch.job import DatasetFiles, JobDir, RunConfig
from autodist.launch.local import LocalCluster, check_local
from autodist.launch.remote import RemoteCluster
from autodist.launch.signing import load_secret
from autodist.launch.tf_config import check_this_is_the_chief
from autodist.runtime import batching, checkpoint, datasets, follow, keras_data, keras_parity
from autodist.runtime import recovery
from autodist.runtime import optimizer_state, sharded_input
from autodist.runtime import targets as targets_
from autodist.runtime.elastic import check_elastic, check_switch, members_for, segments
from autodist.runtime.entry import TASK_MODULE
from autodist.runtime.history import History, read_results
from autodist.runtime.metric_logs import MetricLogs
from autodist.runtime.options import FitOptions
from autodist.runtime.progress import Progress, learning_rate_of
from autodist.runtime.records import WorkerResult
from autodist.runtime.sharded_input import ShardedDataset

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
            namespace, out of other hosts' reach (`autodist.launch.netns`);
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
    """

    def __init__(self, model, strategy: Strategy, resource_spec: ResourceSpec, *,
                 graph_item: GraphItem | None = None, job_dir: str | None = None,
                 step_timeout_s: float = 60.0, startup_timeout_s: float = 120.0,
                 task_step_delay_s: dict[int, float] | None = None,
                 launch: str = "local", allow_exposed: bool = False,
                 secret_file: str | None = None, keep_optimizer_state: bool = True) -> None:
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
        self.graph_item = graph_item or capture(model)
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
        # The job and config of a followed fit while it runs (for `resize`).
        self._following: tuple[JobDir, RunConfig] | None = None
        self._resize_sequence = 0
        # The membership the running fit was last asked for (None: unchanged).
        self._requested_members: tuple[int, ...] | None = None
        self._members: tuple[int, ...] = tuple(range(resource_spec.num_worker_tasks))
        self._requested_strategy: str | None = None
        self._requested_batch = 0
        self._num_examples: int | None = 0
        self._streaming = False
        # Passes this run's fits started on each dataset (by its seed generators' names).
        self._dataset_passes: dict[tuple[str, ...], int] = {}
        self._resizable: AutodistError | None = None

    def fit(self, x: Any, y: Any = None, *, batch_size: int | None = None, epochs: int = 1,
            steps_per_epoch: int | None = None, shuffle: bool | str = True, seed: int = 0,
            verbose: int = 1, timeout_s: float = 3600.0, checkpoint_dir: str | None = None,
            checkpoint_every_steps: int | None = None,
            checkpoints_to_keep: int | None = None,
            initial_checkpoint: str | None = None,
            callbacks: Sequence[Any] | None = None,
            resize_at: Mapping[int, int | Sequence[int]] | None = None,
            elastic: bool = False,
            switch_at: Mapping[int, Strategy] | None = None,
            policies: Sequence[Policy] | None = None,
            replanner: Replanner | None = None,
            on_failure: str = "stop",
            monitor_every: int = 0,
            validation_data: Any = None,
            validation_split: float = 0.0,
            validation_batch_size: int | None = None,
            validation_steps: int | None = None,
            validation_freq: int | Sequence[int] = 1,
            initial_epoch: int = 0,
            sample_weight: Any = None,
            class_weight: Mapping[int, float] | None = None) -> History:
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
                `autodist.runtime.sharded_input`).
            y: Target array (None with a dataset).
            batch_size: The global batch (split over all replicas); default
                the strategy's fixed global batch when it has virtual nodes
                (any other value is an error), else 32; not given with a
                dataset (its batches are the batches).
            epochs: Passes over the data.
            steps_per_epoch: Steps per epoch (default: all batches).
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
                the fixed-size trajectory) and synchronous updates. Every
                worker's process starts at launch and idles while it is not
                a member. See `autodist.runtime.elastic`. With callbacks,
                only step 0 (the starting size) may be given.
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
            policies: Adaptation policies (`autodist.adapt.policy`) run by
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
                Synchronous strategies, local launch, no callbacks.

        Returns:
            The History (a `keras.callbacks.History`, also set as
            `model.history`), with per-epoch logs and per-step losses and times.
        """
        options = FitOptions(
            batch_size=batch_size, epochs=epochs, steps_per_epoch=steps_per_epoch,
            shuffle=shuffle, seed=seed, verbose=verbose, timeout_s=timeout_s,
            checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None,
            checkpoint_every_steps=checkpoint_every_steps,
            checkpoints_to_keep=checkpoints_to_keep,
            initial_checkpoint=initial_checkpoint, callbacks=callbacks or (),
            resize_at=resize_at, elastic=elastic, switch_at=switch_at,
            policies=policies or (), replanner=replanner, on_failure=on_failure,
            monitor_every=monitor_every, validation_data=validation_data,
            validation_split=validation_split, validation_batch_size=validation_batch_size,
            validation_steps=validation_steps, validation_freq=validation_freq,
            initial_epoch=initial_epoch)
        self._resizable = options.check(self.strategy, self.graph_item, self.resource_spec,
                                        self.launch)
        self._check_learning_rate()
        if options.validation_split:
            if datasets.is_dataset(x) or isinstance(x, ShardedDataset):
                raise AutodistError("validation_split needs arrays; with a dataset, pass "
                                    "validation_data")
            x, y, sample_weight, options.validation_data = _split_validation(
                x, y, sample_weight, options.validation_split)
        job_epochs = options.job_epochs
        streamed = shards = order = None
        if isinstance(x, ShardedDataset):
            shards = self._shards(x, y, options, sample_weight, class_weight, job_epochs)
            inputs, targets, n = [], None, None
            batch_size = shards.global_batch_size
            lengths = shards.epoch_steps
        elif datasets.is_dataset(x):
            streamed = self._stream(x, y, options.batch_size, sample_weight, class_weight,
                                    steps_per_epoch, job_epochs)
            inputs, targets, n = [], None, None
            batch_size = self.strategy.global_batch_size or streamed.batch_size or 0
            lengths = streamed.epoch_steps
            for step, new in (switch_at or {}).items():
                if isinstance(new, Strategy) and \
                        new.global_batch_size != self.strategy.global_batch_size:
                    raise AutodistError(
                        f"switch_at[{step}]: with a dataset the global batch is the dataset's "
                        f"batch; a strategy switched to must keep it (global batch "
                        f"{self.strategy.global_batch_size}); received one with "
                        f"{new.global_batch_size}")
        else:
            inputs, targets, batch_size = self._arrays(x, y, options.batch_size, sample_weight,
                                                       class_weight)
            n = len(targets)
            steps = batching.steps_per_epoch(n, batch_size)
            self._check_batches([len(batching.batch_rows(np.arange(n), s, batch_size))
                                 for s in range(steps)], n, batch_size)
            lengths = [e.steps for e in batching.EpochSchedule(
                n, job_epochs, steps_per_epoch, lambda step: batch_size).array_epochs()]
            if steps_per_epoch and min(lengths) < steps_per_epoch:
                # As Keras warns when its step finds the pass at its end.
                warnings.warn(
                    f"Your input ran out of data: with steps_per_epoch={steps_per_epoch}, "
                    f"epochs read {lengths[:8]}{'...' if len(lengths) > 8 else ''} batches "
                    f"of a pass's {steps} (a pass goes on across epochs until it ends, "
                    "then the next epoch starts a new one), as Keras' fit reads them",
                    UserWarning, stacklevel=2)
            order = batching.keras_order(n, batch_size, shuffle)
        steps = lengths[0]
        plans, switch_plans = options.switch_plans()
        self._members = tuple(range(self.resource_spec.num_worker_tasks))
        if options.membership_may_change:
            self._members = segments(sum(lengths), self.resource_spec.num_worker_tasks,
                                     resize_at, switch_plans)[0].members
        config = RunConfig(global_batch_size=batch_size, epochs=job_epochs,
                           steps_per_epoch=steps_per_epoch,
                           shuffle=shuffle if streamed is None and shards is None else False,
                           seed=seed,
                           step_timeout_s=self.step_timeout_s,
                           startup_timeout_s=self.startup_timeout_s,
                           checkpoint_dir=options.checkpoint_dir,
                           checkpoint_every_steps=checkpoint_every_steps,
                           checkpoints_to_keep=checkpoints_to_keep,
                           task_step_delay_s=self.task_step_delay_s or None,
                           follow_steps=options.followed, job_timeout_s=timeout_s,
                           job_id=uuid.uuid4().hex,
                           resize_at={str(k): v if isinstance(v, int) else sorted(v)
                                      for k, v in resize_at.items()}
                           if resize_at else None, on_failure=on_failure,
                           elastic=options.membership_may_change,
                           monitor_every=monitor_every, switch_at=switch_plans or None,
                           plans=plans or None,
                           epoch_weights=bool(options.callbacks or options.validates),
                           first_epoch=options.initial_epoch)
        init_values = self._initial_values()
        if initial_checkpoint:
            init_values.update(checkpoint.load(initial_checkpoint))
        dataset_files = None if streamed is None else \
            DatasetFiles(streamed.graph, streamed.description.to_json())
        if shards is not None:
            dataset_files = DatasetFiles(b"", shards.description.to_json(), shards.graphs)
        path, job = self._new_job(config, init_values, inputs, targets, dataset_files, order)
        finished = False
        try:
            control = None
            driver = None
            if options.policies:
                control = Control(self, batch_size, replanner)
                control.members = self._members
                driver = PolicyDriver(control, options.policies)
            history = History()
            metric_logs = MetricLogs(self.model, self.graph_item) or None
            progress = Progress(
                job, epochs=job_epochs, steps_per_epoch=steps, verbose=verbose, model=self.model,
                callbacks=options.callbacks, history=history, policies=driver,
                followed=options.followed, epoch_weights=config.epoch_weights,
                load_weights=self._load_weights,
                validate=self._validator(options, None if streamed or shards else batch_size,
                                         lambda: progress.callbacks)
                if options.validates else None,
                metric_logs=metric_logs, initial_epoch=options.initial_epoch,
                wait_s=self.step_timeout_s + self.startup_timeout_s,
                fixed_rate=self._fixed_rate(), read_state=self._read_state)
            self._following = (job, config) if options.followed else None
            self._requested_members = self._requested_strategy = None
            self._requested_batch, self._num_examples = batch_size, n
            self._streaming = streamed is not None or shards is not None
            progress.begin()
            if progress.fixed_rate is None and progress.learning_rate is not None:
                # The model's rate after on_train_begin and the first on_epoch_begin.
                config = dataclasses.replace(config, learning_rate=progress.learning_rate)
                job.write_config(config)
            if on_failure == "continue":
                outcome = recovery.run_recovering(
                    job, self.strategy, self.resource_spec,
                    run_cluster=lambda job_k, spec_k: self._run_cluster(
                        job_k, timeout_s, progress.update, spec_k),
                    write_job=lambda job_k, strategy_k, spec_k, config_k, values: job_k.write(
                        self.graph_item, strategy_k, spec_k, config_k, values, inputs,
                        targets, dataset_files, order),
                    on_new_job=progress.follow)
            else:
                self._run_cluster(job, timeout_s, progress.update)
                outcome = recovery.Outcome(job, self.resource_spec)
            progress.finish_epochs()
            self._write_back(outcome.job)
            progress.finish()
            finished = True
        except KeyboardInterrupt:
            self._keep_interrupted_weights(job)
            raise
        except TaskFailedError as error:
            # As after Ctrl-C, what was trained is kept: the error says which step.
            raise self._keep_failed_weights(job, options.checkpoint_dir, error) from error
        finally:
            self._following = None
            if self.job_dir is None and not finished:
                _discard(path)
        read_results(history, outcome.job, job_epochs, outcome.spec,
                     outcome.earlier_losses, outcome.earlier_times, options.initial_epoch,
                     None if outcome.recoveries else metric_logs)
        if streamed is not None:   # as after Keras' fit, a later fit reshuffles anew
            key = streamed.seed_generators
            self._dataset_passes[key] = self._dataset_passes.get(key, 0) + \
                datasets.start_passes_like_keras(x, streamed, steps_per_epoch,
                                                 len(history.epoch))
        history.recoveries = outcome.recoveries
        if outcome.recoveries:  # the failed jobs' metric states are lost: no estimates
            for key in [k for k in history.history if k != "loss"]:
                del history.history[key]
        history.actions = control.actions if control is not None else []
        if self.job_dir is None:
            shutil.rmtree(path, ignore_errors=True)
        return history

    def resize(self, workers: int | Sequence[int]) -> tuple[int, ...]:
        """Asks the running `fit(..., elastic=True)` to go on with other workers.

        Call it from a callback (a policy) while `fit` runs. The new
        membership starts one step ahead of the chief, at a step boundary
        all workers meet; the global batch and the virtual nodes stay fixed,
        so the numbers do not change. History's `resizes` lists when it
        happened and on which tasks.

        Args:
            workers: A number n: the current members grown or shrunk to n
                (shrinking drops the highest-numbered members, growing adds
                the lowest-numbered idle tasks; `elastic.resized`). Or the
                worker task indices to run on, e.g. [0, 2, 3] to drop worker
                1; they must include the chief, task 0.

        Returns:
            The member tasks asked for.

        Raises:
            AutodistError: no elastic fit with callbacks is running, the
                strategy cannot resize (`elastic.check_elastic`), `workers`
                is not in 1..(workers of the spec), or the tasks are
                unknown, repeated or leave out the chief.
        """
        self._following_elastic("resize(workers)")
        if self._resizable is not None:
            raise self._resizable
        limit = self.resource_spec.num_worker_tasks
        current = self._requested_members or self._members
        members = members_for(current, workers, limit, "resize's workers")
        self._requested_members = members
        self._request_change()
        return members

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
        self._following_elastic("replan(strategy)")
        _, config = self._following
        if self._streaming and strategy.global_batch_size != self.strategy.global_batch_size:
            raise AutodistError(
                "with a dataset the global batch is the dataset's batch; a strategy switched "
                f"to must keep it (global batch {self.strategy.global_batch_size}); received "
                f"one with {strategy.global_batch_size}")
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
                              self._requested_members, self._requested_strategy)

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
        dataset_files = None
        if isinstance(x, ShardedDataset):
            if y is not None or batch_size is not None:
                raise AutodistError("with a ShardedDataset, pass neither y nor batch_size: "
                                    "its shards yield (x, y) batches of the global batch it "
                                    "names")
            shards = sharded_input.prepare(x, self.graph_item, self.strategy,
                                           self.resource_spec.num_worker_tasks,
                                           steps_per_epoch=steps + 1, epochs=1)
            if shards.epoch_steps[0] < steps + 1:
                raise AutodistError(f"measuring {steps} steps reads {steps + 1} batches (one "
                                    f"to warm up); the shards have {shards.epoch_steps[0]}")
            inputs, targets = [], None
            batch_size = shards.global_batch_size
            dataset_files = DatasetFiles(b"", shards.description.to_json(), shards.graphs)
        elif datasets.is_dataset(x):
            streamed = self._stream(x, y, batch_size, None, None, steps + 1, 1)
            if streamed.epoch_steps[0] < steps + 1:
                raise AutodistError(f"measuring {steps} steps reads {steps + 1} batches (one "
                                    f"to warm up); the dataset has {streamed.epoch_steps[0]}")
            inputs, targets = [], None
            batch_size = self.strategy.global_batch_size or streamed.batch_size or 0
            dataset_files = DatasetFiles(streamed.graph, streamed.description.to_json())
        else:
            inputs, targets, batch_size = self._arrays(x, y, batch_size)
            n = len(targets)
            self._check_batches([len(batching.batch_rows(np.arange(n), 0, batch_size))], n,
                                batch_size)
        config = RunConfig(global_batch_size=batch_size, step_timeout_s=self.step_timeout_s,
                           startup_timeout_s=self.startup_timeout_s, job_timeout_s=timeout_s,
                           job_id=uuid.uuid4().hex, probe_steps=steps)
        path, job = self._new_job(config, self._initial_values(), inputs, targets,
                                  dataset_files)
        try:
            self._run_cluster(job, timeout_s, lambda: None)
            throughputs = {}
            for i in range(self.resource_spec.num_worker_tasks):
                for device, probe in WorkerResult.from_json(
                        job.result(i).read_bytes()).probe.items():
                    throughputs[device] = probe.examples / float(np.median(probe.seconds))
        except BaseException:
            if self.job_dir is None:
                _discard(path)
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

    def _arrays(self, x, y, batch_size: int | None, sample_weight: Any = None,
                class_weight: Any = None):
        """(inputs, targets and sample weights as one array, global batch) from fit's
        arguments, checked."""
        if y is None:
            raise AutodistError("fit needs targets y (or a dataset of (x, y) batches)")
        fixed = self.strategy.global_batch_size
        if fixed is not None and batch_size not in (None, fixed):
            raise AutodistError(
                f"the strategy fixes the global batch at {fixed} examples "
                f"({self.strategy.num_virtual_nodes} virtual nodes); fit received batch_size "
                f"{batch_size}. Leave batch_size out or change the strategy's virtual nodes")
        batch_size = (fixed or 32) if batch_size is None else batch_size
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
                or batch_size < 1:
            raise AutodistError(f"batch_size must be an integer >= 1. Received: {batch_size!r}")
        if sample_weight is not None and class_weight is not None:
            raise AutodistError("give sample_weight or class_weight, not both (as Keras)")
        data = keras_data.fit_arrays(x, y, sample_weight, self.graph_item)
        weights = data.weights
        if class_weight is not None:
            weights = targets_.class_weights(class_weight, data.targets)
            data = keras_data.fit_arrays(x, y, weights, self.graph_item)
            weights = data.weights
        if weights is not None:
            self._check_weighted(np.concatenate([np.ravel(w) for w in weights])
                                 if isinstance(weights, list) else weights)
        return data.inputs, targets_.pack(data.targets, weights), int(batch_size)

    def _shards(self, sharded: ShardedDataset, y: Any, options: FitOptions,
                sample_weight: Any, class_weight: Any,
                epochs: int) -> sharded_input.PreparedShards:
        """Each worker task's shard, made ready (see `sharded_input.prepare`); refuses
        what a run whose workers each read a fixed share cannot do."""
        if y is not None or options.batch_size is not None or sample_weight is not None:
            raise AutodistError("with a ShardedDataset, pass neither y, sample_weight nor "
                                "batch_size: its shards yield (x, y[, sample_weight]) "
                                "batches of the global batch it names")
        fixed = [name for name, value in (
            ("policies (which may resize or re-plan)", options.policies),
            ("elastic=True", options.elastic), ("resize_at", options.resize_at),
            ("switch_at", options.switch_at),
            ("on_failure='continue'", options.on_failure == "continue")) if value]
        if fixed:
            raise AutodistError(
                f"{fixed[0]} cannot work with a ShardedDataset: each worker task reads a fixed "
                "share of every global batch, so the workers and the strategy cannot change "
                "during the run; pass a tf.data.Dataset (every worker reads every batch) or "
                "arrays")
        return sharded_input.prepare(sharded, self.graph_item, self.strategy,
                                     self.resource_spec.num_worker_tasks,
                                     steps_per_epoch=options.steps_per_epoch, epochs=epochs,
                                     class_weight=class_weight)

    def _stream(self, dataset, y: Any, batch_size: int | None, sample_weight: Any,
                class_weight: Any, steps_per_epoch: int | None,
                epochs: int) -> datasets.StreamedDataset:
        """A dataset made ready for the workers to read (see `datasets.prepare`).

        As Keras, `batch_size` is ignored (the dataset's batches are the batches),
        and y or sample_weight are refused (the dataset yields them)."""
        del batch_size
        if y is not None or sample_weight is not None:
            raise AutodistError("with a dataset, pass neither y nor sample_weight (as Keras): "
                                "the dataset yields (x, y[, sample_weight]) batches. Received "
                                f"y={'an array' if y is not None else None}, sample_weight="
                                f"{'an array' if sample_weight is not None else None}")
        streamed = datasets.prepare(
            dataset, self.graph_item, steps_per_epoch=steps_per_epoch, epochs=epochs,
            num_virtual_nodes=self.strategy.num_virtual_nodes,
            fixed_batch=self.strategy.global_batch_size, class_weight=class_weight,
            earlier_passes=self._dataset_passes)
        if streamed.description.weighted:
            self._check_weighted(None)
        return streamed

    def _check_weighted(self, weights: np.ndarray | None) -> None:
        """Sample weights need a step that takes them, and losses that average over the
        batch (a replica's loss weighted by its share of the batch reproduces a mean
        over the batch, not one over the weights' sum).

        Args:
            weights: The per-example weights, or None when not known before the
                run (a dataset's).
        """
        if self.graph_item.sample_weight_input is None:
            raise AutodistError(f"the capture of {self.graph_item.name!r} takes no sample "
                                "weights (a function or v1 graph, or an old capture): capture "
                                "the Keras model again")
        losses = getattr(self.model, "loss", None)
        losses = list(losses.values()) if isinstance(losses, dict) else \
            list(losses) if isinstance(losses, (list, tuple)) else [losses]
        for loss in losses:
            if getattr(loss, "reduction", None) == "mean_with_sample_weight" and (
                    weights is None or not np.all(weights == weights[0])):
                raise AutodistError(
                    f"loss {getattr(loss, 'name', type(loss).__name__)!r} divides by the sum "
                    "of the sample weights (reduction='mean_with_sample_weight'), which a "
                    "data-parallel step does not reproduce with uneven weights (a dataset's "
                    "weights are not known before the run); use the default reduction "
                    "'sum_over_batch_size'")

    def _check_batches(self, sizes: list[int], n: int, batch_size: int) -> None:
        if min(sizes) < self.strategy.num_virtual_nodes:
            raise AutodistError(
                f"the last batch of an epoch has {min(sizes)} examples ({n} examples, batch "
                f"{batch_size}), fewer than the {self.strategy.num_virtual_nodes} "
                "virtual nodes or replicas that split it; drop the remainder "
                "(steps_per_epoch) or change the number of examples")

    def _new_job(self, config: RunConfig, init_values, inputs, targets,
                 dataset: DatasetFiles | None = None, order: np.ndarray | None = None):
        job = JobDir.create(self.job_dir)
        path = job.path
        self.last_job_dir = path
        job.write(self.graph_item, self.strategy, self.resource_spec, config,
                  init_values, inputs, targets, dataset, order)
        return path, job

    def _run_cluster(self, job: JobDir, timeout_s: float, on_poll,
                     spec: ResourceSpec | None = None) -> None:
        """Runs the job to its end. A failed worker leaves the chief time to save its
        state (it learns of the failure within a step's timeout) before the cluster
        is torn down."""
        spec = spec or self.resource_spec
        cluster = (LocalCluster(job, spec, task_module=TASK_MODULE,
                                allow_exposed=self.allow_exposed,
                                hang_timeout_s=heartbeats.hang_timeout(self.step_timeout_s))
                   if self.launch == "local"
                   else RemoteCluster(job, spec, task_module=TASK_MODULE,
                                      worker_rows=lambda task: _rows_read_by(job, task),
                                      startup_timeout_s=self.startup_timeout_s,
                                      secret=self._secret))
        with cluster:
            cluster.wait_ready(self.startup_timeout_s)
            try:
                cluster.wait_workers(timeout_s, on_poll=on_poll)
            except TaskFailedError as error:
                if recovery.dead_worker(error.task) is not None:
                    cluster.wait_exit("worker", 0, self.step_timeout_s + 30.0)
                raise
            except KeyboardInterrupt:
                # As Keras keeps the weights trained so far: the chief stops at its
                # next step and writes them (bounded; a second Ctrl-C gives up).
                follow.request_stop(job)
                deadline = time.monotonic() + self.step_timeout_s
                try:
                    while not job.file("final_weights.npz").exists() and \
                            time.monotonic() < deadline and \
                            cluster.wait_exit("worker", 0, 0.05) is None:
                        pass
                except KeyboardInterrupt:
                    pass
                raise

    def _initial_values(self) -> dict[str, np.ndarray]:
        from autodist.ir.capture import keras_variable_names

        trainable, state = keras_variable_names(self.model)
        values = {n: np.asarray(v.numpy()) for n, v in zip(trainable,
                                                             self.model.trainable_variables)}
        non_trainable = [v for v in self.model.variables if not v.trainable]
        values.update({n: np.asarray(v.numpy()) for n, v in zip(state, non_trainable)})
        values.update(optimizer_state.read(self.model, self.graph_item))
        return values

    def _write_back(self, job: JobDir) -> None:
        """The trained weights, and the optimizer's state, into the model (as after Keras'
        fit, a later fit goes on from both)."""
        with np.load(job.file("final_weights.npz")) as weights:
            self._load_weights(weights)
            if self.keep_optimizer_state:
                optimizer_state.write(self.model, self.graph_item, weights)

    def _load_weights(self, weights) -> None:
        """Puts trained values (by variable name: an .npz or a dict) into the model."""
        from autodist.ir.capture import keras_variable_names

        trainable, state = keras_variable_names(self.model)
        non_trainable = [v for v in self.model.variables if not v.trainable]
        names = set(weights.files if hasattr(weights, "files") else weights)
        for name, var in list(zip(trainable, self.model.trainable_variables)) + \
                list(zip(state, non_trainable)):
            if name in names:
                var.assign(weights[name])

    def _read_state(self) -> dict[str, np.ndarray]:
        """The model's state variables by capture name (see `Progress`)."""
        from autodist.ir.capture import keras_variable_names

        _, state = keras_variable_names(self.model)
        return {n: np.asarray(v.numpy()) for n, v in
                zip(state, [v for v in self.model.variables if not v.trainable])}

    def _keep_failed_weights(self, job: JobDir, checkpoint_dir: str | None,
                             error: TaskFailedError) -> TaskFailedError:
        """After a task failed: the newest trained state that survived goes into the
        model, and the returned error (`error`'s, continued) says which.

        The chief saves the state after the last step every replica completed
        when its step fails (steps are atomic: a failed step applied nothing);
        where the chief or a parameter server died, the newest checkpoint of
        `checkpoint_dir` stands in; else the model is unchanged.
        """
        held = "the model is unchanged: no trained state could be read back (the chief or a " \
               "parameter server failed, and no checkpoint was written: fit(checkpoint_dir=...) " \
               "keeps one)"
        try:
            saved = recovery.newest_saved_state(job)
            if saved is not None:
                values, next_step = saved
                self._load_state(values)
                held = (f"the model holds the weights after step {next_step} of the run, the "
                        "last step every replica completed")
            elif checkpoint_dir and checkpoint.latest(checkpoint_dir) is not None:
                prefix = checkpoint.latest(checkpoint_dir)
                self._load_state(checkpoint.load(prefix))
                held = f"the model holds the newest checkpoint, {prefix.parent}"
        except (OSError, ValueError, KeyError, AutodistError) as e:
            held = f"the model is unchanged: its trained state could not be read back ({e})"
        print(f"autodist: task {error.task} failed; {held}", file=sys.stderr, flush=True)
        return TaskFailedError(f"{error}\n{held}", error.task, error.log)

    def _load_state(self, values: Mapping[str, np.ndarray]) -> None:
        """Weights (and, kept between fits, the optimizer's state) into the model."""
        self._load_weights(values)
        if self.keep_optimizer_state:
            optimizer_state.write(self.model, self.graph_item, values)

    def _keep_interrupted_weights(self, job: JobDir) -> None:
        """After Ctrl-C: the weights the chief trained so far go into the model, if it
        wrote them in time."""
        if job.file("final_weights.npz").exists():
            self._write_back(job)
            print("autodist: interrupted; the model holds the weights trained so far",
                  file=sys.stderr, flush=True)
        else:
            print("autodist: interrupted before the chief could send its weights; the model "
                  "is unchanged", file=sys.stderr, flush=True)

    def _validator(self, options: FitOptions, batch_size: int,
                   callbacks: Callable[[], Any]) -> Callable[[int], dict[str, float]]:
        """Epoch -> its ``val_*`` logs: Keras' `evaluate` in this process, on the model
        holding that epoch's weights (as Keras' `fit` runs it), or {} when
        `validation_freq` skips the epoch."""
        val_x, val_y, val_weight = _unpack_validation(options.validation_data)

        def validate(epoch: int) -> dict[str, float]:
            if not options.should_validate(epoch):
                return {}
            logs = self.model.evaluate(
                val_x, val_y, sample_weight=val_weight,
                batch_size=None if datasets.is_dataset(val_x) else
                options.validation_batch_size or batch_size,
                steps=options.validation_steps, callbacks=callbacks(), verbose=0,
                return_dict=True)
            return {f"val_{name}": float(value) for name, value in logs.items()}

        return validate

def _split_validation(x: Any, y: Any, sample_weight: Any, fraction: float
                      ) -> tuple[Any, Any, Any, tuple[Any, ...]]:
    """Keras' `validation_split`: the last `fraction` of the examples, before any shuffling.

    Returns:
        (training x, training y, training sample weights, validation data).
    """
    def split(value, start, end):
        if value is None:
            return None
        if isinstance(value, dict):
            return {k: split(v, start, end) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [split(v, start, end) for v in value]
        return value[start:end]

    first = x
    while isinstance(first, (list, tuple, dict)):
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    n = len(first)
    split_at = int(math.floor(n * (1.0 - fraction)))
    if split_at in (0, n):
        raise AutodistError(f"validation_split={fraction} leaves no examples for training or "
                            f"for validation ({n} examples)")
    validation = (split(x, split_at, n), split(y, split_at, n))
    if sample_weight is not None:
        validation += (split(sample_weight, split_at, n),)
    return (split(x, 0, split_at), split(y, 0, split_at), split(sample_weight, 0, split_at),
            validation)


def _unpack_validation(data: Any) -> tuple[Any, Any, Any]:
    """(x, y, sample_weight) of `validation_data`, as Keras unpacks it."""
    if datasets.is_dataset(data):
        return data, None, None
    if isinstance(data, tuple) and len(data) in (2, 3):
        return data[0], data[1], data[2] if len(data) == 3 else None
    raise AutodistError("validation_data must be (x, y), (x, y, sample_weight) or a "
                        f"tf.data.Dataset. Received: {type(data).__name__}"
                        + (f" of {len(data)} items" if isinstance(data, (tuple, list)) else ""))


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


def _discard(path: pathlib.Path) -> None:
    """A temporary job directory after a failure: its copy of the data goes, and its logs
    stay where a task wrote any (an error names them); a run refused before any task
    started leaves nothing."""
    logs = path / "logs"
    if not any(log.stat().st_size for log in logs.glob("*.log")) if logs.is_dir() else True:
        shutil.rmtree(path, ignore_errors=True)
        return
    for name in ("data", "init.npz", "final_weights.npz", "weights", "recovery.npz"):
        target = path / name
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        elif target.exists():
            target.unlink()


def _rows_read_by(job: JobDir, task_index: int) -> np.ndarray | None:
    """The rows of the job's data that worker task `task_index` reads over the run (None:
    a job with a dataset, which every worker reads whole)."""
    if job.dataset() is not None:
        return None
    config = job.config()
    num_examples, _ = job.shard()
    devices = job.strategy().virtual_node_devices
    prefix = f"/job:worker/task:{task_index}/"
    mine = [i for i, d in enumerate(devices) if d.startswith(prefix)]
    schedule = batching.EpochSchedule(num_examples, config.epochs, config.steps_per_epoch,
                                      lambda step: config.global_batch_size)
    order = batching.ArrayOrder(num_examples, config.shuffle, config.seed, config.first_epoch,
                                job.order())
    return batching.rows_read(schedule, order, len(devices), mine)
