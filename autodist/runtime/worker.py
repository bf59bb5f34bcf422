"""What a worker task does: build its program, initialize, train, report.

Runs inside a task process (see `task.py`). Workers read their job from a
job directory (shared with the driver on a local cluster, a shipped copy on
another host); everything else between tasks goes over TensorFlow: the chief
gathers the other workers' results through mailboxes, writes them with the
trained weights into its job directory, then tells every other task it is
done. All waits are bounded by the RunConfig's timeouts.
"""
from __future__ import annotations

import io
import logging
import pathlib
import threading
import time
import traceback
from typing import Any

import numpy as np
import tensorflow as tf

from autodist.ir.atomic import atomic_write
from autodist.ir.errors import AutodistError
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.kernels import (global_batch, loss_scaling, monitoring, partitioner, replicator,
                              synchronizer)
from autodist.kernels.program import Program
from autodist.kernels.variables import StorageVariable
from autodist.launch import mailbox
from autodist.launch.job import JobDir
from autodist.launch.mailbox import Mailboxes
from autodist.launch.server import server_config
from autodist.runtime import checkpoint
from autodist.runtime import batching
from autodist.runtime import elastic as elastic_
from autodist.runtime import follow
from autodist.runtime import recovery
from autodist.runtime import residuals
from autodist.runtime import sharded_input
from autodist.runtime import targets as targets_
from autodist.runtime.dataset_stream import DatasetStream
from autodist.runtime.follow import ChiefFollower, WorkerFollower
from autodist.runtime.records import (LossRecord, MonitoredStep, MonitorSample, Probe,
                                      ProgressRecord, ResizeEvent, WorkerMessage, WorkerResult,
                                      add_states)
from autodist.runtime.step_data import ArrayData, GlobalBatch, StepData
from autodist.runtime.run_config import RunConfig

logger = logging.getLogger(__name__)

CHIEF = ("worker", 0)


class WorkerError(AutodistError, RuntimeError):
    """A worker could not start or finish its part of the job."""


def session_config(strategy: Strategy, task_index: int,
                   members: tuple[int, ...] | None = None,
                   graph_item: GraphItem | None = None) -> tf.compat.v1.ConfigProto:
    """Session config: the server's, plus device filters.

    Args:
        strategy: The strategy the session runs.
        task_index: This worker task.
        members: In an elastic job, the worker tasks of the current
            membership. A session must name exactly the
            live tasks it uses: one that can see an idle or absent task
            waits for it without a timeout.
        graph_item: The step (its batch statistics may be summed over
            replicas by collectives, which need every worker).
    """
    config = server_config()
    # On GPUs, an op of the step without a GPU kernel runs on its task's CPU
    # rather than failing the step (placement is otherwise the strategy's).
    config.allow_soft_placement = any("/device:GPU:" in d for d in strategy.replicas)
    uses_collectives = any(s.WhichOneof("kind") == "all_reduce"
                           for v in strategy.variables for s in v.shards) or \
        (graph_item is not None and global_batch.sums_over_replicas(graph_item, strategy))
    if uses_collectives and members is not None:
        config.device_filters.extend(["/job:ps"] + [f"/job:worker/task:{t}"
                                                    for t in members])
    elif not uses_collectives:
        # This task, the PS tasks, and the worker tasks holding PS variables
        # (a cluster without PS-only tasks).
        filters = {"/job:ps", f"/job:worker/task:{task_index}"}
        for config_ in strategy.variables:
            for sync in config_.shards:
                destination = sync.ps.reduction_destination
                if destination.startswith("/job:worker/"):
                    filters.add(f"/job:worker/task:{elastic_.replica_task(destination)}")
        config.device_filters.extend(sorted(filters))
    return config


def open_session(target: str, graph: tf.Graph, config: tf.compat.v1.ConfigProto,
                 timeout_s: float) -> tf.compat.v1.Session:
    """A session on `target` whose creation is bounded by `timeout_s`.

    TensorFlow creates the session on the master at the first run, and the
    master waits without end for every task its device filters name (no
    option bounds that wait: not `operation_timeout_in_ms`, not `RunOptions`).
    So the first run, a no-op, goes on a helper thread, and a task that does
    not answer in time is a `WorkerError` instead of a hang.

    Raises:
        WorkerError: naming the target, the device filters and the timeout.
    """
    session = tf.compat.v1.Session(target, graph=graph, config=config)
    with graph.as_default():
        noop = tf.no_op(name="autodist/session_ready")
    outcome: list[BaseException | None] = []

    def first_run() -> None:
        try:
            session.run(noop)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001  # re-raised below
            outcome.append(e)

    thread = threading.Thread(target=first_run, name="autodist-session-create", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        # The thread stays blocked inside TensorFlow; the task is failing anyway.
        raise WorkerError(f"creating a session on {target} did not finish within "
                          f"{timeout_s:g}s: a task among {list(config.device_filters) or 'all'} "
                          "does not answer (down or unreachable)")
    if outcome[0] is not None:
        raise outcome[0]
    return session


def build_program(graph_item: GraphItem, strategy: Strategy, spec: ResourceSpec,
                  task_index: int, timeout_s: float, version: int = 0,
                  elastic: bool = False, atomic: bool = False) -> Program:
    """Runs the three passes for worker task `task_index` (see `SyncOptions`)."""
    program = Program(graph_item, spec, ("worker", task_index), collective_timeout_s=timeout_s,
                      version=version)
    partitioner.apply(program, strategy)
    replicator.apply(program, strategy)
    if not program.replicas:
        raise WorkerError(f"worker task {task_index} has no replica in the strategy "
                          f"(replicas: {strategy.replicas})")
    members = tuple(sorted({elastic_.replica_task(d) for d in strategy.replicas})) \
        if elastic else tuple(range(spec.num_worker_tasks))
    synchronizer.apply(program, strategy, synchronizer.SyncOptions(
        is_chief=task_index == 0, worker_tasks=len(members), task_index=task_index,
        timeout_s=timeout_s, version=version, elastic=elastic, atomic=atomic,
        members=members))
    return program


class Trainer:
    """The training loop of one worker task.

    Args:
        job: The job directory.
        task_index: This worker's task index.
        target: The session target (this task's server).
        mail: The cluster's mailboxes (step reports and run limits of a
            followed run).
    """

    def __init__(self, job: JobDir, task_index: int, target: str, mail: Mailboxes) -> None:
        self.job = job
        self.mail = mail
        self.task_index = task_index
        self.graph_item = job.graph_item()
        self.strategy = job.strategy()
        self.spec = job.resource_spec()
        self.config: RunConfig = RunConfig.of_job(job)
        self.is_chief = task_index == 0
        self.target = target
        self.run_options = tf.compat.v1.RunOptions(
            timeout_in_ms=int(self.config.step_timeout_s * 1000))
        self.initial_step = 0
        self._save = None
        self.follower: ChiefFollower | WorkerFollower | None = None
        self.elastic = self.config.elastic  # set with resize_at too (see fit)
        self.full_strategy = self.strategy
        # Each step's global batch, and the epochs (a strategy switched to may
        # bring another global batch).
        self.data = open_step_data(job, self.config, self.graph_item, self.strategy,
                                   self._batch_at, self.task_index)
        self.schedule = self.data.schedule
        lengths = self.data.lengths
        self.steps_per_epoch = lengths[0]
        # Who runs which steps, with which strategy; a followed elastic run
        # extends both while it goes.
        self.segments = elastic_.segments(sum(lengths), self.spec.num_worker_tasks,
                                          self.config.resize_at, self.config.switch_at)
        self.plans: list[str] = list(self.config.plans or [])
        self._plan_strategies: dict[int, Strategy] = {0: self.strategy}
        self._init_shared = True  # the chief initializes the PS variables
        self._rate: float | None = None  # the learning rate the program holds, if set
        self._state_set = -1   # the step before which the driver's state was last set
        self._rate_assign: tuple[Program, Any, Any] | None = None
        # The chief's reads of every replica's residuals, and their program.
        self._residual_reads: tuple[Program, residuals.ResidualReads | None] | None = None
        self.program: Program | None = None
        self.session: tf.compat.v1.Session | None = None
        self._snapshot: dict[str, np.ndarray] | None = None
        self._handover_start = 0.0
        self.next_index = self.config.start_step  # the first step not yet completed
        self.segment = self._segment_at(self.config.start_step)
        if self.segment.has(task_index):
            self._build(self.segment)
        # Otherwise idle until a segment includes this task (see `train`).

    @property
    def total_steps(self) -> int:
        """Steps of the whole run (they change when the global batch does)."""
        return self.schedule.total()

    def _plan(self, plan: int) -> Strategy:
        if plan not in self._plan_strategies:
            self._plan_strategies[plan] = Strategy.from_text(self.plans[plan - 1])
        return self._plan_strategies[plan]

    def _batch_at(self, step: int) -> int:
        """The global batch of the strategy that runs `step`."""
        return self._plan(self._segment_at(step).plan).global_batch_size or \
            self.config.global_batch_size

    def _segment_at(self, step: int) -> elastic_.Segment:
        return next((s for s in self.segments if s.start <= step < s.end), self.segments[-1])

    def _build(self, segment: elastic_.Segment) -> None:
        """A new program and session for the membership of `segment`."""
        if self.session is not None:
            self.session.close()
        # PS variables stay where they are unless the strategy changes.
        self._init_shared = self.program is None or segment.plan != self.segment.plan
        plan = self._plan(segment.plan)
        self.strategy = elastic_.strategy_for(plan, segment.members) if self.elastic else plan
        self.program = build_program(self.graph_item, self.strategy, self.spec, self.task_index,
                                     self.config.step_timeout_s, version=segment.version,
                                     elastic=self.elastic, atomic=True)
        self.session = open_session(
            self.target, self.program.graph,
            session_config(self.strategy, self.task_index,
                           segment.members if self.elastic else None, self.graph_item),
            self.config.startup_timeout_s)
        self.segment = segment
        self._save = None
        self._rate = None  # a new program holds the captured rate
        self._monitor = None
        if self.config.monitor_every:
            with self.program.graph.as_default():
                self._monitor = {
                    "norms": {r.index: monitoring.gradient_sq_norms(r)
                              for r in self.program.replicas},
                    "times": monitoring.step_timestamps(self.program.replicas,
                                                        self.program.outputs.train_op)}

    # ---------------------------------------------------------- initialize
    def initialize(self, values: dict[str, np.ndarray] | None = None) -> None:
        """Chief: PS variables; everyone: its local variables; then a ready flag.

        Local copies of PS shards (`local_replication`) are then read from the
        initialized PS by every task.

        Args:
            values: Values by single-device name (and checkpoint slot keys);
                default the job's initial values. A task joining an elastic
                job in a later membership version waits for the chief's.
        """
        if self.session is None:
            return  # idle: initialized when a segment includes this task
        if values is None and self.segment.version > 0:
            values = self._receive_snapshot()
        self._initialize(values if values is not None else self.job.init_values(),
                         init_shared=self._init_shared)

    def _initialize(self, values: dict[str, np.ndarray], init_shared: bool) -> None:
        program = self.program
        with program.graph.as_default():
            ready = self._ready_flag()
            local, shared = [], []
            for name, var in program.storage.items():
                role = program.roles.get(name)
                (shared if role is not None and role.on_parameter_server else local).append(
                    (name, var))
            step = program.outputs.step
            inits = [step.initializer] + [v.initializer for _, v in local] + \
                program.table_initializers
            if self.is_chief and init_shared:
                inits += [v.initializer for _, v in shared]
            assigns, feeds = self._value_assigns(values, local,
                                                 shared if init_shared else [])
            if checkpoint.ITERATIONS in values:
                start = tf.compat.v1.placeholder(tf.int64, [])
                assigns.append(step.assign(start, read_value=False))
                feeds[start] = int(values[checkpoint.ITERATIONS])
        # The update count at the run's first step (values handed over at a
        # resize or switch count the steps run since).
        self.initial_step = int(values.get(checkpoint.ITERATIONS, 0)) - max(
            self.segment.start - self.config.start_step, 0)
        self.session.run(inits, options=self.run_options)
        self._rate = None  # the variable holds the captured rate until set
        if assigns:
            self.session.run(assigns, feed_dict=feeds, options=self.run_options)
        if self.is_chief:
            self.session.run(ready.initializer, options=self.run_options)
        else:
            self._wait_for(ready)
        if program.outputs.refresh is not None:  # local copies start at the PS values
            self.session.run(program.outputs.refresh, options=self.run_options)

    def _ready_flag(self) -> tf.Variable:
        """Set by the chief once it initialized this membership version's variables."""
        device = next(iter(self.spec.ps_devices), self.strategy.replicas[0])
        version = self.segment.version
        with tf.device(device):
            return tf.compat.v1.Variable(
                True, name="autodist/ps_ready" + (f"_v{version}" if version else ""),
                trainable=False, use_resource=True)

    def _value_assigns(self, values, local, shared):
        """Assign ops (fed by placeholders) giving each storage variable its value."""
        shards = {}
        for var_shards in self.program.shards.values():
            for shard in var_shards:
                shards[shard.name] = shard
        assigns, feeds = [], {}
        targets = local + (shared if self.is_chief else [])
        for name, var in targets:
            value = self._initial_value(name, values, shards)
            if value is None:
                continue
            placeholder = tf.compat.v1.placeholder(var.dtype.base_dtype, var.shape)
            assigns.append(var.assign(placeholder, read_value=False))
            feeds[placeholder] = value
        return assigns, feeds

    def _initial_value(self, name: str, values: dict[str, np.ndarray], shards) -> Any:
        if name in values:  # a storage variable's own value (elastic state transfer)
            return values[name]
        role = self.program.roles.get(name)
        if role is not None and role.kind == "state":
            return values.get(role.state)
        if role is not None and role.kind == "residual":
            shard = shards[role.shard]
            full = residuals.replica_value(
                values.get(residuals.checkpoint_key(shard.var_name, role.square)),
                role.replica, len(self.strategy.replicas))
            return None if full is None else _shard_part(full, shard)
        if role is None or role.kind not in ("variable", "slot"):
            return None  # steps and stashes start at their initializers
        shard = shards[role.shard]
        key = checkpoint.slot_key(shard.var_name, role.slot) if role.slot else shard.var_name
        if key not in values:
            return None  # a slot not in the checkpoint starts at its initial value
        return _shard_part(values[key], shard)

    def _wait_for(self, flag: tf.Variable) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        with self.program.graph.as_default():
            check = tf.raw_ops.VarIsInitializedOp(resource=flag.handle)
        while True:
            try:
                if self.session.run(check, options=self.run_options):
                    return
            except tf.errors.UnavailableError:
                pass
            if time.monotonic() > deadline:
                raise WorkerError(f"worker {self.task_index}: the chief did not initialize the "
                                  f"parameter servers within {self.config.startup_timeout_s}s")
            time.sleep(0.05)

    # --------------------------------------------------------------- train
    def train(self) -> WorkerResult:
        """Runs every step; returns this task's per-step weighted losses and times.

        In a followed run (`RunConfig.follow_steps`) the run limit may end it
        early, at the same step on every synchronous worker.
        """
        config = self.config
        if config.probe_steps:
            return self._probe()
        steps = self.steps_per_epoch
        if config.follow_steps:
            self.follower = (ChiefFollower(self.job, self.mail, self.spec.num_worker_tasks,
                                           steps, config, self.segments, self.plans,
                                           self.schedule,
                                           epoch_end=self._write_epoch_weights
                                           if config.epoch_weights else None)
                             if self.is_chief else
                             WorkerFollower(self.mail, self.task_index, steps, config,
                                            self.segments, self.plans))
        follower = self.follower
        delay = float((config.task_step_delay_s or {}).get(str(self.task_index), 0.0))
        max_lead = 0
        losses, times = [], []
        progress = self.job.file("progress.jsonl") if self.is_chief and follower is None else None
        resizes = []
        monitored = []
        epoch_metrics: dict[int, tuple] = {}
        index = config.start_step
        while index < self.total_steps:
            if self.session is None:
                # Idle: no loss, no time until a segment includes this task.
                join = follower.wait_to_join(index) if isinstance(follower, WorkerFollower) \
                    else next((max(s.start, index) for s in self.segments
                               if s.has(self.task_index) and s.end > index), None)
                end = self.total_steps if join is None else join
                if join is None and follower is not None:
                    end = min(end, follower.limit)
                losses += [0.0] * (end - index)
                times += [0.0] * (end - index)
                index = end
                if join is None:
                    break
                self._enter(self._segment_at(index), resizes)
                continue
            if follower is not None and not follower.may_start(index):
                break
            if follower is None and self.is_chief and self.job.stop_request().exists():
                # The driver was interrupted: it takes the weights so far and ends the job.
                logger.info("stop requested by the driver before step %d", index)
                break
            segment = self._segment_at(index)
            if segment.version != self.segment.version:
                self._hand_over(self.segment, segment)
                if not segment.has(self.task_index):
                    self.segment = segment
                    continue
                self._enter(segment, resizes)
            self._set_learning_rate(index)
            self._set_state(index)
            outputs = self.program.outputs
            fetches = {"loss": outputs.weighted_loss, "train": outputs.train_op}
            if self.program.metric_states:
                fetches["metrics"] = self.program.metric_states
            ps_op, after, ssp = outputs.ps_op, outputs.after_step, outputs.ssp
            if after is not None and config.on_failure != "continue":
                # The wait for the chief's update (synchronous PS) in the step's last
                # run: one session run fewer per step. A recoverable run keeps it
                # apart, so that a worker's loss is recorded before it waits (`recovery`).
                if ps_op is None:
                    fetches["after"], after = after, None
                else:
                    ps_op, after = [ps_op, after], None
            epoch, step, _, epoch_steps = self.schedule.locate(index)
            data = self.data.batch(index)
            parts = batching.virtual_node_rows(data.rows, self.strategy.num_virtual_nodes)
            feed = {}
            for replica in self.program.replicas:
                feed.update(self._replica_feed(replica, parts, data))
            if ssp is not None:
                max_lead = max(max_lead, self._wait_for_stragglers(ssp, index))
            if delay:
                time.sleep(delay)  # an emulated slow worker
            watch = self._monitor is not None and index % config.monitor_every == 0
            if watch:
                fetches = dict(fetches, monitor=self._monitor)
            if watch:
                feed[self._monitor["times"]["start"]] = time.time()
            start = time.perf_counter()
            result = self.session.run(fetches, feed_dict=feed, options=self.run_options)
            loss = float(result["loss"])
            if config.on_failure == "continue":
                # Kept beside the job: the driver sums them if the run fails. Written
                # before waiting for the chief's update (a worker killed while it waits
                # has still computed this step's loss); the driver reads only the
                # losses of steps that completed.
                with open(self.job.file(f"losses_{self.task_index}.jsonl"), "a") as f:
                    f.write(LossRecord(index, loss).to_json())
            if watch:
                monitored.append(self._monitor_record(index, parts, result["monitor"]))
            if ps_op is not None:
                self.session.run(ps_op, options=self.run_options)
            if after is not None:
                self.session.run(after, options=self.run_options)
            times.append(time.perf_counter() - start)
            done = self.initial_step + index - config.start_step + 1
            self.next_index = index + 1
            if self._checkpoint_due(done, last_of_epoch=step == epoch_steps - 1):
                self.save_checkpoint(done)
            losses.append(loss)
            monitor = monitored[-1].sample if watch else None
            metrics = tuple(np.asarray(v).tolist() for v in result.get("metrics", ()))
            epoch_metrics[epoch] = add_states(epoch_metrics.get(epoch, ()), metrics)
            if isinstance(follower, ChiefFollower):
                follower.record(index, losses[-1], times[-1], monitor, metrics, data.size)
            elif isinstance(follower, WorkerFollower):
                follower.record(index, losses[-1], monitor, metrics)
            elif progress is not None:
                # This task's replicas' mean loss: an estimate of the global loss.
                share = sum(len(parts[vn.index]) for r in self.program.replicas
                            for vn in r.virtual_nodes) / data.size
                record = ProgressRecord(
                    step=index, epoch=epoch, epoch_step=step,
                    loss=losses[-1] / max(share, 1e-12), seconds=times[-1],
                    examples=data.size, last_of_epoch=step == epoch_steps - 1,
                    workers=self.segment.workers, plan=self.segment.plan, estimate=True,
                    metrics=metrics)
                with open(progress, "a") as f:
                    f.write(record.to_json())
            index += 1
        if isinstance(follower, ChiefFollower):
            follower.end(index)  # releases idle workers
        return WorkerResult(
            losses=tuple(losses), step_times=tuple(times), steps_per_epoch=steps,
            epoch_starts=tuple(self.schedule.starts()),
            # The chief's, from the run's first step (History weighs epochs by them).
            step_examples=tuple(self.data.examples(i) for i in range(
                config.start_step + len(losses))) if self.is_chief else (),
            max_lead=max_lead, resizes=tuple(resizes), monitor=tuple(monitored),
            epoch_metrics=tuple(epoch_metrics.get(e, ()) for e in range(
                max(epoch_metrics) + 1 if epoch_metrics else 0)))

    def _monitor_record(self, index: int, parts, values) -> MonitoredStep:
        """This task's squared gradient norms of a step (with their batch sizes),
        and its local compute time and the rest of its step."""
        batches, norms = [], []
        for replica in self.program.replicas:
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
            examples=(sum(len(parts[vn.index]) for replica in self.program.replicas
                          for vn in replica.virtual_nodes),)))

    def _enter(self, segment: elastic_.Segment, resizes: list) -> None:
        """Joins `segment`: new program and session, state from the chief."""
        self._build(segment)
        self.initialize(self._snapshot if self.is_chief else None)
        if self.is_chief:
            resizes.append(ResizeEvent(segment.start, segment.workers, segment.plan,
                                       time.perf_counter() - self._handover_start,
                                       segment.members))

    def save_recovery(self) -> None:
        """Chief, after a failed step: the state after the last completed step.

        Steps are atomic (`SyncOptions.atomic`): a failed step applied no
        update, so every variable, slot and the update count are those after
        step `next_index - 1`. Reading them runs no collective (a process
        whose collectives were aborted can still do this). Written
        atomically, with the index of the step to resume at. Error-feedback
        residuals are not (a dead worker's cannot be read): after a
        recovery they start at zero.
        """
        values = self.session.run(self._full_tensors(with_optimizer=True),
                                  options=self.run_options)
        values[recovery.NEXT_STEP] = np.asarray(self.next_index, np.int64)
        buffer = io.BytesIO()
        np.savez(buffer, **values)
        atomic_write(self.job.recovery(), buffer.getvalue())

    def close(self) -> None:
        """Closes the current session (none after leaving an elastic job) and stops
        reading data."""
        self.data.close()
        if self.session is not None:
            self.session.close()
            self.session = None

    # ------------------------------------------------------------- elastic
    def _hand_over(self, segment: elastic_.Segment, following: elastic_.Segment) -> None:
        """End of a membership version: the chief gathers the state, sends it on.

        Every member sends the chief its virtual nodes' state variables; the
        chief adds every variable, slot and the step count (its own view,
        equal to everyone's in synchronous training) and sends the whole to
        each member of the next version, which starts from it.
        """
        self._handover_start = time.perf_counter()
        timeout_s = self.config.step_timeout_s + self.config.startup_timeout_s
        own_state = {}
        if self.graph_item.state_variables:
            with self.program.graph.as_default():
                reads = {name: var.read_value() for name, var in self.program.storage.items()
                         if self.program.roles[name].kind == "state"}
            own_state = self.session.run(reads, options=self.run_options)
        if not self.is_chief:
            self.mail.send(CHIEF, mailbox.STATE_UP, _pack(own_state), timeout_s)
            self.session.close()
            self.session = None
            return
        snapshot = dict(own_state)
        for _ in range(1, segment.workers):
            snapshot.update(_unpack(self.mail.receive(CHIEF, mailbox.STATE_UP, timeout_s)))
        self._wait_for_residuals()
        snapshot.update(self.session.run(self._full_tensors(with_optimizer=True,
                                                            with_residuals=True),
                                         options=self.run_options))
        message = _pack(snapshot)
        for task in following.members[1:]:
            self.mail.send(("worker", task), mailbox.STATE, message, timeout_s)
        self._snapshot = snapshot

    def _receive_snapshot(self) -> dict[str, np.ndarray]:
        # A joiner may wait for a whole segment of the others' training.
        return _unpack(self.mail.receive(("worker", self.task_index), mailbox.STATE,
                                         self.config.job_timeout_s))

    def _replica_feed(self, replica, parts: list[np.ndarray], data: GlobalBatch) -> dict:
        """The feed of one replica: its virtual nodes' examples, weights and scale.

        Args:
            replica: The replica.
            parts: The rows of each virtual node in this step's global batch.
            data: The step's global batch.
        """
        x_names = [info.name for info in self.graph_item.model_inputs]
        y_names = [info.name for info in self.graph_item.target_inputs]
        weight_infos = self.graph_item.sample_weight_inputs
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
            arrays, weights = targets_.unpack(data.targets[rows], len(y_names))
            for name, array in zip(y_names, arrays):
                feed[replica.inputs[name]] = array
            for info, array in zip(weight_infos, weights or ()):
                feed[replica.inputs[info.name]] = array
        feed[self.program.outputs.scales[replica.index]] = len(rows) / sum(map(len, parts))
        return feed

    def _set_state(self, index: int) -> None:
        """Before step `index`, the first of an epoch: the state variables the driver's
        validation or callbacks changed at the epoch's end, in every virtual node's copy."""
        changes = getattr(self.follower, "state_changes", None)
        if not changes:
            return
        values = next((v for step, v in changes if step == index), None)
        if values is None or self._state_set == index:
            return
        self._state_set = index
        with self.program.graph.as_default():
            assigns, feeds = [], {}
            for name, var in self.program.storage.items():
                role = self.program.roles.get(name)
                if role is None or role.kind != "state" or role.state not in values:
                    continue
                placeholder = tf.compat.v1.placeholder(var.dtype.base_dtype, var.shape)
                assigns.append(var.assign(placeholder, read_value=False))
                feeds[placeholder] = np.asarray(values[role.state],
                                                var.dtype.base_dtype.as_numpy_dtype)
        if assigns:
            self.session.run(assigns, feed_dict=feeds, options=self.run_options)

    def _set_learning_rate(self, index: int) -> None:
        """Before step `index`: the fixed learning rate it trains with, from the driver's
        callbacks (set between epochs) or the run's start (the model's rate)."""
        variable = self.program.outputs.learning_rate
        if variable is None:
            return
        rate = self.follower.learning_rate_at(index) if self.follower is not None else None
        if rate is None:
            rate = self.config.learning_rate
        if rate is None or rate == self._rate:
            return
        if self._rate_assign is None or self._rate_assign[0] is not self.program:
            with self.program.graph.as_default():
                value = tf.compat.v1.placeholder(tf.float32, [])
                self._rate_assign = (self.program, value,
                                     variable.assign(value, read_value=False))
        _, value, assign = self._rate_assign
        self.session.run(assign, feed_dict={value: rate}, options=self.run_options)
        self._rate = rate

    def _probe(self) -> WorkerResult:
        """Times each local replica's forward and backward passes; no update.

        Runs the first `probe_steps + 1` global batches of the schedule; the
        first is a warm-up. A replica's time covers all its virtual nodes
        (one after the other) and its reads of the variables.

        Returns:
            A result with no losses and a probe per replica device.
        """
        config = self.config
        batches = [self.data.probe_batch(i) for i in range(config.probe_steps + 1)]
        probe = {}
        for replica in self.program.replicas:
            fetches = [replica.loss] + [
                g.values if isinstance(g, tf.IndexedSlices) else g
                for g in replica.gradients.values()]
            seconds, examples = [], 0
            for index, data in enumerate(batches):
                parts = batching.virtual_node_rows(data.rows, self.strategy.num_virtual_nodes)
                feed = self._replica_feed(replica, parts, data)
                start = time.perf_counter()
                self.session.run(fetches, feed_dict=feed, options=self.run_options)
                if index:
                    seconds.append(time.perf_counter() - start)
                examples = sum(len(parts[vn.index]) for vn in replica.virtual_nodes)
            probe[replica.device] = Probe(examples, tuple(seconds))
        return WorkerResult(steps_per_epoch=self.steps_per_epoch, probe=probe)

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
            return done - int(min(self.session.run(read_clocks, options=self.run_options)))
        deadline = time.monotonic() + self.config.step_timeout_s
        while True:
            clocks = self.session.run(read_clocks, options=self.run_options)
            lead = done - int(min(clocks))
            if lead <= staleness:
                return lead
            if time.monotonic() > deadline:
                raise WorkerError(f"worker {self.task_index} waited more than "
                                  f"{self.config.step_timeout_s}s for a task {lead} steps "
                                  f"behind (staleness bound {staleness})")
            time.sleep(0.002)

    # ------------------------------------------------------------- finish
    def _full_tensors(self, with_optimizer: bool,
                      with_residuals: bool = False) -> dict[str, tf.Tensor]:
        """Tensors of every variable (shards concatenated) by single-device name.

        The chief's view: PS shards and its own mirrored copies. With
        `with_optimizer`, also slots and the update count (for checkpoints).
        With `with_residuals`, also every replica's error-feedback residuals
        (`autodist.runtime.residuals`; run them only after
        `_wait_for_residuals`).
        """
        program = self.program
        replica = program.replicas[0]
        tensors = {}
        with program.graph.as_default():
            for var in self.graph_item.variables:
                shards = program.shards[var.name]
                axis = shards[0].axis

                def joined(parts, axis=axis):
                    values = [p.read_value() for p in parts]
                    return values[0] if len(values) == 1 else tf.concat(values, axis)

                tensors[var.name] = joined([replicator.get_storage(program, s, replica)
                                            for s in shards])
                if with_optimizer:
                    for slot in var.slots:
                        tensors[checkpoint.slot_key(var.name, slot)] = joined(
                            [replicator.get_slots(program, s, replica)[slot] for s in shards])
            for state in self.graph_item.state_variables:
                # The chief's first virtual node (virtual node 0 under a
                # contiguous mapping).
                key = replicator.state_storage_name(state.name,
                                                    replica.virtual_nodes[0].index)
                tensors[state.name] = program.storage[key].read_value()
            if with_optimizer:
                tensors[checkpoint.ITERATIONS] = program.outputs.step.read_value()
                loss_scale = loss_scaling.state_of(program)
                if loss_scale is not None:  # the scale, its counter, Keras' update count
                    for name in loss_scaling.NAMES:
                        tensors[name] = program.storage[name].read_value()
        if with_residuals and self._residuals() is not None:
            tensors.update(self._residuals().tensors)
        return tensors

    def _residuals(self) -> residuals.ResidualReads | None:
        """Reads of every replica's residuals (built once per program)."""
        if self._residual_reads is None or self._residual_reads[0] is not self.program:
            self._residual_reads = (self.program, residuals.reads(self.program, self.strategy))
        return self._residual_reads[1]

    def _wait_for_residuals(self) -> None:
        """Chief: until every replica has written its residuals of the last step."""
        if self._residuals() is not None:
            residuals.wait_until_written(self.session, self._residuals(),
                                         self.config.step_timeout_s, self.run_options)

    def final_weights(self, with_optimizer: bool = True) -> dict[str, np.ndarray]:
        """Trained values by variable name, shards reassembled (chief's view); with
        `with_optimizer`, also the optimizer's slots and update count (by checkpoint
        key), which return into the Keras optimizer."""
        return self.session.run(self._full_tensors(with_optimizer=with_optimizer),
                                options=self.run_options)

    def _write_epoch_weights(self, epoch: int) -> None:
        """Chief: the weights after `epoch`, for the driver's callbacks."""
        path = follow.epoch_weights_path(self.job, epoch)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_weights(path, self.final_weights(with_optimizer=False))

    def finish_barrier(self) -> None:
        """Asynchronous jobs: the chief waits until every worker has finished."""
        if self.program is None or not self.program.outputs.asynchronous:
            return
        with self.program.graph.as_default():
            counter = self._finished_counter()
            report = counter.assign_add(1, read_value=False)
            read = counter.read_value()
        self.session.run(report, options=self.run_options)
        if not self.is_chief:
            return
        deadline = time.monotonic() + self.config.step_timeout_s
        while self.session.run(read, options=self.run_options) < self.spec.num_worker_tasks:
            if time.monotonic() > deadline:
                raise WorkerError(f"workers did not finish within {self.config.step_timeout_s}s "
                                  "of the chief")
            time.sleep(0.01)

    def _finished_counter(self) -> StorageVariable:
        return self.program.storage["autodist/shared/finished"]

    def collect_results(self, own: WorkerResult) -> list[WorkerResult]:
        """Chief: every worker's result, by task index (the others' from the mailbox)."""
        results: dict[int, WorkerResult] = {0: own}
        timeout_s = self.config.step_timeout_s + self.config.startup_timeout_s
        while len(results) < self.spec.num_worker_tasks:
            try:
                message = WorkerMessage.from_json(
                    self.mail.receive(CHIEF, mailbox.RESULTS, timeout_s))
            except mailbox.MailboxTimeout as e:
                missing = [t for t in range(self.spec.num_worker_tasks) if t not in results]
                raise WorkerError(f"workers {missing} sent no result within {timeout_s:g}s "
                                  "of the chief's end") from e
            _raise_if_error(message)
            results[message.task] = message.result
        return [results[t] for t in range(self.spec.num_worker_tasks)]

    def _checkpoint_due(self, done: int, last_of_epoch: bool) -> bool:
        if not self.is_chief or not self.config.checkpoint_dir:
            return False
        every = self.config.checkpoint_every_steps
        return done % every == 0 if every else last_of_epoch

    def save_checkpoint(self, step: int) -> pathlib.Path:
        """Writes a checkpoint atomically and durably (chief only); returns its directory."""
        if self._save is None:
            tensors = self._full_tensors(with_optimizer=True, with_residuals=True)
            names = sorted(tensors)
            with self.program.graph.as_default():
                prefix = tf.compat.v1.placeholder(tf.string, [])
                op = tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names,
                                       shape_and_slices=[""] * len(names),
                                       tensors=[tensors[n] for n in names])
            self._save = (prefix, op)
        prefix, op = self._save
        self._wait_for_residuals()

        def write(path: str) -> None:
            self.session.run(op, {prefix: path}, options=self.run_options)

        return checkpoint.save(self.config.checkpoint_dir, step, write,
                               keep=self.config.checkpoints_to_keep)


def open_step_data(job: JobDir, config: RunConfig, graph_item: GraphItem, strategy: Strategy,
                   batch_at, task: int) -> StepData:
    """The job's data: its dataset (or worker task `task`'s shard of it), streamed, or
    its arrays (batched by `batch_at`, the global batch of the strategy running a step)."""
    files = job.dataset()
    if files is None:
        return ArrayData(job, config, batch_at)
    held = None
    if files.shard_graphs:
        held = sharded_input.task_rows(strategy, config.global_batch_size,
                                       job.resource_spec().num_worker_tasks)[task]
    return DatasetStream(files, config, graph_item, strategy.num_virtual_nodes,
                         strategy.global_batch_size, held_rows=held, task=task)


def run_worker(job: JobDir, task_index: int, target: str) -> None:
    """Builds, initializes and trains; the chief writes results and weights.

    Waits until every task of the cluster answers. Every worker reports
    "finished" on the PS before the chief reads the final weights
    (asynchronous workers may still be updating); the others send their
    results to the chief and keep serving until it says it is done (they may
    hold PS shards). A worker that fails tells the chief why, so the chief's
    error names it even when the worker runs on another host.
    """
    spec = job.resource_spec()
    config = RunConfig.of_job(job)
    mail = Mailboxes(spec.cluster_def(job.ports()), job_id=config.job_id)
    is_chief = task_index == 0
    trainer = None
    try:
        mail.wait_until_up(mail.tasks, config.startup_timeout_s)
        trainer = Trainer(job, task_index, target, mail)
        trainer.initialize()
        result = trainer.train()
        trainer.finish_barrier()
    except Exception as e:
        if not is_chief:
            _report_failure(mail, task_index)
            raise
        if trainer is not None and trainer.session is not None:
            # The last completed step's state: recovery goes on from it, and a
            # failed fit leaves it in the model.
            try:
                trainer.save_recovery()
            except Exception:
                logger.exception("could not save the state for recovery")
        failure = _safe_peer_failure(mail)
        if failure is not None:
            raise WorkerError(f"the chief stopped because {failure}") from e
        raise
    if not is_chief:
        mail.send(CHIEF, mailbox.RESULTS, WorkerMessage(task_index, result=result).to_json(),
                  config.step_timeout_s + config.startup_timeout_s)
        mail.receive(("worker", task_index), mailbox.DONE,
                     config.step_timeout_s + config.startup_timeout_s)
        mail.close()   # first: the chief may end at once
        trainer.close()
        return
    # First, so that a driver that stopped the job early gets them at once.
    write_weights(job.file("final_weights.npz"), trainer.final_weights())
    results = trainer.collect_results(result)
    if isinstance(trainer.follower, ChiefFollower):
        trainer.follower.finish([r.losses for r in results], result.step_times,
                                [r.monitor for r in results])
    for index, worker_result in enumerate(results):
        atomic_write(job.result(index), worker_result.to_json())
    for task in mail.tasks:
        if task != CHIEF:
            try:
                mail.send(task, mailbox.DONE, b"done", timeout_s=10.0)
            except mailbox.MailboxError as e:  # it may be gone already; it times out alone
                logger.warning("could not tell %s:%d the job is done: %s", *task, e)
            mail.close([task])   # before it ends (see Mailboxes.close)
    trainer.close()
    mail.close()


def _shard_part(full: np.ndarray, shard) -> np.ndarray:
    """The part of a variable's value (or residual) that `shard` holds."""
    if shard.num_shards == 1:
        return full
    index = [slice(None)] * full.ndim
    index[shard.axis] = slice(shard.offset, shard.offset + shard.shape[shard.axis])
    return full[tuple(index)]


def write_weights(path: pathlib.Path, values: dict[str, np.ndarray]) -> None:
    """Writes weights by variable name to `path` (.npz) atomically."""
    atomic_write(path, _pack(values))


def _pack(values: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **values)
    return buffer.getvalue()


def _unpack(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data)) as arrays:
        return {name: arrays[name] for name in arrays.files}


def _report_failure(mail: Mailboxes, task_index: int) -> None:
    message = WorkerMessage(task_index, error=traceback.format_exc(limit=8))
    try:
        mail.send(CHIEF, mailbox.RESULTS, message.to_json(), timeout_s=5.0)
    except Exception:  # noqa: BLE001
        logger.warning("could not tell the chief that this worker failed")


def _safe_peer_failure(mail: Mailboxes) -> str | None:
    try:
        messages = mail.receive_all(CHIEF, mailbox.RESULTS, timeout_s=5.0)
    except Exception:  # noqa: BLE001
        return None
    for raw in messages:
        message = WorkerMessage.from_json(raw)
        if message.error is not None:
            return f"worker {message.task} failed:\n{message.error}"
    return None


def _raise_if_error(message: WorkerMessage) -> None:
    if message.error is not None:
        raise WorkerError(f"worker {message.task} failed:\n{message.error}")
    if message.result is None:
        raise WorkerError(f"worker {message.task} sent neither a result nor an error")
