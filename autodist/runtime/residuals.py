"""Error-feedback residuals beyond one program: checkpoints, resizes, strategy switches.

With the ``FP16_ERROR_FEEDBACK`` compressor every replica keeps, per
all-reduced shard, the part of its gradient not sent yet
(`autodist.kernels.all_reduce_synchronizer`). Outside a program they are
kept by variable and replica: the chief reads every replica's residuals of a
variable, reassembles its shards (zero where a shard keeps none, e.g. one on
a parameter server) and stacks them by replica index into one tensor of
shape ``[replicas, *variable.shape]`` under `checkpoint_key`. Checkpoints
hold these tensors, and so does the state the chief hands over at a resize
or a strategy switch.

A program that starts from such values gives each replica's residual the
row of its index (`replica_value`), split into the new program's shards.
So a new strategy with error feedback on the same variables keeps the
residuals, however it groups or partitions them. Where the new program has
fewer replicas (a run resized down, or continued from a checkpoint on fewer
workers), the rows of the replicas it lacks are added to replica 0's: the
sum over replicas, what the replicas together still owe the model, is kept
(up to the float32 rounding of that sum). Replicas it has in addition start
at zero. A variable whose new synchronizer keeps no residual drops it: at
most what each replica's last fp16 cast rounded off (half an fp16 ulp of each
element of its corrected gradient).
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import tensorflow as tf

from autodist.ir.errors import AutodistError
from autodist.ir.graph_item import optimizer_squares_gradient
from autodist.ir.strategy import Strategy
from autodist.kernels.all_reduce_synchronizer import has_residual, residual_spec, residual_step_spec
from autodist.kernels.program import Program
from autodist.kernels.variables import StorageVariable, VariableSpec, create_variables


class ResidualError(AutodistError):
    """A replica's residuals could not be read."""


def checkpoint_key(var_name: str, square: bool = False) -> str:
    """Checkpoint name of a variable's residuals (of its squared rows with `square`)."""
    return f"{var_name}/compressor/{'residual_square' if square else 'residual'}"


def replica_value(stacked: np.ndarray | None, replica: int,
                  replicas: int) -> np.ndarray | None:
    """The residual replica `replica` of a program with `replicas` replicas starts from.

    Args:
        stacked: A variable's residuals by replica index (rows), or None.
        replica: The replica's index.
        replicas: The number of replicas of the new program.

    Returns:
        Row `replica`; for replica 0 plus the rows of replicas the program
        does not have. None (start at zero) without a row for it.
    """
    if stacked is None or replica >= len(stacked):
        return None
    value = np.array(stacked[replica])
    if replica == 0:
        for extra in range(replicas, len(stacked)):
            value = value + stacked[extra]
    return value


@dataclasses.dataclass
class ResidualReads:
    """The chief's reads of every replica's residuals (see `reads`).

    Attributes:
        tensors: Checkpoint key -> the variable's residuals stacked by replica.
            steps: Each replica's residual step count, by replica index.
        own: The index of a replica of the reading task (its count is that
            of the task's last step).
    """

    tensors: dict[str, tf.Tensor]
    steps: list[tf.Tensor]
    own: int


def reads(program: Program, strategy: Strategy) -> ResidualReads | None:
    """Reads of every replica's residuals in `program`'s graph, None without any.

    Residuals of replicas on other tasks are read through handles to their
    shared names on those tasks (no initializer of them is ever run here).
    """
    shards = [s for var in program.graph_item.variables for s in program.shards[var.name]]
    if not any(has_residual(s) for s in shards):
        return None
    squares = optimizer_squares_gradient(program.graph_item.optimizer)
    own = program.replicas[0].device
    handles: dict[str, StorageVariable] = {}

    def handle(spec: VariableSpec) -> StorageVariable:
        if spec.name in program.storage:  # a local replica's
            return program.storage[spec.name]
        if spec.name not in handles:
            handles[spec.name] = create_variables(program.graph, [spec])[0]
        return handles[spec.name]

    devices = list(strategy.replicas)
    tensors = {}
    with program.graph.as_default():
        step_reads = []
        for r, device in enumerate(devices):
            with tf.device(device):
                step_reads.append(handle(residual_step_spec(r, device)).read_value())
        for var in program.graph_item.variables:
            var_shards = program.shards[var.name]
            if not any(has_residual(s) for s in var_shards):
                continue
            for square in (False, True) if var.sparse_gradient and squares else (False,):
                rows = []
                for r, device in enumerate(devices):
                    with tf.device(device):
                        parts = [handle(residual_spec(s, r, device, square)).read_value()
                                 if has_residual(s) else tf.zeros(s.shape, s.dtype)
                                 for s in var_shards]
                    rows.append(parts[0] if len(parts) == 1 else
                                tf.concat(parts, var_shards[0].axis))
                with tf.device(own):
                    tensors[checkpoint_key(var.name, square)] = tf.stack(rows)
    return ResidualReads(tensors, step_reads, program.replicas[0].index)


def wait_until_written(session: tf.compat.v1.Session, residual_reads: ResidualReads,
                       timeout_s: float, options: tf.compat.v1.RunOptions) -> None:
    """Waits until every replica has written its residuals of the chief's last step.

    Raises:
        ResidualError: naming the replicas still behind after `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        steps = session.run(residual_reads.steps, options=options)
        expected = steps[residual_reads.own]
        behind = [r for r, s in enumerate(steps) if s != expected]
        if not behind:
            return
        if time.monotonic() > deadline:
            raise ResidualError(f"replicas {behind} did not write their error-feedback "
                                f"residuals of update {expected} within {timeout_s:g}s "
                                f"(theirs are of updates {[int(steps[r]) for r in behind]})")
        time.sleep(0.001)
