"""Checkpoint files without a cluster: durable atomic commits, verification against the
manifest, the `latest` pointer, retention and permissions (autodist.runtime.checkpoint)."""
from __future__ import annotations

import os
import stat

import numpy as np
import pytest
import tensorflow as tf

from autodist.runtime import checkpoint
from autodist.runtime.checkpoint import CheckpointError


def _tensors(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {"dense/kernel": rng.normal(size=(4, 3)).astype("float32"),
            "dense/kernel/optimizer/m": rng.normal(size=(4, 3)).astype("float32"),
            checkpoint.ITERATIONS: np.asarray(step, np.int64)}


def _writer(tensors: dict[str, np.ndarray]):
    names = sorted(tensors)

    def write(prefix: str) -> None:
        tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names),
                          tensors=[tensors[n] for n in names])
    return write


def _save(directory, step: int, **kwargs):
    return checkpoint.save(directory, step, _writer(_tensors(step)), **kwargs)


def _assert_values(values, step: int) -> None:
    expected = _tensors(step)
    assert sorted(values) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(values[name], value)


def test_save_writes_a_verified_private_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    final = _save(directory, 3)
    assert final == directory / "step-00000003"
    assert sorted(p.name for p in directory.iterdir()) == ["latest", "step-00000003"]
    assert sorted(p.name for p in final.iterdir()) == [
        "ckpt.data-00000-of-00001", "ckpt.index", "manifest.json"]
    for path in [directory, final]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    for path in [directory / "latest", *final.iterdir()]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    _assert_values(checkpoint.load(directory), 3)
    reader = tf.train.load_checkpoint(str(final / "ckpt"))     # plain TensorFlow reads it
    assert reader.get_tensor(checkpoint.ITERATIONS) == 3


def test_every_file_and_directory_is_fsynced_before_it_is_relied_on(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    directory = tmp_path / "ckpt"
    final = _save(directory, 3)
    tmp = [i for i, p in enumerate(synced) if ".tmp-step-00000003-" in p]
    renamed = synced.index(str(directory))
    # The bundle's files, the manifest and the temporary directory, before the rename ...
    assert {os.path.basename(synced[i]) for i in tmp} >= {
        "ckpt.index", "ckpt.data-00000-of-00001", "manifest.json"}
    assert os.path.basename(synced[tmp[-1]]).startswith(".tmp-step-00000003-")
    assert max(tmp) < renamed
    # ... then the checkpoint directory (the rename), the new pointer, the directory again.
    assert ".latest.tmp-" in synced[renamed + 1] and synced[renamed + 2:] == [str(directory)]
    assert final.exists()


def test_a_truncated_file_is_named(tmp_path):
    directory = tmp_path / "ckpt"
    _save(directory, 3)
    data = directory / "step-00000003" / "ckpt.data-00000-of-00001"
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[:size // 2])
    with pytest.raises(CheckpointError, match=rf"ckpt.data-00000-of-00001' has {size // 2} bytes; "
                                              rf"it was written with {size} \(truncated"):
        checkpoint.load(directory)


def test_a_flipped_bit_is_named(tmp_path):
    directory = tmp_path / "ckpt"
    _save(directory, 3)
    index = directory / "step-00000003" / "ckpt.index"
    raw = bytearray(index.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    index.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="ckpt.index' is damaged: its sha256 differs"):
        checkpoint.load(directory / "step-00000003")


@pytest.mark.parametrize("pointer", [b"../elsewhere", b"/etc", b"step-00000003/../../x",
                                     b"", b"step-3", b"step-00000003\x00", b"x" * 5000])
def test_latest_never_points_outside_its_directory(tmp_path, pointer):
    directory = tmp_path / "ckpt"
    _save(directory, 3)
    (directory / "latest").write_bytes(pointer)
    with pytest.raises(CheckpointError, match="must name a step directory in its directory") as e:
        checkpoint.load(directory)
    assert len(str(e.value)) < 400


def test_latest_naming_a_missing_step_is_named(tmp_path):
    directory = tmp_path / "ckpt"
    _save(directory, 3)
    (directory / "latest").write_bytes(b"step-00000009")
    with pytest.raises(CheckpointError, match="names 'step-00000009', which is not a step "
                                              "directory"):
        checkpoint.load(directory)


@pytest.mark.parametrize("exchange", [True, False])
def test_a_step_written_again_replaces_the_old_one_without_a_gap(tmp_path, monkeypatch,
                                                                 exchange):
    if not exchange:   # a filesystem without renameat2(RENAME_EXCHANGE)
        monkeypatch.setattr(checkpoint, "_exchange", lambda a, b: False)
    directory = tmp_path / "ckpt"
    _save(directory, 3)
    first = (directory / "step-00000003" / "ckpt.index").read_bytes()
    checkpoint.save(directory, 3, _writer(_tensors(4)))
    assert sorted(p.name for p in directory.iterdir()) == ["latest", "step-00000003"]
    assert (directory / "step-00000003" / "ckpt.index").read_bytes() != first
    _assert_values(checkpoint.load(directory), 4)


def test_a_failed_write_leaves_the_previous_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    _save(directory, 3)

    def fail(prefix: str) -> None:
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        checkpoint.save(directory, 6, fail)
    assert sorted(p.name for p in directory.iterdir()) == ["latest", "step-00000003"]
    _assert_values(checkpoint.load(directory), 3)


def test_keep_retains_the_newest_checkpoints(tmp_path):
    directory = tmp_path / "ckpt"
    for step in (1, 2, 3, 10, 11):
        _save(directory, step, keep=2)
    assert sorted(p.name for p in directory.iterdir()) == ["latest", "step-00000010",
                                                           "step-00000011"]
    _assert_values(checkpoint.load(directory), 11)
    with pytest.raises(CheckpointError, match="keep must be a positive number of checkpoints. "
                                              "Received: 0"):
        _save(directory, 12, keep=0)


def test_leftovers_of_a_crashed_save_are_removed(tmp_path):
    directory = tmp_path / "ckpt"
    _save(directory, 3)
    dead = 2 ** 22 + 12345            # above the default pid_max: no such process
    leftover = directory / f".tmp-step-00000006-{dead}-abcd0123"
    leftover.mkdir()
    (leftover / "ckpt.index").write_bytes(b"half")
    _save(directory, 6)
    assert sorted(p.name for p in directory.iterdir()) == ["latest", "step-00000003",
                                                           "step-00000006"]


def test_a_checkpoint_without_a_manifest_needs_verify_false(tmp_path):
    prefix = tmp_path / "plain" / "ckpt"
    _writer(_tensors(5))(str(prefix))     # as plain TensorFlow writes one
    with pytest.raises(CheckpointError, match="has no manifest.json .*verify=False"):
        checkpoint.load(prefix)
    _assert_values(checkpoint.load(prefix, verify=False), 5)


def test_an_unlisted_file_is_named(tmp_path):
    directory = tmp_path / "ckpt"
    final = _save(directory, 3)
    (final / "ckpt.data-00001-of-00002").write_bytes(b"extra")
    with pytest.raises(CheckpointError, match=r"files its manifest does not list: "
                                              r"\['ckpt.data-00001-of-00002'\]"):
        checkpoint.load(directory)


@pytest.mark.parametrize("name", ["latest", "manifest", "data"])
def test_a_fifo_in_place_of_a_file_is_named_not_waited_on(tmp_path, name):
    """A FIFO (or any file that is not a regular one) would block a plain read forever."""
    directory = tmp_path / "ckpt"
    final = _save(directory, 2)
    target = {"latest": directory / "latest", "manifest": final / "manifest.json",
              "data": final / "ckpt.data-00000-of-00001"}[name]
    target.unlink()
    os.mkfifo(target)
    with pytest.raises(CheckpointError, match="is not a regular file"):
        checkpoint.load(directory)


def test_restoring_into_variables_of_another_dtype_is_refused(tmp_path):
    import keras

    from autodist.ir.capture import keras_variable_names
    from autodist.ir.errors import AutodistError

    directory = tmp_path / "ckpt"
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="dense",
                                                                    dtype="float64")])
    names, _ = keras_variable_names(model)
    values = dict(zip(names, [np.ones((4, 3), np.float32), np.zeros(3, np.float32)]))
    checkpoint.save(directory, 1, _writer(values))
    with pytest.raises(AutodistError, match="holds float32, the model's variable float64"):
        checkpoint.restore_keras_weights(model, directory)
