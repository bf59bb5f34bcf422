"""Checkpoints of a distributed run, under the single-device variable names.

The chief writes TensorFlow's V2 checkpoint format with one tensor per
original variable (shards concatenated), its optimizer slots as
``<variable>/optimizer/<slot>``, state variables (batch-norm statistics) by
name, error-feedback residuals as ``<variable>/compressor/residual`` (one
row per replica, `autodist.runtime.residuals`), the number of applied
updates as ``optimizer/iterations`` and, beside it, the steps Keras would have
counted where the data ended as ``optimizer/run_outs``
(`autodist.runtime.run_outs`; Keras' iteration count is their sum). Plain
TensorFlow reads it (``tf.train.load_checkpoint(path).get_tensor(name)``);
`restore_keras_weights` puts it into a Keras model; a new distributed run
continues from it (`DistributedRun.fit(initial_checkpoint=...)`), slots and
step included.

Layout and guarantees (`save`)::

    <dir>/latest                      the name of the newest step directory
    <dir>/step-00000006/ckpt.index    TensorFlow's files ...
    <dir>/step-00000006/ckpt.data-00000-of-00001
    <dir>/step-00000006/manifest.json size and sha256 of each of them

* Atomic: a checkpoint is written into a private temporary directory that is
  renamed into place (swapped with an older one of the same step, never
  deleted before the new one is in place), then ``latest`` is replaced.
* Durable: every file and directory is fsynced before the step that depends
  on it, so after a crash ``latest`` names a complete checkpoint.
* Verified: `load` checks every file against the manifest before TensorFlow's
  reader sees it (that reader may abort the process on a damaged file), so a
  truncated or corrupted checkpoint is a `CheckpointError` naming the file.
* Private: directories are created 0700 and files are 0600.
* ``latest`` only ever names a step directory inside its own directory.
* Retention: ``keep=N`` removes all but the newest N step directories.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import pathlib
import re
import secrets
import shutil
import stat
from typing import Callable

import numpy as np

from autodist.ir.atomic import (PRIVATE_DIR_MODE, PRIVATE_FILE_MODE, NotRegularFileError,
                                atomic_write, create_exclusive, fsync_directory, fsync_path,
                                make_owner_dir, read_regular, write_all)
from autodist.ir.errors import AutodistError, short_repr, shorten

ITERATIONS = "optimizer/iterations"
# Keras' extra iterations where epochs found the data's end (`runtime.run_outs`): kept
# apart from ITERATIONS, which recovery reads as the steps applied.
RUN_OUTS = "optimizer/run_outs"
PREFIX = "ckpt"
LATEST = "latest"
MANIFEST = "manifest.json"
_MANIFEST_FORMAT = "autodist.checkpoint"
_MANIFEST_VERSION = 1
_STEP_DIR = re.compile(r"step-\d{8,}")
# Leftovers of an interrupted save: ".tmp-<step dir>-<pid>-<token>", ".old-...".
_LEFTOVER = re.compile(r"\.(tmp|old)-step-\d{8,}-(\d+)-[0-9a-f]+")
_MAX_POINTER_BYTES = 256
_MAX_MANIFEST_BYTES = 1 << 20
_HASH_CHUNK = 1 << 20


class CheckpointError(AutodistError):
    """A checkpoint is missing, incomplete or damaged, or cannot be written."""


def keras_iterations(values) -> int:
    """Keras' iteration count of saved values: the updates applied plus the run-outs."""
    return int(np.asarray(values[ITERATIONS])) + int(np.asarray(values.get(RUN_OUTS, 0)))


def continued(values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Saved values as a new run starts from them: its update count is Keras' iteration
    count (the saved run's run-outs included)."""
    values = dict(values)
    if ITERATIONS in values:
        values[ITERATIONS] = np.asarray(keras_iterations(values), np.int64)
    values.pop(RUN_OUTS, None)
    return values


def slot_key(var_name: str, slot: str) -> str:
    """Checkpoint name of a variable's optimizer slot."""
    return f"{var_name}/optimizer/{slot}"


def step_dir(directory: str | os.PathLike, step: int) -> pathlib.Path:
    return pathlib.Path(directory) / f"step-{step:08d}"


# ------------------------------------------------------------------- writing
def save(directory: str | os.PathLike, step: int, write_bundle: Callable[[str], None], *,
         keep: int | None = None) -> pathlib.Path:
    """Writes the checkpoint of `step` durably and atomically; returns its step directory.

    Args:
        directory: The checkpoint directory (created 0700 if missing).
        step: The step number (names the step directory).
        write_bundle: Writes TensorFlow's checkpoint files for a prefix
            (e.g. runs a `SaveV2` op); called once, with a prefix inside a
            fresh private directory.
        keep: Keep only the newest `keep` step directories (None: all).

    Raises:
        CheckpointError: `keep` is not a positive integer, or writing failed.
    """
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise CheckpointError(f"keep must be a positive number of checkpoints. "
                              f"Received: {short_repr(keep)}")
    directory = make_owner_dir(directory)
    final = step_dir(directory, step)
    _remove_leftovers(directory)
    tmp = directory / f".tmp-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir(mode=PRIVATE_DIR_MODE)
    try:
        write_bundle(str(tmp / PREFIX))
        _seal(tmp, step)
        commit(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if keep is not None:
        prune(directory, keep)
    return final


def _seal(tmp: pathlib.Path, step: int) -> None:
    """Makes the bundle's files private and durable and records them in the manifest."""
    files = {}
    for path in sorted(tmp.iterdir()):
        if not path.name.startswith(f"{PREFIX}.") or not path.is_file():
            raise CheckpointError(f"unexpected entry {path.name!r} in the checkpoint being "
                                  f"written at {str(tmp)!r}")
        os.chmod(path, PRIVATE_FILE_MODE)
        fsync_path(path)
        files[path.name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    if f"{PREFIX}.index" not in files:
        raise CheckpointError(f"writing the checkpoint produced no {PREFIX}.index in "
                              f"{str(tmp)!r}")
    manifest = json.dumps({"format": _MANIFEST_FORMAT, "version": _MANIFEST_VERSION,
                           "step": step, "files": files}, indent=1, sort_keys=True).encode()
    fd = create_exclusive(tmp / MANIFEST)
    try:
        write_all(fd, manifest)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_directory(tmp)


def commit(tmp: pathlib.Path, final: pathlib.Path) -> None:
    """Moves a fully written checkpoint into place and points `latest` at it.

    The new directory takes `final`'s place in one rename; an existing
    `final` (a step written again) is swapped out atomically where the
    filesystem can (renameat2 RENAME_EXCHANGE), else moved aside just before,
    and removed only once `latest` names the new one.
    """
    parent = final.parent
    old = None
    if final.exists():
        if _exchange(tmp, final):
            old = tmp    # now holds the previous checkpoint
        else:
            old = parent / f".old-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
            final.rename(old)
            tmp.rename(final)
    else:
        tmp.rename(final)
    fsync_directory(parent)
    atomic_write(parent / LATEST, final.name.encode(), mode=PRIVATE_FILE_MODE)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _exchange(a: pathlib.Path, b: pathlib.Path) -> bool:
    """Swaps two paths atomically (Linux renameat2); False where that is not available."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(code, f"cannot swap {str(a)!r} and {str(b)!r}: {os.strerror(code)}")


def prune(directory: str | os.PathLike, keep: int) -> list[pathlib.Path]:
    """Removes all but the newest `keep` step directories (never the one `latest` names).

    Returns:
        The removed directories.
    """
    directory = pathlib.Path(directory)
    newest = _pointer(directory)
    steps = sorted((p for p in directory.iterdir()
                    if _STEP_DIR.fullmatch(p.name) and p.is_dir() and not p.is_symlink()),
                   key=lambda p: int(p.name[len("step-"):]))
    removed = []
    for path in steps[:max(len(steps) - keep, 0)]:
        if path.name != newest:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _remove_leftovers(directory: pathlib.Path) -> None:
    """Removes temporary directories of saves whose process is gone (crashed mid-save)."""
    for path in directory.iterdir():
        match = _LEFTOVER.fullmatch(path.name)
        if match is None or int(match.group(2)) == os.getpid():
            continue
        try:
            os.kill(int(match.group(2)), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (PermissionError, OverflowError):
            pass


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# ------------------------------------------------------------------- reading
def _read_regular(path: pathlib.Path, limit: int) -> bytes:
    """Up to `limit` bytes of a regular file, opened without blocking (a FIFO or a device
    in its place would block a plain open or read forever).

    Raises:
        FileNotFoundError: it does not exist.
        CheckpointError: it is not a regular file, or cannot be read.
    """
    try:
        return read_regular(path, limit)
    except FileNotFoundError:
        raise
    except NotRegularFileError as e:
        raise CheckpointError(str(e)) from None
    except OSError as e:
        raise CheckpointError(f"cannot read {str(path)!r}: {e}") from e


def _pointer(directory: pathlib.Path) -> str | None:
    """The step directory `latest` names (checked to be one inside `directory`), or None."""
    pointer = directory / LATEST
    try:
        raw = _read_regular(pointer, _MAX_POINTER_BYTES + 1)
    except FileNotFoundError:
        return None
    name = raw.decode("ascii", "replace").strip()
    if len(raw) > _MAX_POINTER_BYTES or not _STEP_DIR.fullmatch(name):
        raise CheckpointError(f"{str(pointer)!r} must name a step directory in its directory "
                              f"(e.g. 'step-00000006'). Received: {short_repr(raw, 80)}")
    return name


def latest(directory: str | os.PathLike) -> pathlib.Path | None:
    """The newest complete checkpoint in `directory` (its prefix), or None.

    Raises:
        CheckpointError: ``latest`` is malformed or names a missing step directory.
    """
    directory = pathlib.Path(directory)
    name = _pointer(directory)
    if name is None:
        return None
    target = directory / name
    if target.is_symlink() or not target.is_dir():
        raise CheckpointError(f"{str(directory / LATEST)!r} names {name!r}, which is not a "
                              f"step directory in {str(directory)!r}")
    return target / PREFIX


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
    raise CheckpointError(f"no checkpoint at {str(path)!r} (expected a directory with "
                          f"'{LATEST}', a step directory, or a checkpoint prefix)")


def check_files(prefix: str | os.PathLike) -> None:
    """Checks a checkpoint's files against its manifest (sizes and sha256).

    Raises:
        CheckpointError: naming the file that is missing, unlisted, truncated
            or altered, or the manifest's problem.
    """
    prefix = pathlib.Path(prefix)
    folder = prefix.parent
    manifest_path = folder / MANIFEST
    try:
        raw = _read_regular(manifest_path, _MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError as e:
        raise CheckpointError(
            f"checkpoint {str(prefix)!r} has no {MANIFEST} (not written by autodist, or by an "
            "older one); load it with verify=False to read it unverified (TensorFlow may abort the "
            "process on a damaged checkpoint)") from e
    files = _manifest_files(raw, manifest_path)
    if prefix.name != PREFIX:
        raise CheckpointError(f"checkpoint prefix {str(prefix)!r} must end in {PREFIX!r}")
    present = {p.name for p in folder.iterdir() if p.name.startswith(f"{PREFIX}.")}
    unlisted = sorted(present - set(files))
    if unlisted:
        raise CheckpointError(f"checkpoint {str(folder)!r} has files its manifest does not "
                              f"list: {short_repr(unlisted)}")
    for name, expected in sorted(files.items()):
        path = folder / name
        try:
            info = path.lstat()
        except FileNotFoundError as e:
            raise CheckpointError(f"checkpoint file {str(path)!r} is missing") from e
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"checkpoint file {str(path)!r} is not a regular file")
        size = info.st_size
        if size != expected["size"]:
            raise CheckpointError(f"checkpoint file {str(path)!r} has {size} bytes; it was "
                                  f"written with {expected['size']} (truncated or damaged)")
        if _sha256(path) != expected["sha256"]:
            raise CheckpointError(f"checkpoint file {str(path)!r} is damaged: its sha256 "
                                  "differs from the manifest's")


def _manifest_files(raw: bytes, path: pathlib.Path) -> dict[str, dict]:
    """The manifest's files, each checked: a plain name, a size and a sha256."""
    where = f"checkpoint manifest {str(path)!r}"
    if len(raw) > _MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{where} is larger than {_MAX_MANIFEST_BYTES} bytes")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:   # UnicodeDecodeError is a ValueError
        why = "nested too deeply" if isinstance(e, RecursionError) else shorten(str(e), 200)
        raise CheckpointError(f"{where} is not JSON: {why}") from e
    if not isinstance(data, dict) or data.get("format") != _MANIFEST_FORMAT:
        raise CheckpointError(f"{where} is not a checkpoint manifest (no format "
                              f"{_MANIFEST_FORMAT!r})")
    if data.get("version") != _MANIFEST_VERSION:
        raise CheckpointError(f"{where} has version {short_repr(data.get('version'))}; this "
                              f"autodist reads version {_MANIFEST_VERSION}")
    files = data.get("files")
    if not isinstance(files, dict) or f"{PREFIX}.index" not in files:
        raise CheckpointError(f"{where} must list the checkpoint's files, {PREFIX}.index "
                              f"among them. Received: {short_repr(files)}")
    for name, entry in files.items():
        if not re.fullmatch(rf"{PREFIX}\.[A-Za-z0-9_.-]+", name) or ".." in name:
            raise CheckpointError(f"{where} lists a file name that is not a checkpoint file "
                                  f"beside it: {short_repr(name)}")
        if not isinstance(entry, dict) or \
                not isinstance(entry.get("size"), int) or isinstance(entry["size"], bool) or \
                entry["size"] < 0 or not isinstance(entry.get("sha256"), str) or \
                not re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]):
            raise CheckpointError(f"{where}: the entry of {name!r} must have a size and a "
                                  f"sha256. Received: {short_repr(entry)}")
    return files


def load(path: str | os.PathLike, *, verify: bool = True) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint, by name.

    Args:
        path: A checkpoint directory (its newest checkpoint), a step directory
            or a prefix.
        verify: Check the files against the manifest first (see
            `check_files`). False reads a checkpoint without one (e.g. written by
            plain TensorFlow); TensorFlow may then abort the process on a
            damaged file.

    Raises:
        CheckpointError: naming the checkpoint and what is wrong with it.
    """
    prefix = resolve(path)
    if verify:
        check_files(prefix)
    import tensorflow as tf

    try:
        reader = tf.train.load_checkpoint(str(prefix))
        return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}
    except Exception as e:  # TF raises many kinds
        raise CheckpointError(f"TensorFlow cannot read checkpoint {str(prefix)!r}: "
                              f"{type(e).__name__}: {shorten(str(e), 500)}") from e


def restore_keras_weights(model, path: str | os.PathLike, *, verify: bool = True) -> None:
    """Assigns a checkpoint's variables to a Keras model (matched by capture names).

    Raises:
        AutodistError: naming variables the checkpoint lacks or whose shapes differ.
        CheckpointError: the checkpoint is missing or damaged (see `load`).
    """
    from autodist.ir.capture import keras_variable_names

    values = load(path, verify=verify)
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
        if np.dtype(values[name].dtype) != np.dtype(var.dtype):
            raise AutodistError(f"checkpoint {str(path)!r}: {name!r} holds "
                                f"{np.dtype(values[name].dtype).name}, the model's variable "
                                f"{np.dtype(var.dtype).name}; it would be cast: restore it "
                                "into a model of the checkpoint's dtypes")
        var.assign(values[name])
