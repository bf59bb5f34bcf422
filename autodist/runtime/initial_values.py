"""Giving a new program's storage variables their values.

The chief initializes the PS variables, every task its local ones, from the
values by single-device name (the job's initial values, a checkpoint's or
the state handed over at a membership change); then the chief sets a ready
flag the other tasks wait for.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import tensorflow as tf

from autodist.runtime import checkpoint
from autodist.runtime import residuals
from autodist.runtime.worker_session import ProgramSession, WorkerError


def initialize_variables(task: ProgramSession, values: dict[str, np.ndarray], *,
                         init_shared: bool, is_chief: bool, ready_device: str, version: int,
                         task_index: int, startup_timeout_s: float) -> None:
    """Initializes `task`'s variables, assigns `values`, waits for the chief's.

    Local copies of PS shards (`local_replication`) are then read from the
    initialized PS.

    Args:
        task: The program and its session.
        values: Values by single-device name (and checkpoint slot keys).
        init_shared: Whether the chief initializes the PS variables (not
            when they stay where they are at a resize).
        is_chief: Whether this task is the chief.
        ready_device: Where the ready flag lives (a PS, or the first replica).
        version: The membership version (each has its own ready flag).
        task_index: This worker task (for errors).
        startup_timeout_s: How long a worker waits for the chief's flag.

    Raises:
        WorkerError: the chief did not initialize within `startup_timeout_s`.
    """
    program = task.program
    with program.graph.as_default():
        ready = _ready_flag(ready_device, version)
        local, shared = [], []
        for name, var in program.storage.items():
            role = program.roles.get(name)
            (shared if role is not None and role.on_parameter_server else local).append(
                (name, var))
        step = program.outputs.step
        inits = [step.initializer] + [v.initializer for _, v in local] + \
            program.table_initializers
        if is_chief and init_shared:
            inits += [v.initializer for _, v in shared]
        assigns, feeds = _value_assigns(task, values, local + (
            shared if init_shared and is_chief else []))
        if checkpoint.ITERATIONS in values:
            start = tf.compat.v1.placeholder(tf.int64, [])
            assigns.append(step.assign(start, read_value=False))
            feeds[start] = int(values[checkpoint.ITERATIONS])
    task.run(inits)
    if assigns:
        task.run(assigns, feed_dict=feeds)
    if is_chief:
        task.run(ready.initializer)
    else:
        _wait_for(task, ready, task_index, startup_timeout_s)
    if program.outputs.refresh is not None:  # local copies start at the PS values
        task.run(program.outputs.refresh)


class StateAssign:
    """Sets state variables in every virtual node's copy.

    Its assign ops are built at the first call and reused (a run sets state
    once per epoch and after each run-out; ops built per call would grow the
    graph with every epoch).

    Args:
        task: The program and its session.
    """

    def __init__(self, task: ProgramSession) -> None:
        self.task = task
        self._assigns: dict[str, list[tuple[Any, Any, np.dtype]]] | None = None

    def __call__(self, values: dict[str, Any]) -> None:
        """Sets the state variables named (by single-device name) in `values`."""
        assigns, feeds = [], {}
        for name, value in values.items():
            for placeholder, assign, dtype in self._by_state().get(name, ()):
                assigns.append(assign)
                feeds[placeholder] = np.asarray(value, dtype)
        if assigns:
            self.task.run(assigns, feed_dict=feeds)

    def _by_state(self) -> dict[str, list[tuple[Any, Any, np.dtype]]]:
        """Per state variable, each storage copy's placeholder, assign and dtype."""
        if self._assigns is None:
            program = self.task.program
            self._assigns = {}
            with program.graph.as_default():
                for name, var in program.storage.items():
                    role = program.roles.get(name)
                    if role is None or role.kind != "state":
                        continue
                    dtype = var.dtype.base_dtype
                    placeholder = tf.compat.v1.placeholder(dtype, var.shape)
                    self._assigns.setdefault(role.state, []).append(
                        (placeholder, var.assign(placeholder, read_value=False),
                         dtype.as_numpy_dtype))
        return self._assigns


def shard_part(full: np.ndarray, shard) -> np.ndarray:
    """The part of a variable's value (or residual) that `shard` holds."""
    if shard.num_shards == 1:
        return full
    index = [slice(None)] * full.ndim
    index[shard.axis] = slice(shard.offset, shard.offset + shard.shape[shard.axis])
    return full[tuple(index)]


def _ready_flag(device: str, version: int) -> tf.Variable:
    """Set by the chief once it initialized this membership version's variables."""
    with tf.device(device):
        return tf.compat.v1.Variable(
            True, name="autodist/ps_ready" + (f"_v{version}" if version else ""),
            trainable=False, use_resource=True)


def _value_assigns(task: ProgramSession, values: dict[str, np.ndarray], targets: list):
    """Assign ops (fed by placeholders) giving each of `targets` its value."""
    shards = {}
    for var_shards in task.program.shards.values():
        for shard in var_shards:
            shards[shard.name] = shard
    assigns, feeds = [], {}
    for name, var in targets:
        value = _initial_value(task, name, values, shards)
        if value is None:
            continue
        placeholder = tf.compat.v1.placeholder(var.dtype.base_dtype, var.shape)
        assigns.append(var.assign(placeholder, read_value=False))
        feeds[placeholder] = value
    return assigns, feeds


def _initial_value(task: ProgramSession, name: str, values: dict[str, np.ndarray],
                   shards) -> Any:
    if name in values:  # a storage variable's own value (elastic state transfer)
        return values[name]
    role = task.program.roles.get(name)
    if role is not None and role.kind == "state":
        return values.get(role.state)
    if role is not None and role.kind == "residual":
        shard = shards[role.shard]
        full = residuals.replica_value(
            values.get(residuals.checkpoint_key(shard.var_name, role.square)),
            role.replica, len(task.strategy.replicas))
        return None if full is None else shard_part(full, shard)
    if role is None or role.kind not in ("variable", "slot"):
        return None  # steps and stashes start at their initializers
    shard = shards[role.shard]
    key = checkpoint.slot_key(shard.var_name, role.slot) if role.slot else shard.var_name
    if key not in values:
        return None  # a slot not in the checkpoint starts at its initial value
    return shard_part(values[key], shard)


def _wait_for(task: ProgramSession, flag: tf.Variable, task_index: int,
              startup_timeout_s: float) -> None:
    deadline = time.monotonic() + startup_timeout_s
    with task.program.graph.as_default():
        check = tf.raw_ops.VarIsInitializedOp(resource=flag.handle)
    while True:
        try:
            if task.run(check):
                return
        except tf.errors.UnavailableError:
            pass
        if time.monotonic() > deadline:
            raise WorkerError(f"worker {task_index}: the chief did not initialize the "
                              f"parameter servers within {startup_timeout_s}s")
        time.sleep(0.05)
