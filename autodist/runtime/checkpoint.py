"""Checkpoints of a distributed run, under the single-device variable names.

The chief writes TensorFlow's V2 checkpoint format with one tensor per
original variable (shards concatenated), its optimizer slots as
``<variable>/optimizer/<slot>``, state variables (batch-norm statistics) by
name, error-feedback residuals as ``<variable>/compressor/residual`` (one
row per replica, `autodist.runtime.residuals`), and the number of applied
updates as ``optimizer/iterations``. Plain
TensorFlow reads it (``tf.train.load_checkpoint(path).get_tensor(name)``);
`restore_keras_weights` puts it into a Keras model; a new distributed run
continues from it (`DistributedRun.fit(initial_checkpoint=...)`), slots and
step included.

Writes are atomic: a checkpoint is written into a temporary directory that is
renamed into place, then the ``latest`` pointer is replaced.
"""
from __future__ import annotations

import os
import pathlib
import shutil

import numpy as np

from autodist.ir.atomic import atomic_write
from autodist.ir.errors import AutodistError

ITERATIONS = "optimizer/iterations"
PREFIX = "ckpt"
LATEST = "latest"


def slot_key(var_name: str, slot: str) -> str:
    """Checkpoint name of a variable's optimizer slot."""
    return f"{var_name}/optimizer/{slot}"


def step_dir(directory: str | os.PathLike, step: int) -> pathlib.Path:
    return pathlib.Path(directory) / f"step-{step:08d}"


def commit(tmp: pathlib.Path, final: pathlib.Path) -> None:
    """Moves a fully written checkpoint into place and points `latest` at it."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write(final.parent / LATEST, final.name.encode())


def latest(directory: str | os.PathLike) -> pathlib.Path | None:
    """The newest complete checkpoint in `directory` (its prefix), or None."""
    pointer = pathlib.Path(directory) / LATEST
    if not pointer.exists():
        return None
    return pathlib.Path(directory) / pointer.read_text().strip() / PREFIX


def resolve(path: str | os.PathLike) -> pathlib.Path:
    """A checkpoint prefix from a prefix, a step directory or a checkpoint directory."""
    path = pathlib.Path(path)
    if (path / LATEST).exists():
        found = latest(path)
        assert found is not None
        return found
    if (path / f"{PREFIX}.index").exists():
        return path / PREFIX
    if pathlib.Path(f"{path}.index").exists():
        return path
    raise AutodistError(f"no checkpoint at {str(path)!r} (expected a directory with "
                        f"'{LATEST}', a step directory, or a checkpoint prefix)")


def load(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint, by name."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    reader = tf.train.load_checkpoint(str(resolve(path)))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def restore_keras_weights(model, path: str | os.PathLike) -> None:
    """Assigns a checkpoint's variables to a Keras model (matched by capture names).

    Raises:
        AutodistError: naming variables the checkpoint lacks or whose shapes differ.
    """
    from autodist.ir.capture import keras_variable_names  # pylint: disable=C0415

    values = load(path)
    trainable, state = keras_variable_names(model)
    pairs = list(zip(trainable, model.trainable_variables)) + \
        list(zip(state, [v for v in model.variables if not v.trainable]))
    missing = [name for name, _ in pairs[:len(trainable)] if name not in values]
    if missing:
        raise AutodistError(f"checkpoint {str(path)!r} has no values for {missing}")
    for name, var in pairs:
        if name not in values:
            continue
        if tuple(values[name].shape) != tuple(var.shape):
            raise AutodistError(f"checkpoint {str(path)!r}: {name!r} has shape "
                                f"{list(values[name].shape)}, the model {list(var.shape)}")
        var.assign(values[name])
