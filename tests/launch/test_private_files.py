"""Job directories are private: 0700 directories, 0600 files, temporary names never followed."""
from __future__ import annotations

import io
import os
import pathlib
import stat
import tarfile

import numpy as np
import pytest

import autodist
from autodist.launch import private_files
from autodist.launch.job import JobDir
from autodist.runtime.run_config import RunConfig
from autodist.launch.private_files import PrivateDirError


def _modes(root: pathlib.Path) -> dict[str, int]:
    modes = {".": stat.S_IMODE(root.stat().st_mode)}
    for path in root.rglob("*"):
        modes[str(path.relative_to(root))] = stat.S_IMODE(path.lstat().st_mode)
    return modes


def _assert_private(root: pathlib.Path) -> None:
    for name, mode in _modes(root).items():
        path = root / name
        assert mode == (0o700 if path.is_dir() else 0o600), (name, oct(mode))


def _job(path, mlp_item) -> JobDir:
    spec = autodist.ResourceSpec.local(workers=2)
    strategy = autodist.builders.AllReduce().build(mlp_item, spec)
    rng = np.random.default_rng(0)
    job = JobDir.create(path)
    job.write(mlp_item, strategy, spec, RunConfig(global_batch_size=8, job_id="j1"),
              {"dense_0/kernel": np.ones((784, 256), "float32")},
              [rng.normal(size=(40, 784)).astype("float32")],
              rng.integers(0, 10, 40).astype("int32"))
    job.write_ports([2222, 2223])
    job.write_file(job.stop_request(), b"stop")
    return job


def test_a_job_and_its_shipped_copy_are_private(tmp_path, mlp_item):
    old = os.umask(0o022)  # what a user's shell usually has
    try:
        job = _job(tmp_path / "a" / "job", mlp_item)
        shipped = JobDir.unpack(job.pack(np.arange(8)), tmp_path / "shipped")
    finally:
        os.umask(old)
    assert len(_modes(job.path)) > 12
    _assert_private(job.path)
    _assert_private(shipped.path)
    temporary = JobDir.create()
    assert stat.S_IMODE(temporary.path.stat().st_mode) == 0o700
    temporary.path.rmdir()


def test_an_existing_job_dir_open_to_others_is_refused(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    with pytest.raises(PrivateDirError, match=f"job directory '{loose}' has mode 0755: other "
                                              "users could read the job.*`chmod 700` it"):
        JobDir.create(loose)
    loose.chmod(0o700)
    assert JobDir.create(loose).path == loose        # private already: accepted as it is
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(PrivateDirError, match="exists and is not a directory"):
        JobDir.create(afile)


def test_a_job_dir_of_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another user")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(PrivateDirError, match=f"job directory '{theirs}' belongs to uid 65534, "
                                              "not to this user"):
        JobDir.create(theirs)


def test_a_link_planted_at_the_temporary_name_is_not_followed(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    monkeypatch.setattr(private_files.secrets, "token_hex", lambda n: "0" * (2 * n))
    target = tmp_path / "job" / "run.json"
    target.parent.mkdir()
    (target.parent / f".run.json.{'0' * 16}.tmp").symlink_to(victim)
    with pytest.raises(FileExistsError):
        private_files.write_private(target, b"{}")
    assert victim.read_bytes() == b"precious" and not target.exists()


def test_a_link_planted_at_a_log_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    log = tmp_path / "worker_0.log"
    log.symlink_to(victim)
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        private_files.open_private_append(log)
    assert victim.read_bytes() == b"precious"
    fresh = tmp_path / "worker_1.log"
    with private_files.open_private_append(fresh) as f:
        f.write(b"line\n")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o600


def test_a_failed_write_leaves_nothing_behind(tmp_path):
    target = tmp_path / "init.npz"
    with pytest.raises(RuntimeError):
        with private_files.private_writer(target) as f:
            f.write(b"half")
            raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.DIRTYPE,
                                  tarfile.CHRTYPE])
def test_unpack_refuses_links_and_special_members(tmp_path, kind):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("data/x_0.npy")
        info.type = kind
        info.linkname = "/etc/passwd"
        tar.addfile(info)
    with pytest.raises(ValueError, match="unexpected member 'data/x_0.npy'"):
        JobDir.unpack(buffer.getvalue(), tmp_path / "job")
    assert not (tmp_path / "job").exists()
