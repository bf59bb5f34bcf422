"""One training step of a worker task: its feed, its fetches, its runs.

`TaskStep` runs one membership's program: it feeds each local replica its
virtual nodes' rows of the global batch, fetches the weighted loss (and the
metrics' states, and on monitored steps the gradient norms and timestamps),
runs the PS updates and the wait for them, sets the learning rate, and
bounds a stale worker's lead. It also times the throughput probe.
"""
from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Any

import numpy as np
import tensorflow as tf

from autodist.kernels import monitoring
from autodist.kernels.program import Program
from autodist.runtime import batching
from autodist.runtime.targets import unpack as unpack_targets
from autodist.runtime.records import LossRecord, MonitoredStep, MonitorSample, Probe
from autodist.runtime.run_config import RunConfig
from autodist.runtime.step_data import GlobalBatch
from autodist.runtime.worker_session import ProgramSession, WorkerError


@dataclasses.dataclass(frozen=True)
class MonitorTensors:
    """The in-graph measurements of a monitored step (`RunConfig.monitor_every`).

    Attributes:
        norms: By replica index, its squared gradient norms
            (`monitoring.gradient_sq_norms`).
        times: The step's timestamps (`monitoring.step_timestamps`; "start"
            is fed).
    """

    norms: dict[int, dict[str, tf.Tensor]]
    times: dict[str, tf.Tensor]

    @classmethod
    def of(cls, program: Program) -> MonitorTensors:
        """The measurements of `program`'s replicas (built in its graph)."""
        with program.graph.as_default():
            return cls({r.index: monitoring.gradient_sq_norms(r) for r in program.replicas},
                       monitoring.step_timestamps(program.replicas,
                                                  program.outputs.train_op))

    @property
    def fetches(self) -> dict[str, Any]:
        """What a monitored step fetches."""
        return {"norms": self.norms, "times": self.times}


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one step of this task gave.

    Attributes:
        loss: This task's weighted loss.
        seconds: The step's time on this task, from the start of its
            preparation (data, feed, a wait for stragglers) to the end of its
            last run; an emulated delay left out.
        metrics: This task's contribution to the metrics' state.
        monitored: The step's measurements, where monitored.
        task_examples: The examples of the global batch this task's
            replicas ran.
        lead: Under bounded staleness, how many steps this task was ahead
            of the slowest when it started (else 0).
    """

    loss: float
    seconds: float
    metrics: tuple
    monitored: MonitoredStep | None
    task_examples: int
    lead: int = 0


class TaskStep:
    """The step of one membership's program on this worker task.

    Args:
        task: The program and its session.
        config: The run's config.
        task_index: This worker task.
        loss_log: Where each step's loss is appended before the wait for the
            chief's update (recoverable runs), or None.
    """

    def __init__(self, task: ProgramSession, config: RunConfig, task_index: int,
                 loss_log: pathlib.Path | None) -> None:
        self.task = task
        self.config = config
        self.task_index = task_index
        self.loss_log = loss_log
        self.monitor: MonitorTensors | None = \
            MonitorTensors.of(task.program) if config.monitor_every else None
        self.rate: float | None = None  # the learning rate the program holds, if set
        self._rate_assign: tuple[tf.Tensor, tf.Operation] | None = None

    def run(self, index: int, data: GlobalBatch, delay_s: float = 0.0,
            since: float | None = None, run_outs: int = 0) -> StepResult:
        """Runs step `index` on `data` (after `delay_s`: an emulated slow worker).

        The step's time counts from `since` (a `time.perf_counter()` reading
        taken when the caller began preparing the step; default: now), so it
        holds the feed's preparation and any wait for stragglers, as a wall
        clock sees the step; the emulated delay is left out. `run_outs`: the
        iterations Keras' fit counted before this step beyond the updates
        applied (`autodist.runtime.run_outs`), fed to each of its runs.
        """
        begun = time.perf_counter() if since is None else since
        outputs = self.task.program.outputs
        fetches, ps_op, after = self._fetches()
        parts = batching.virtual_node_rows(data.rows, self.task.strategy.num_virtual_nodes)
        counted = {outputs.run_outs: run_outs} if run_outs and outputs.run_outs is not None \
            else {}
        feed = dict(counted)
        for replica in self.task.program.replicas:
            feed.update(self.replica_feed(replica, parts, data))
        lead = 0 if outputs.ssp is None else self._wait_for_stragglers(outputs.ssp, index)
        watch = self.monitor is not None and index % self.config.monitor_every == 0
        if watch:
            fetches = dict(fetches, monitor=self.monitor.fetches)
        prepared = time.perf_counter() - begun
        if delay_s:
            time.sleep(delay_s)
        if watch:
            feed[self.monitor.times["start"]] = time.time()
        start = time.perf_counter()
        result = self.task.run(fetches, feed_dict=feed)
        loss = float(result["loss"])
        if self.loss_log is not None:
            # Kept beside the job: the driver sums them if the run fails. Written
            # before waiting for the chief's update (a worker killed while it waits
            # has still computed this step's loss); the driver reads only the
            # losses of steps that completed.
            with open(self.loss_log, "a") as f:
                f.write(LossRecord(index, loss).to_json())
        monitored = self._monitor_record(index, parts, result["monitor"]) if watch else None
        if ps_op is not None:
            self.task.run(ps_op, feed_dict=counted or None)
        if after is not None:
            self.task.run(after, feed_dict=counted or None)
        seconds = prepared + time.perf_counter() - start
        return StepResult(
            loss, seconds, tuple(np.asarray(v).tolist() for v in result.get("metrics", ())),
            monitored, sum(len(parts[vn.index]) for r in self.task.program.replicas
                           for vn in r.virtual_nodes), lead)

    def _fetches(self) -> tuple[dict[str, Any], Any, Any]:
        """The step's fetches, then what runs after them: the PS updates and the wait
        for them (None where fetched with the step, or absent)."""
        outputs = self.task.program.outputs
        fetches = {"loss": outputs.weighted_loss, "train": outputs.train_op}
        if self.task.program.metric_states:
            fetches["metrics"] = self.task.program.metric_states
        ps_op, after = outputs.ps_op, outputs.after_step
        if after is not None and self.config.on_failure != "continue":
            # The wait for the chief's update (synchronous PS) in the step's last
            # run: one session run fewer per step. A recoverable run keeps it
            # apart, so that a worker's loss is recorded before it waits (`recovery`).
            if ps_op is None:
                fetches["after"], after = after, None
            else:
                ps_op, after = [ps_op, after], None
        return fetches, ps_op, after

    def replica_feed(self, replica, parts: list[np.ndarray], data: GlobalBatch) -> dict:
        """The feed of one replica: its virtual nodes' examples, weights and scale.

        Args:
            replica: The replica.
            parts: The rows of each virtual node in this step's global batch.
            data: The step's global batch.
        """
        graph_item = self.task.graph_item
        x_names = [info.name for info in graph_item.model_inputs]
        y_names = [info.name for info in graph_item.target_inputs]
        weight_infos = graph_item.sample_weight_inputs
        feed = {}
        mine = [parts[vn.index] for vn in replica.virtual_nodes]
        rows = np.concatenate(mine) if len(mine) > 1 else mine[0]
        sizes = [len(m) for m in mine]
        if replica.sizes is not None and sizes != replica.default_sizes:
            feed[replica.sizes] = np.asarray(sizes, np.int32)  # a smaller batch
        if replica.all_sizes is not None:   # where its rows are in the global batch's draws
            feed[replica.all_sizes] = np.asarray([len(p) for p in parts], np.int32)
        if data.held_rows is not None:  # a shipped shard holds only these examples
            rows = np.searchsorted(data.held_rows, rows)
        for name, array in zip(x_names, data.inputs):
            feed[replica.inputs[name]] = np.asarray(array[rows])
        if y_names or weight_infos:
            arrays, weights = unpack_targets(data.targets[rows], len(y_names))
            for name, array in zip(y_names, arrays):
                feed[replica.inputs[name]] = array
            for info, array in zip(weight_infos, weights or ()):
                feed[replica.inputs[info.name]] = array
        feed[self.task.program.outputs.scales[replica.index]] = \
            len(rows) / sum(map(len, parts))
        return feed

    def _monitor_record(self, index: int, parts, values) -> MonitoredStep:
        """This task's squared gradient norms of a step (with their batch sizes),
        and its local compute time and the rest of its step."""
        batches, norms = [], []
        replicas = self.task.program.replicas
        for replica in replicas:
            sizes = [len(parts[vn.index]) for vn in replica.virtual_nodes]
            stats = values["norms"][replica.index]
            if len(sizes) > 1:  # with one virtual node it is the replica's own gradient
                batches += sizes
                norms += [float(v) for v in stats["virtual_nodes"]]
            batches.append(sum(sizes))
            norms.append(float(stats["replica"]))
        times = values["times"]
        return MonitoredStep(index, MonitorSample(
            batches=tuple(batches), sq_norms=tuple(norms),
            compute_s=(float(times["gradients"] - times["start"]),),
            communication_s=(float(times["end"] - times["gradients"]),),
            tasks=(self.task_index,),
            examples=(sum(len(parts[vn.index]) for replica in replicas
                          for vn in replica.virtual_nodes),)))

    def _wait_for_stragglers(self, ssp, done: int) -> int:
        """Bounded staleness: waits until no task is more than `s` steps behind.

        Args:
            ssp: (tick, clocks read op, staleness s) from the synchronizer.
            done: Steps this task has completed.

        Returns:
            How many steps this task was ahead of the slowest when it started.
        """
        _, read_clocks, staleness = ssp
        if staleness <= 0:  # plain asynchronous training: measured, not bounded
            return done - int(min(self.task.run(read_clocks)))
        deadline = time.monotonic() + self.config.step_timeout_s
        while True:
            clocks = self.task.run(read_clocks)
            lead = done - int(min(clocks))
            if lead <= staleness:
                return lead
            if time.monotonic() > deadline:
                raise WorkerError(f"worker {self.task_index} waited more than "
                                  f"{self.config.step_timeout_s}s for a task {lead} steps "
                                  f"behind (staleness bound {staleness})")
            time.sleep(0.002)

    def set_learning_rate(self, rate: float | None) -> None:
        """The fixed learning rate the next steps train with (None: the run's start
        rate, the model's); assigned only where it changes."""
        variable = self.task.program.outputs.learning_rate
        if variable is None:
            return
        if rate is None:
            rate = self.config.learning_rate
        if rate is None or rate == self.rate:
            return
        if self._rate_assign is None:
            with self.task.program.graph.as_default():
                value = tf.compat.v1.placeholder(tf.float32, [])
                self._rate_assign = (value, variable.assign(value, read_value=False))
        value, assign = self._rate_assign
        self.task.run(assign, feed_dict={value: rate})
        self.rate = rate

    def probe(self, batches: list[GlobalBatch]) -> dict[str, Probe]:
        """Times each local replica's forward and backward passes on `batches`; no
        update. The first batch is a warm-up. A replica's time covers all its
        virtual nodes (one after the other) and its reads of the variables."""
        probe = {}
        for replica in self.task.program.replicas:
            fetches = [replica.loss] + [
                g.values if isinstance(g, tf.IndexedSlices) else g
                for g in replica.gradients.values()]
            seconds, examples = [], 0
            for index, data in enumerate(batches):
                parts = batching.virtual_node_rows(data.rows,
                                                   self.task.strategy.num_virtual_nodes)
                feed = self.replica_feed(replica, parts, data)
                start = time.perf_counter()
                self.task.run(fetches, feed_dict=feed)
                if index:
                    seconds.append(time.perf_counter() - start)
                examples = sum(len(parts[vn.index]) for vn in replica.virtual_nodes)
            probe[replica.device] = Probe(examples, tuple(seconds))
        return probe
