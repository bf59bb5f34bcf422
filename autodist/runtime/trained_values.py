"""The chief's reads of the trained values: final weights, checkpoints, recovery.

`TrainedValues` reads every variable of a program by its single-device name
(shards joined), with the optimizer's slots, its update count and
error-feedback residuals where asked; what the chief writes from them
(checkpoints, the recovery file, epoch and final weights) goes through it.
"""
from __future__ import annotations

import io
import pathlib

import numpy as np
import tensorflow as tf

from autodist.ir.atomic import atomic_write
from autodist.kernels import loss_scaling, replicator
from autodist.runtime import checkpoint
from autodist.runtime import recovery
from autodist.runtime import residuals
from autodist.runtime.run_config import RunConfig
from autodist.runtime.worker_session import ProgramSession


class TrainedValues:
    """The values of one program's variables, as the chief sees them.

    Args:
        task: The program and its session.
        config: The run's config (checkpoints, timeouts).
    """

    def __init__(self, task: ProgramSession, config: RunConfig) -> None:
        self.task = task
        self.config = config
        # Trainable variables no step reads (no storage holds them): never updated,
        # they are their values at the run's start, as constants (`keep_unused`).
        self._unused: dict[str, tf.Tensor] = {}
        self._save: tuple[tf.Tensor, tf.Operation] | None = None
        self._residual_reads: residuals.ResidualReads | None = None
        self._residuals_read = False

    def keep_unused(self, values: dict[str, np.ndarray]) -> None:
        """Keeps, from the run's starting `values`, those of the trainable variables the
        step does not use (keras-io's deit: a variable created twice, one copy stale), so
        that every read, checkpoint and the final weights hold them, unchanged as Keras
        leaves them."""
        with self.task.program.graph.as_default():
            self._unused = {v.name: tf.constant(np.asarray(values[v.name]))
                            for v in self.task.graph_item.variables
                            if not v.handle_node and v.name in values}

    def tensors(self, with_optimizer: bool,
                with_residuals: bool = False) -> dict[str, tf.Tensor]:
        """Tensors of every variable (shards concatenated) by single-device name.

        The chief's view: PS shards and its own mirrored copies. With
        `with_optimizer`, also slots and the update count (for checkpoints).
        With `with_residuals`, also every replica's error-feedback residuals
        (`autodist.runtime.residuals`; run them only after
        `wait_for_residuals`).
        """
        program = self.task.program
        graph_item = self.task.graph_item
        replica = program.replicas[0]
        tensors = {}
        with program.graph.as_default():
            for var in graph_item.variables:
                shards = program.shards[var.name]
                if not var.handle_node:   # no storage: its value at the start
                    if var.name in self._unused:
                        tensors[var.name] = self._unused[var.name]
                    continue
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
            for state in graph_item.state_variables:
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
        if not self._residuals_read:
            self._residual_reads = residuals.reads(self.task.program, self.task.strategy)
            self._residuals_read = True
        return self._residual_reads

    def wait_for_residuals(self) -> None:
        """Chief: until every replica has written its residuals of the last step."""
        if self._residuals() is not None:
            residuals.wait_until_written(self.task.session, self._residuals(),
                                         self.config.step_timeout_s, self.task.run_options)

    def read(self, with_optimizer: bool = True) -> dict[str, np.ndarray]:
        """Trained values by variable name, shards reassembled (chief's view); with
        `with_optimizer`, also the optimizer's slots and update count (by checkpoint
        key), which return into the Keras optimizer."""
        return self.task.run(self.tensors(with_optimizer=with_optimizer))

    def handed_over(self) -> dict[str, np.ndarray]:
        """Every value a membership change hands over: with slots, the update count
        and every replica's residuals (after they are written)."""
        self.wait_for_residuals()
        return self.task.run(self.tensors(with_optimizer=True, with_residuals=True))

    def save_checkpoint(self, step: int, run_outs: int = 0) -> pathlib.Path:
        """Writes a checkpoint atomically and durably (chief only); returns its directory.
        `run_outs`: Keras' extra iterations so far (`checkpoint.RUN_OUTS`)."""
        if self._save is None:
            tensors = self.tensors(with_optimizer=True, with_residuals=True)
            with self.task.program.graph.as_default():
                counted = tf.compat.v1.placeholder(tf.int64, [])
                tensors[checkpoint.RUN_OUTS] = counted
                names = sorted(tensors)
                prefix = tf.compat.v1.placeholder(tf.string, [])
                op = tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names,
                                       shape_and_slices=[""] * len(names),
                                       tensors=[tensors[n] for n in names])
            self._save = (prefix, counted, op)
        prefix, counted, op = self._save
        self.wait_for_residuals()

        def write(path: str) -> None:
            self.task.session.run(op, {prefix: path, counted: run_outs},
                                  options=self.task.run_options)

        return checkpoint.save(self.config.checkpoint_dir, step, write,
                               keep=self.config.checkpoints_to_keep)

    def save_recovery(self, path: pathlib.Path, next_index: int, run_outs: int = 0) -> None:
        """Writes the values (with slots, the update count and `run_outs`, as a
        checkpoint) and the step to resume at to `path`, atomically. Residuals are not
        among them (a dead worker's cannot be read): after a recovery they start at
        zero."""
        values = self.task.run(self.tensors(with_optimizer=True))
        values[checkpoint.RUN_OUTS] = np.asarray(run_outs, np.int64)
        values[recovery.NEXT_STEP] = np.asarray(next_index, np.int64)
        buffer = io.BytesIO()
        np.savez(buffer, **values)
        atomic_write(path, buffer.getvalue())


def write_weights(path: pathlib.Path, values: dict[str, np.ndarray]) -> None:
    """Writes weights by variable name to `path` (.npz) atomically."""
    atomic_write(path, pack(values))


def pack(values: dict[str, np.ndarray]) -> bytes:
    """Values by name as the bytes of an .npz file."""
    buffer = io.BytesIO()
    np.savez(buffer, **values)
    return buffer.getvalue()


def unpack(data: bytes) -> dict[str, np.ndarray]:
    """Values by name from the bytes of an .npz file (`pack`)."""
    with np.load(io.BytesIO(data)) as arrays:
        return {name: arrays[name] for name in arrays.files}
