"""Big jobs in chunks: cut, signed per chunk, reassembled in order, checked whole; and what a
serving task does with chunks that are tampered with, missing, reordered, repeated, of
another job, or that claim more than a task takes. No cluster: the chief's shipping loop
runs against a fake mailbox."""
from __future__ import annotations

import io
import os
import pathlib
import random
import stat

import numpy as np
import pytest

import autodist
from autodist.ir.errors import InvalidArgumentError
from autodist.launch import chunks, mailbox, signing
from autodist.launch.chunks import Assembly, Receiver
from autodist.launch.job import JobDir
from autodist.runtime.run_config import RunConfig
from autodist.launch.remote import RemoteCluster
from autodist.launch.signing import JobPart, JobRejectedError

SECRET = b"s3cret-of-the-cluster-0123456789"
ARCHIVE = random.Random(0).randbytes(300_000)
CHUNK = 64 << 10   # 5 chunks: 4 of 64 KiB, then 37,856 bytes
NOW = 1_700_000_000.0
TASK = "worker:1"


def _messages(archive=ARCHIVE, secret=SECRET, job_id="cafe01", chunk_bytes=CHUNK, task=TASK):
    return list(chunks.sealed_chunks(secret, job_id, task, io.BytesIO(archive),
                                     chunk_bytes=chunk_bytes, clock=lambda: NOW))


def _parts(messages, secret=SECRET):
    return [signing.unseal_part(m, secret, TASK, NOW + 1) for m in messages]


def _receive(messages, tmp_path, secret=SECRET) -> bytes:
    """What a serving task reassembles from `messages` (raises JobRejectedError)."""
    receiver = Receiver(tmp_path)
    try:
        for part in _parts(messages, secret):
            archive = receiver.add(part)
            if archive is not None:
                return archive.read_bytes()
        raise AssertionError(f"incomplete: {receiver.pending()}")
    finally:
        receiver.discard()


def _leftovers(tmp_path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir())


def test_a_job_is_cut_into_bounded_chunks_each_signed():
    messages = _messages()
    assert len(messages) == 5
    assert all(len(m) < CHUNK + 600 for m in messages)
    parts = _parts(messages)
    assert [p.index for p in parts] == list(range(5))
    assert {(p.count, p.total, p.chunk_bytes, p.version) for p in parts} == \
        {(5, len(ARCHIVE), CHUNK, 2)}
    assert b"".join(bytes(p.data) for p in parts) == ARCHIVE
    assert all(m.startswith(signing.CHUNK_MAGIC) for m in messages)


@pytest.mark.parametrize("secret", [SECRET, None], ids=["secret", "insecure"])
def test_chunks_reassemble_in_any_order_once_each(tmp_path, secret):
    messages = _messages(secret=secret)
    assert _receive(messages, tmp_path, secret) == ARCHIVE
    shuffled = [messages[i] for i in (3, 0, 4, 1, 2)]
    assert _receive(shuffled, tmp_path, secret) == ARCHIVE
    repeated = messages[:3] + messages[:3] + messages[3:]   # the chief retried from chunk 0
    assert _receive(repeated, tmp_path, secret) == ARCHIVE
    assert _leftovers(tmp_path) == []


def test_the_received_job_is_private_and_only_one_chunk_is_held(tmp_path):
    receiver = Receiver(tmp_path)
    parts = _parts(_messages())
    assert receiver.add(parts[0]) is None
    assembly = receiver.current
    assert stat.S_IMODE(os.stat(assembly.directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(assembly.path).st_mode) == 0o600
    assert receiver.pending() == f"job 'cafe01': 1 of 5 chunks ({len(ARCHIVE)} bytes)"
    for part in parts[1:]:
        archive = receiver.add(part)
    assert archive == assembly.path and archive.read_bytes() == ARCHIVE
    receiver.discard()
    assert _leftovers(tmp_path) == []


def test_a_tampered_chunk_is_rejected_before_it_is_kept(tmp_path):
    messages = _messages()
    tampered = messages[2][:-1] + bytes([messages[2][-1] ^ 1])
    with pytest.raises(JobRejectedError, match="bad signature") as caught:
        signing.unseal_part(tampered, SECRET, TASK, NOW)
    assert caught.value.job_id == "cafe01"
    # Its header's index changed: the tag covers it too.
    moved = messages[2].replace(b'"index": 2', b'"index": 3')
    with pytest.raises(JobRejectedError, match="bad signature"):
        signing.unseal_part(moved, SECRET, TASK, NOW)
    # Unsigned (--insecure), a changed chunk passes alone but not the check of the whole.
    plain = _messages(secret=None)
    plain[2] = plain[2][:-1] + bytes([plain[2][-1] ^ 1])
    with pytest.raises(JobRejectedError, match=r"the chunks of job 'cafe01' do not add up to "
                                               r"its archive: 300000 bytes with sha256 "):
        _receive(plain, tmp_path, secret=None)
    assert _leftovers(tmp_path) == []


def test_a_missing_chunk_keeps_the_job_from_running(tmp_path):
    parts = _parts(_messages())
    assembly = Assembly(parts[0], tmp_path)
    try:
        assert not any(assembly.add(p) for p in parts[:3] + parts[4:])
        assert assembly.missing() == [3]
        with pytest.raises(JobRejectedError, match=r"job 'cafe01' misses 1 of its 5 chunks: "
                                                   r"\[3\]"):
            assembly.finish()
        assert assembly.add(parts[3]) and assembly.finish().read_bytes() == ARCHIVE
    finally:
        assembly.close()
    assert _leftovers(tmp_path) == []


def test_a_chunk_of_another_job_is_refused_by_an_assembly(tmp_path):
    ours, theirs = _parts(_messages()), _parts(_messages(job_id="beef02"))
    assembly = Assembly(ours[0], tmp_path)
    try:
        with pytest.raises(JobRejectedError, match="chunk 1 is of job 'beef02', not of job "
                                                   "'cafe01' being received") as caught:
            assembly.add(theirs[1])
        assert caught.value.job_id == "beef02" and assembly.received == 0
        other = _parts(_messages(archive=ARCHIVE[:-1]))   # same job id, another archive
        with pytest.raises(JobRejectedError, match="chunk 1 of job 'cafe01' describes another "
                                                   "archive"):
            assembly.add(other[1])
    finally:
        assembly.close()


def test_a_task_drops_an_unfinished_job_for_a_newer_one(tmp_path, caplog):
    """The chief of the unfinished job stopped sending: the next job's chunks replace it."""
    receiver = Receiver(tmp_path)
    ours, theirs = _parts(_messages()), _parts(_messages(archive=ARCHIVE[:1000], job_id="beef02"))
    assert receiver.add(ours[0]) is None and receiver.add(ours[1]) is None
    first = receiver.current.directory
    archive = receiver.add(theirs[0])
    assert archive is not None and archive.read_bytes() == ARCHIVE[:1000]
    assert not first.exists()
    assert "dropped the unfinished job 'cafe01': 2 of 5 chunks" in caplog.text
    receiver.discard()
    # A job whose chunks disagree is dropped whole.
    assert receiver.add(ours[0]) is None
    with pytest.raises(JobRejectedError, match="describes another archive"):
        receiver.add(_parts(_messages(archive=ARCHIVE[:-1]))[1])
    assert receiver.current is None and _leftovers(tmp_path) == []


def _claim(**fields) -> JobPart:
    base = dict(job_id="cafe01", index=0, count=1, total=10, chunk_bytes=10,
                sha256="0" * 64, data=b"0123456789")
    return JobPart(**(base | fields))


@pytest.mark.parametrize("part, reason", [
    (_claim(total=signing.MAX_JOB_BYTES + 1, count=2, chunk_bytes=signing.MAX_JOB_BYTES),
     f"claims an archive of {signing.MAX_JOB_BYTES + 1} bytes; a task takes at most"),
    (_claim(total=2 ** 63, count=1, chunk_bytes=2 ** 63), "claims an archive of"),
    (_claim(chunk_bytes=signing.MAX_CHUNK_BYTES + 1, total=10),
     "claims chunks of 1073741825 bytes; a task takes 1 to 1073741824"),
    (_claim(chunk_bytes=0), "claims chunks of 0 bytes"),
    (_claim(total=signing.MAX_CHUNKS + 1, chunk_bytes=1, count=signing.MAX_CHUNKS + 1,
            data=b"0"), "claims 1048577 chunks .* at most 1048576"),
    (_claim(count=7), r"claims 7 chunks for 10 bytes in chunks of 10 \(1 chunks\)"),
    (_claim(index=1), "chunk index 1 is not among the job's 1 chunks"),
    (_claim(index=-1), "chunk index -1 is not among"),
    (_claim(data=b"0123"), "chunk 0 of 1 holds 4 bytes; its index says 10"),
    (_claim(index=True), "index must be an integer. Received: 'True'"),
    (_claim(total="10"), "total must be an integer"),
    (_claim(count=1.0), "count must be an integer"),
    (_claim(sha256="ABC"), "sha256 must be 64 hex digits. Received: 'ABC'"),
])
@pytest.mark.parametrize("secret", [SECRET, None], ids=["secret", "insecure"])
def test_claims_beyond_the_bounds_are_rejected_before_anything_is_kept(part, reason, secret):
    message = signing.seal_chunk(secret, TASK, part, NOW)
    with pytest.raises(JobRejectedError, match=reason) as caught:
        signing.unseal_part(message, secret, TASK, NOW)
    assert caught.value.job_id == "cafe01" and len(str(caught.value)) < 400


@pytest.mark.parametrize("message, reason", [
    (_messages()[0], "the job is for task 'worker:1', not this task 'worker:2'"),
    (signing.seal_chunk(SECRET, "worker:2", _claim(), NOW), "bad signature"),   # wrong secret
    (b"ADJOB\x00v3" + bytes(100), r"job message format v3 is not one this autodist reads "
                                  r"\(v1, v2\): is the chief's autodist newer"),
    (signing.CHUNK_MAGIC + bytes(10), "not a job message"),
    (signing.seal_chunk(SECRET, "worker:2", _claim(job_id='a"b'), NOW), "bad signature"),
])
def test_other_tasks_chunks_and_unknown_formats_are_rejected(message, reason):
    secret = b"another-secret-of-32-bytes-long!" if "bad signature" in reason else SECRET
    with pytest.raises(JobRejectedError, match=reason):
        signing.unseal_part(message, secret, "worker:2", NOW)


def test_a_forged_job_id_is_rejected_without_a_secret():
    message = signing.seal_chunk(None, TASK, _claim(job_id="x" * 65), NOW)
    with pytest.raises(JobRejectedError, match="job_id must be 1 to 64 letters"):
        signing.unseal_part(message, None, TASK, NOW)


def test_a_job_message_of_format_v1_is_one_chunk(tmp_path):
    """An older chief's job (the whole archive in one message) is still taken."""
    part = signing.unseal_part(signing.seal(SECRET, "cafe01", TASK, ARCHIVE, NOW), SECRET,
                               TASK, NOW)
    assert (part.version, part.index, part.count, part.total) == (1, 0, 1, len(ARCHIVE))
    receiver = Receiver(tmp_path)
    assert receiver.add(part).read_bytes() == ARCHIVE
    receiver.discard()


def test_the_sender_checks_its_chunk_size_and_the_job_size(monkeypatch):
    with pytest.raises(InvalidArgumentError, match="chunk_bytes must be 1 to 1073741824. "
                                                   "Received: 0"):
        _messages(chunk_bytes=0)
    monkeypatch.setattr(signing, "MAX_JOB_BYTES", 1000)
    with pytest.raises(InvalidArgumentError, match="the job for task worker:1 is 300000 bytes "
                                                   "in 5 chunks of 65536; a task takes at most "
                                                   "1000 bytes"):
        _messages()
    monkeypatch.setattr(chunks, "CHUNK_BYTES", 1000)   # what tests set small
    assert len(list(chunks.sealed_chunks(None, "j", TASK, io.BytesIO(b"x" * 999)))) == 1


def test_an_empty_archive_is_one_empty_chunk(tmp_path):
    (message,) = _messages(archive=b"")
    assert _receive([message], tmp_path) == b""


def test_a_packed_file_unpacks_as_the_packed_bytes(tmp_path, mlp_item):
    spec = autodist.ResourceSpec.local(workers=2)
    strategy = autodist.builders.AllReduce().build(mlp_item, spec)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(700, 784)).astype("float32")    # 2 MB: blocks of rows
    y = rng.integers(0, 10, 700).astype("int32")
    job = JobDir(tmp_path / "chief")
    job.write(mlp_item, strategy, spec, RunConfig(global_batch_size=8, job_id="j1"),
              {"dense_0/kernel": np.ones((784, 256), "float32")}, [x], y,
              order=rng.permutation(700))
    job.write_ports([2222, 2223])
    rows = np.sort(rng.choice(700, 350, replace=False))
    path = tmp_path / "job.tar"
    with open(path, "wb") as f:
        job.pack_into(f, rows)
    assert path.read_bytes() == job.pack(rows)
    shipped = JobDir.unpack(path, tmp_path / "worker1")
    (xs,), ys = shipped.data()
    np.testing.assert_array_equal(xs, x[rows])
    np.testing.assert_array_equal(ys, y[rows])
    np.testing.assert_array_equal(shipped.order(), job.order())
    assert shipped.shard()[0] == 700


# ---------------------------------------------------------------- the chief's side
class _FakeTask:
    """A serving task behind a fake mailbox: takes one message per poll of its job box."""

    def __init__(self, tmp_path: pathlib.Path, secret: bytes | None, job_id: str,
                 reject_at: int | None = None) -> None:
        self.receiver = Receiver(tmp_path)
        self.secret, self.job_id, self.reject_at = secret, job_id, reject_at
        self.box: list[bytes] = []
        self.receipts: list[bytes] = []
        self.sent = 0
        self.most_waiting = 0
        self.archive = b""

    # what RemoteCluster uses of Mailboxes
    def address(self, task):
        return "127.0.0.1:2223"

    def wait_until_up(self, tasks, timeout_s):
        pass

    def send(self, task, box, message, timeout_s):
        assert box == mailbox.JOB
        self.box.append(message)
        self.sent += 1
        self.most_waiting = max(self.most_waiting, len(self.box))

    def waiting(self, task, box, timeout_s=10.0):
        if self.box:   # the task takes one
            self._take(self.box.pop(0))
        return len(self.box)

    def receive_all(self, task, box, timeout_s=10.0):
        receipts, self.receipts = self.receipts, []
        return receipts

    def receive(self, task, box, timeout_s):
        while self.box:
            self._take(self.box.pop(0))
        return self.receipts.pop(0)

    def _take(self, message: bytes) -> None:
        try:
            if self.reject_at is not None and self.sent > self.reject_at:
                raise JobRejectedError("bad signature", self.job_id)
            archive = self.receiver.add(signing.unseal_part(message, self.secret, TASK, NOW))
        except JobRejectedError as e:
            self.receipts.append(f"rejected: {e.reason}".encode())
            return
        if archive is not None:
            self.archive = archive.read_bytes()
            self.receiver.discard()
            self.receipts.append(mailbox.ACCEPTED)


def _cluster(tmp_path, chunk_bytes=CHUNK) -> RemoteCluster:
    cluster = RemoteCluster.__new__(RemoteCluster)   # no job directory, spec or chief needed
    cluster.secret, cluster.chunk_bytes, cluster.startup_timeout_s = SECRET, chunk_bytes, 30.0
    return cluster


def test_the_chief_keeps_a_window_of_chunks_in_the_box(tmp_path, monkeypatch):
    monkeypatch.setattr(signing, "MAX_AGE_S", float("inf"))   # sealed now, read at NOW
    task = _FakeTask(tmp_path, SECRET, "cafe01")
    _cluster(tmp_path)._ship_one(_Mail(task), ("worker", 1), io.BytesIO(ARCHIVE))
    assert task.archive == ARCHIVE and task.sent == 5
    assert task.most_waiting <= chunks.WINDOW


def test_the_chief_stops_sending_at_a_rejection(tmp_path, monkeypatch):
    monkeypatch.setattr(signing, "MAX_AGE_S", float("inf"))
    task = _FakeTask(tmp_path, SECRET, "cafe01", reject_at=0)
    with pytest.raises(JobRejectedError, match="task worker:1 at 127.0.0.1:2223 rejected the "
                                               "job: bad signature"):
        _cluster(tmp_path, chunk_bytes=4096)._ship_one(_Mail(task), ("worker", 1),
                                                       io.BytesIO(ARCHIVE))
    assert task.sent <= chunks.WINDOW + 1   # of 74 chunks
    task.receiver.discard()


class _Mail:
    """The fake task as Mailboxes of the job "cafe01"."""

    job_id = "cafe01"

    def __init__(self, task: _FakeTask) -> None:
        self._task = task

    def __getattr__(self, name):
        return getattr(self._task, name)
