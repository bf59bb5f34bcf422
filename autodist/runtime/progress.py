"""The driver's side of a running fit: the progress line, the callbacks and the policies.

The chief appends one `ProgressRecord` per step to ``progress.jsonl``; the
driver tails it (`Progress.update`, polled while the cluster runs), shows the
progress line, calls the Keras callbacks with Keras' hooks and logs, feeds
the policies each step's metrics, and writes its decisions back for the
chief (`autodist.runtime.follow`).
"""
from __future__ import annotations

import sys
from typing import Any

from autodist.adapt.driver import PolicyDriver
from autodist.adapt.policy import StepMetrics
from autodist.kernels import monitoring
from autodist.launch.job import JobDir
from autodist.runtime import follow
from autodist.runtime.history import NOISE_DECAY
from autodist.runtime.records import ProgressRecord


class Progress:
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
        self._last: ProgressRecord | None = None
        self._noise = monitoring.SmoothedNoiseScale(NOISE_DECAY)
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
                             f"- loss: {self._last.loss:.4f} - "
                             f"{self._last.seconds * 1e3:.1f} ms/step")
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

    def _step(self, record: ProgressRecord) -> None:
        epoch, step = record.epoch, record.epoch_step
        if self._epoch_open != epoch:
            self._epoch_open, self._sum, self._count = epoch, 0.0, 0
            self._call("on_epoch_begin", epoch, {})
        # Keras' batch logs hold the running mean of the epoch, batches weighted by size.
        self._sum += record.loss * record.examples
        self._count += record.examples
        self._call("on_train_batch_begin", step, {})
        self._call("on_train_batch_end", step, {"loss": self._sum / self._count})
        if self.policies is not None:
            self.policies.step(step_metrics(record, self._noise))
            self._check_stop()
        if record.last_of_epoch:
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
            getattr(callback, hook)(*args)
        self._send_stop_if_asked()

    def _send_stop_if_asked(self) -> None:
        if self.model.stop_training and not self._stop_sent:
            follow.request_stop(self.job)
            self._stop_sent = True


def step_metrics(record: ProgressRecord,
                 noise: monitoring.SmoothedNoiseScale) -> StepMetrics:
    """What a policy sees of a step; `noise` smooths the noise scale over the run."""
    smoothed = variance = compute = communication = None
    if record.monitor is not None:
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
        workers=record.workers, plan=record.plan, noise_scale=smoothed,
        gradient_variance=variance, compute_s=compute, communication_s=communication)
