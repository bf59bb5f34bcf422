"""The driver's side of a running fit: Keras' callbacks and progress bar, and the policies.

The chief appends one `ProgressRecord` per step to ``progress.jsonl``; the
driver tails it (`Progress.update`, polled while the cluster runs) and drives
a `keras.callbacks.CallbackList` with Keras' hooks and logs: the user's
callbacks, the fit's `History` and, with `verbose`, Keras' own progress bar.
It feeds the policies each step's metrics, and in a followed run (the user's
callbacks, policies or validation) writes its decisions back for the chief
(`autodist.runtime.follow`).

A learning rate a callback sets between epochs (`ReduceLROnPlateau`,
`LearningRateScheduler`) travels with the driver's decision at the epoch's
end and applies from the next epoch's first step, as in Keras; the next
epoch's `on_epoch_begin` runs before that step does.

In a followed run the records hold the global loss. Before a callback sees
an epoch's end, the model gets that epoch's trained weights (the chief sends
them), so `ModelCheckpoint`, `EarlyStopping(restore_best_weights=True)` or
a validation pass see what Keras would show them. The last epoch's end, and
the end of one reached after a stop request (the run's last, too), wait for
the run's final weights. Without followers the records hold the chief's
estimate of the loss (its replicas' mean): the progress bar shows it, and the
History gets the exact values when the run ends.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import keras
import numpy as np

from autodist.adapt.driver import PolicyDriver
from autodist.adapt.policy_interface import StepMetrics
from autodist.ir.errors import AutodistError
from autodist.kernels import monitoring
from autodist.launch.job import JobDir
from autodist.runtime import follow, steps_per_execution
from autodist.runtime.history import NOISE_DECAY, History
from autodist.runtime.records import ProgressRecord, add_states

_POLL_S = 0.01


class Progress:
    """Follows the chief's progress records; calls the callbacks and policies.

    Args:
        job: The job directory the chief writes to.
        epochs: Epochs the job runs.
        steps_per_epoch: Steps of its first epoch (the progress bar's target).
        verbose: 0 silent, 1 Keras' progress bar, 2 one line per epoch.
        model: The user's model (the callbacks' `model`).
        callbacks: The user's Keras callbacks.
        history: The fit's History (a callback too).
        policies: The policies' driver, or None.
        followed: The chief waits for the driver's decision at each epoch's end.
        epoch_weights: The chief sends each epoch's trained weights (to load
            into the model before `on_epoch_end`).
        load_weights: Puts a file of trained weights (by variable name) into
            the model.
        validate: Epoch -> its validation logs (``val_*``), run with the
            model holding that epoch's weights; None without validation.
        metric_logs: The compiled metrics' logs from their summed state.
        initial_epoch: The index of the job's first epoch (`fit(initial_epoch=)`).
        steps_per_execution: The model's `compile(steps_per_execution=k)`: the batch
            hooks are called as Keras calls them for k steps a call (once per group
            of k; `autodist.runtime.steps_per_execution`).
        wait_s: Bound on waiting for an epoch's weights.
        fixed_rate: Why the run cannot change its learning rate (a schedule, a
            strategy that fixes it), or None: callbacks may change it between
            epochs (`learning_rate` is then the rate of the next epoch).
        read_state: The model's state variables (seed generators, moving
            statistics) by capture name. What validation or a callback changes
            of them at an epoch's end (a validation pass advances an LSTM's
            dropout seed, as in Keras) goes back to the workers with the
            decision, so the next epoch starts from it as Keras' would.
    """

    def __init__(self, job: JobDir, *, epochs: int, steps_per_epoch: int, verbose: int, model,
                 callbacks: Sequence[Any], history: History,
                 policies: PolicyDriver | None = None, followed: bool = False,
                 epoch_weights: bool = False,
                 load_weights: Callable[[Any], None] | None = None,
                 validate: Callable[[int], dict[str, float]] | None = None,
                 metric_logs: Callable[[Sequence[Any]], dict[str, float]] | None = None,
                 initial_epoch: int = 0, steps_per_execution: int = 1,
                 wait_s: float = 60.0,
                 fixed_rate: str | None = None,
                 read_state: Callable[[], dict[str, np.ndarray]] | None = None) -> None:
        self.job = job
        self.path = job.file("progress.jsonl")
        self.epochs = epochs
        self.initial_epoch = initial_epoch
        self.steps_per_execution = steps_per_execution
        self.model = model
        self.history = history
        self.callbacks = keras.callbacks.CallbackList(
            list(callbacks) + [history], add_progbar=verbose != 0, model=model,
            verbose=verbose, epochs=initial_epoch + epochs, steps=steps_per_epoch)
        self.policies = policies
        self.followed = followed
        self.epoch_weights = epoch_weights
        self.load_weights = load_weights
        self.validate = validate
        self.metric_logs = metric_logs
        self.wait_s = wait_s
        self.seen = 0
        self._offset = 0
        self._noise = monitoring.SmoothedNoiseScale(NOISE_DECAY)
        self._epoch_open: int | None = None  # the job's epoch index
        self._sum = 0.0
        self._count = 0
        self._metric_states: tuple = ()
        self._pending: tuple[int, dict[str, float]] | None = None  # an end left to `finish`
        self._group_end: int | None = None  # a group of steps begun, not ended
        self._logs: dict[str, float] = {}
        self._stop_sent = False
        self.fixed_rate = fixed_rate
        self.learning_rate = learning_rate_of(model)
        self.read_state = read_state
        # Batch hooks only where a callback implements one: a batch's logs (the
        # metrics' results from their state, in eager TensorFlow) cost this process
        # milliseconds a step, taken from the workers' cores.
        self._batch_hooks = any(_implements(c, hook) for c in self.callbacks.callbacks
                                for hook in _BATCH_HOOKS)

    # ------------------------------------------------------------ the fit
    def begin(self) -> None:
        """`on_train_begin` and the first epoch's `on_epoch_begin`, before any step runs
        (a learning rate they set is the run's first: `learning_rate`)."""
        self.model.stop_training = False
        self._dispatch("on_train_begin")
        if self.policies is not None:
            self.policies.begin()
            self._check_stop()
        self._open_epoch(0)

    def update(self) -> None:
        """Reads the records written since the last call and dispatches them."""
        for record in self._read_new():
            self._step(record)

    def finish_epochs(self) -> None:
        """After the job: the records left, and an epoch the run stopped inside.

        The end of an epoch that needs the final weights (the last one, or
        one cut short) is left to `finish`.
        """
        self.update()
        if self._epoch_open is not None:  # stopped inside an epoch: Keras still ends it
            self._end_group()
            self._pending = (self._epoch_open, self._epoch_logs())
            self._epoch_open = None

    def finish(self) -> None:
        """With the final weights in the model: the last epoch's end, then the train end."""
        if self._pending is not None:
            epoch, logs = self._pending
            self._pending = None
            # The chief may have sent this epoch's weights too (a stop decided at its end).
            follow.epoch_weights_path(self.job, epoch).unlink(missing_ok=True)
            self._close_epoch(epoch, logs)
        self._dispatch("on_train_end", dict(self._logs))
        if self.policies is not None:
            self.policies.end()

    def follow(self, job: JobDir) -> None:
        """Reads the progress of `job` from now on (a job resumed after a failure)."""
        self.update()
        self.job = job
        self.path = job.file("progress.jsonl")
        self._offset = 0

    # ----------------------------------------------------------- records
    def _read_new(self) -> list[ProgressRecord]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # only whole lines: the chief may be mid-write
        self._offset += end
        records = [ProgressRecord.from_json(line) for line in chunk[:end].splitlines()
                   if line.strip()]
        self.seen += len(records)
        return records

    def _open_epoch(self, epoch: int) -> None:
        """`on_epoch_begin` of the job's epoch `epoch`."""
        self._epoch_open, self._sum, self._count = epoch, 0.0, 0
        self._group_end = None
        self._metric_states = ()
        self._dispatch("on_epoch_begin", self.initial_epoch + epoch, {})

    def _step(self, record: ProgressRecord) -> None:
        epoch, step = record.epoch, record.epoch_step
        if self._epoch_open != epoch:
            self._open_epoch(epoch)
        # Keras' batch logs hold the running mean of the epoch, batches weighted by size,
        # and the metrics over the epoch so far.
        self._sum += record.loss * record.examples
        self._count += record.examples
        self._metric_states = add_states(self._metric_states, record.metrics)
        if self._batch_hooks:
            begin, end = steps_per_execution.batch_hooks(step, self.steps_per_execution,
                                                         last=record.last_of_epoch)
            if begin is not None:
                self._dispatch("on_train_batch_begin", begin, {})
                self._group_end = begin + self.steps_per_execution - 1
            if end is not None:
                self._group_end = None
                self._dispatch("on_train_batch_end", end, self._epoch_logs())
        if self.policies is not None:
            self.policies.step(step_metrics(record, self._noise))
            self._check_stop()
        if record.last_of_epoch:
            self._epoch_open = None
            # The last epoch, or one ended after a stop request (the chief stops at the
            # next step boundary, which may be this epoch's end, without the epoch's
            # weights): its end needs the final weights.
            if epoch == self.epochs - 1 or self._stop_sent:
                self._pending = (epoch, self._epoch_logs())
                return
            if self.epoch_weights:
                self._load_epoch_weights(epoch)
            before = self.read_state() if self.read_state is not None else {}
            self._close_epoch(epoch, self._epoch_logs())
            if not self.model.stop_training:
                # Keras calls it before the next epoch's first step, which waits for it.
                self._open_epoch(epoch + 1)
            if self.followed:
                after = self.read_state() if self.read_state is not None else {}
                changed = {name: value for name, value in after.items()
                           if name in before and not np.array_equal(value, before[name])}
                follow.write_decision(self.job, epoch, stop=bool(self.model.stop_training),
                                      learning_rate=self.learning_rate, state=changed)

    def _end_group(self) -> None:
        """`on_train_batch_end` of a group of steps the run stopped inside (Keras ends
        every group it begins)."""
        if self._group_end is not None:
            end, self._group_end = self._group_end, None
            self._dispatch("on_train_batch_end", end, self._epoch_logs())

    def _epoch_logs(self) -> dict[str, float]:
        logs = {"loss": self._sum / max(self._count, 1)}
        if getattr(self.metric_logs, "complete", False):  # a custom step's own logs
            return self.metric_logs(self._metric_states)
        if self.metric_logs is not None:
            logs.update(self.metric_logs(self._metric_states))
        return logs

    def _close_epoch(self, epoch: int, logs: dict[str, float]) -> None:
        """`on_epoch_end` of the job's epoch `epoch`, validation logs included."""
        index = self.initial_epoch + epoch
        if self.validate is not None:
            logs = {**logs, **self.validate(index)}
        self._logs = logs
        self._dispatch("on_epoch_end", index, dict(logs))
        if self.policies is not None:
            self.policies.epoch_end(index, dict(logs))
            self._check_stop()

    def _load_epoch_weights(self, epoch: int) -> None:
        """Waits (bounded) for the chief's weights after `epoch`, puts them into the model."""
        path = follow.epoch_weights_path(self.job, epoch)
        deadline = time.monotonic() + self.wait_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise follow.FollowError(
                    f"the chief did not send the weights after epoch {epoch} within "
                    f"{self.wait_s:g}s (log: {self.job.log('worker', 0)})")
            time.sleep(_POLL_S)
        with np.load(path) as weights:
            self.load_weights(weights)
        path.unlink()

    def _dispatch(self, hook: str, *args) -> None:
        """Calls `hook` on every callback. A learning rate a callback sets between
        epochs (`on_train_begin`, `on_epoch_begin`, `on_epoch_end`) is the next epoch's;
        inside an epoch the workers have run ahead, so a change there is refused."""
        callers = [c for c in self.callbacks.callbacks if _implements(c, hook)]
        if not callers:
            self._send_stop_if_asked()
            return
        # Keras' own loggers never touch the optimizer: no need to read its rate
        # (an eager read, twice a hook) around them.
        watch = any(not isinstance(c, _LOGGERS) for c in callers)
        rate = learning_rate_of(self.model) if watch else self.learning_rate
        getattr(self.callbacks, hook)(*args)
        changed = learning_rate_of(self.model) if watch else rate
        if changed != rate:
            # The callbacks that implement this hook (Keras' base class does nothing).
            names = " or ".join(sorted({type(c).__name__ for c in callers}))
            between_epochs = hook in ("on_train_begin", "on_epoch_begin", "on_epoch_end")
            if not between_epochs or self.fixed_rate is not None:
                why = f"this run's learning rate is fixed: {self.fixed_rate}" \
                    if between_epochs else \
                    "the workers run ahead of the driver inside an epoch, so the run changes " \
                    "the rate only between epochs (on_epoch_begin / on_epoch_end)"
                raise AutodistError(
                    f"callback {names} changed the optimizer's learning rate in {hook} (from "
                    f"{_rate_text(rate)} to {_rate_text(changed)}); {why}. Use a "
                    "keras.optimizers.schedules.LearningRateSchedule for a rate that "
                    "changes every step")
            self.learning_rate = changed
        self._send_stop_if_asked()

    def _check_stop(self) -> None:
        if self.policies.control.stop_requested:
            self.model.stop_training = True
        self._send_stop_if_asked()

    def _send_stop_if_asked(self) -> None:
        if self.model.stop_training and not self._stop_sent:
            follow.request_stop(self.job)
            self._stop_sent = True


_BATCH_HOOKS = ("on_train_batch_begin", "on_train_batch_end")  # and their old names: _ALIASES
_LOGGERS = (keras.callbacks.ProgbarLogger, keras.callbacks.History)


# Keras' base class forwards the training batch hooks to their old names.
_ALIASES = {"on_train_batch_begin": "on_batch_begin", "on_train_batch_end": "on_batch_end"}


def _implements(callback, hook: str) -> bool:
    """Whether `callback` implements `hook` (Keras' base class does nothing); a
    `LambdaCallback` sets its hooks on the instance."""
    return any(getattr(getattr(callback, name), "__func__", None)
               is not getattr(keras.callbacks.Callback, name)
               for name in (hook, _ALIASES.get(hook, hook)))


def learning_rate_of(model) -> float | None:
    """The value of a Keras model's fixed learning rate (None: a schedule, or no optimizer)."""
    optimizer = getattr(model, "optimizer", None)
    # A LossScaleOptimizer's rate is its inner optimizer's (its own stays 0).
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    rate = getattr(optimizer, "_learning_rate", None)
    if rate is None or callable(rate) or not hasattr(rate, "numpy"):
        return None
    return float(np.asarray(rate.numpy()))


def _rate_text(rate: float | None) -> str:
    return "a schedule" if rate is None else f"{rate:g}"


def step_metrics(record: ProgressRecord,
                 noise: monitoring.SmoothedNoiseScale) -> StepMetrics:
    """What a policy sees of a step; `noise` smooths the noise scale over the run."""
    smoothed = variance = compute = communication = None
    per_worker: dict[int, float] = {}
    if record.monitor is not None:
        per_worker = record.monitor.examples_per_s()
        if record.monitor.compute_s:
            compute = max(record.monitor.compute_s)
            communication = max(0.0, record.seconds - compute)
        estimate = monitoring.noise_scale_fit(record.monitor.batches, record.monitor.sq_norms)
        if estimate is not None:
            smoothed = noise.update(estimate)
            variance = estimate.trace_sigma
    return StepMetrics(
        step=record.step, epoch=record.epoch, loss=record.loss, seconds=record.seconds,
        examples_per_s=record.examples / record.seconds if record.seconds > 0 else 0.0,
        workers=record.workers, plan=record.plan, per_worker=per_worker, noise_scale=smoothed,
        gradient_variance=variance, compute_s=compute, communication_s=communication)
