"""Big jobs in pieces: a job archive cut into signed chunks, and put back together.

A mailbox message is one scalar string tensor, and TensorFlow refuses one of
2 GiB or more; a job's archive holds the rows of the data its task reads, so
it may be larger. The chief therefore sends it as chunks of `CHUNK_BYTES`
(`sealed_chunks`), each a format-v2 message (`autodist.launch.signing`)
signed on its own over the job id, the task, the chunk's index, the chunk
count, the archive's total size and sha256, and the chunk's bytes.

The serving task keeps the chunks of one job at a time (`Receiver`): each is
verified before anything of it is kept, then written at its place in a
private file (so a task holds one chunk in memory, whatever the job's size,
and chunks may come in any order; a repeated chunk is ignored). When every
chunk is there, the file's size and sha256 must be those every chunk named,
or the job is rejected; only then is it unpacked. What a peer may claim is
bounded before anything is kept: at most `signing.MAX_JOB_BYTES` in at most
`signing.MAX_CHUNKS` chunks of at most `signing.MAX_CHUNK_BYTES`. A verified
chunk of another job replaces an unfinished one (its chief stopped sending,
or sent again under a new id); a chunk that fails a check is rejected with a
receipt, and its job's unfinished chunks are dropped.

The chief keeps at most `WINDOW` chunks waiting in a task's job box
(`autodist.launch.remote`), so the task's server never queues the whole job.
"""
from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import shutil
import tempfile
import time
from typing import BinaryIO, Callable, Iterator

from autodist.ir.errors import InvalidArgumentError
from autodist.launch import signing
from autodist.launch.signing import JobPart, JobRejectedError

# The size of the chunks a chief cuts a job into (tests set it small).
CHUNK_BYTES = 64 << 20
# Chunks a chief lets wait in a task's job box at a time.
WINDOW = 2
_READ_BYTES = 16 << 20

logger = logging.getLogger(__name__)


def describe(archive: BinaryIO) -> tuple[int, str]:
    """(size in bytes, sha256 in hex) of a job archive file, read from its start."""
    archive.seek(0)
    digest = hashlib.sha256()
    total = 0
    while block := archive.read(_READ_BYTES):
        digest.update(block)
        total += len(block)
    return total, digest.hexdigest()


def sealed_chunks(secret: bytes | None, job_id: str, task: str, archive: BinaryIO, *,
                  chunk_bytes: int | None = None,
                  clock: Callable[[], float] = time.time) -> Iterator[bytes]:
    """The messages of a job archive for `task`, one chunk each, sealed as each is made.

    Each is sealed when it is taken (`clock`), so a job that takes long to
    send is not refused as too old.

    Args:
        secret: The shared secret; None sends unsigned chunks.
        job_id: The job's id.
        task: The task the job is for ("job:index").
        archive: The job archive (`JobDir.pack_into`), read from its start.
        chunk_bytes: The chunk size (None: `CHUNK_BYTES`).
        clock: The time each chunk is sealed at.

    Raises:
        InvalidArgumentError: the chunk size or the archive exceeds what a task
            accepts (`signing.MAX_CHUNK_BYTES`, `MAX_JOB_BYTES`, `MAX_CHUNKS`).
    """
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    if not 1 <= chunk_bytes <= signing.MAX_CHUNK_BYTES:
        raise InvalidArgumentError(f"chunk_bytes must be 1 to {signing.MAX_CHUNK_BYTES}. "
                                   f"Received: {chunk_bytes}")
    total, digest = describe(archive)
    count = signing.chunk_count(total, chunk_bytes)
    if total > signing.MAX_JOB_BYTES or count > signing.MAX_CHUNKS:
        raise InvalidArgumentError(
            f"the job for task {task} is {total} bytes in {count} chunks of {chunk_bytes}; a "
            f"task takes at most {signing.MAX_JOB_BYTES} bytes in {signing.MAX_CHUNKS} "
            "chunks (ship fewer rows per task, or use a dataset the tasks read themselves)")
    archive.seek(0)
    for index in range(count):
        data = _read_exactly(archive, min(chunk_bytes, total - index * chunk_bytes))
        part = JobPart(job_id, index, count, total, chunk_bytes, digest, data)
        yield signing.seal_chunk(secret, task, part, clock())


def _read_exactly(source: BinaryIO, size: int) -> bytes:
    data = source.read(size)
    if len(data) != size:
        raise InvalidArgumentError(f"the job archive changed while it was sent: read "
                                   f"{len(data)} bytes where {size} were left")
    return data


class Assembly:
    """The chunks of one job, written at their places in a private file as they come.

    Args:
        first: A verified chunk of the job: it gives the job id and the
            archive's size, chunk size, chunk count and sha256, which every
            later chunk must repeat.
        parent: Where the file's new private directory is made (None: the
            system's temporary directory).

    Example:
        >>> assembly = Assembly(parts[0], None)               # doctest: +SKIP
        >>> done = [assembly.add(p) for p in parts][-1]
        >>> JobDir.unpack(assembly.finish(), work)
        >>> assembly.close()
    """

    def __init__(self, first: JobPart, parent: pathlib.Path | None = None) -> None:
        self.job_id = first.job_id
        self.count, self.total = first.count, first.total
        self.chunk_bytes, self.sha256 = first.chunk_bytes, first.sha256
        self.directory = pathlib.Path(tempfile.mkdtemp(prefix="autodist-incoming-",
                                                       dir=parent))  # 0700
        self.path = self.directory / "job.tar"
        try:
            self._fd: int | None = os.open(
                self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600)
        except OSError:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        self._have = bytearray(self.count)   # at most signing.MAX_CHUNKS bytes
        self.received = 0
        self._digest = hashlib.sha256()
        self._hashed = 0   # chunks [0, _hashed) are in the running digest

    @property
    def complete(self) -> bool:
        return self.received == self.count

    def missing(self) -> list[int]:
        """The indices of the chunks not received yet."""
        return [i for i, have in enumerate(self._have) if not have]

    def add(self, part: JobPart) -> bool:
        """Keeps a verified chunk of this job; returns whether every chunk is here.

        Raises:
            JobRejectedError: the chunk is of another job, or describes
                another archive (size, chunk size, count or sha256) than the
                job's first chunk.
        """
        if part.job_id != self.job_id:
            raise JobRejectedError(f"chunk {part.index} is of job {part.job_id!r}, not of job "
                                   f"{self.job_id!r} being received", part.job_id)
        if (part.count, part.total, part.chunk_bytes, part.sha256) != \
                (self.count, self.total, self.chunk_bytes, self.sha256):
            raise JobRejectedError(
                f"chunk {part.index} of job {part.job_id!r} describes another archive "
                f"({part.total} bytes in {part.count} chunks of {part.chunk_bytes}, sha256 "
                f"{part.sha256[:16]}...) than its first chunk ({self.total} bytes in "
                f"{self.count} chunks of {self.chunk_bytes}, sha256 {self.sha256[:16]}...)",
                part.job_id)
        if self._have[part.index]:
            return self.complete   # sent again (the chief retried): kept already
        self._write(part.data, part.offset)
        self._have[part.index] = 1
        self.received += 1
        while self._hashed < self.count and self._have[self._hashed]:
            self._digest.update(part.data if self._hashed == part.index else
                                self._read(self._hashed))
            self._hashed += 1
        return self.complete

    def finish(self) -> pathlib.Path:
        """The job archive's file, once every chunk is here and the whole is checked.

        Raises:
            JobRejectedError: chunks are missing, or the file's size or sha256
                is not what the chunks named.
        """
        if not self.complete:
            missing = self.missing()
            raise JobRejectedError(f"job {self.job_id!r} misses {len(missing)} of its "
                                   f"{self.count} chunks: {missing[:10]}", self.job_id)
        size = os.fstat(self._fd).st_size
        digest = self._digest.hexdigest()
        if size != self.total or digest != self.sha256:
            raise JobRejectedError(
                f"the chunks of job {self.job_id!r} do not add up to its archive: {size} "
                f"bytes with sha256 {digest}, where the chunks named {self.total} bytes with "
                f"sha256 {self.sha256}", self.job_id)
        return self.path

    def close(self) -> None:
        """Drops what was received (the file and its directory)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        shutil.rmtree(self.directory, ignore_errors=True)

    def describe(self) -> str:
        return f"job {self.job_id!r}: {self.received} of {self.count} chunks ({self.total} bytes)"

    def _write(self, data: bytes | memoryview, offset: int) -> None:
        view = memoryview(data)
        while view:
            written = os.pwrite(self._fd, view, offset)
            view, offset = view[written:], offset + written

    def _read(self, index: int) -> bytes:
        offset = index * self.chunk_bytes
        size = min(self.chunk_bytes, self.total - offset)
        data = os.pread(self._fd, size, offset)
        while len(data) < size:   # a short read of a regular file: read on
            more = os.pread(self._fd, size - len(data), offset + len(data))
            if not more:
                break
            data += more
        return data


class Receiver:
    """What a serving task keeps of the job arriving: the chunks of at most one job.

    Args:
        parent: Where unfinished jobs are written (None: the system's
            temporary directory).

    Example:
        >>> receiver = Receiver(None)                         # doctest: +SKIP
        >>> archive = receiver.add(signing.unseal_part(message, secret, task, now))
        >>> if archive is not None: JobDir.unpack(archive, work); receiver.discard()
    """

    def __init__(self, parent: pathlib.Path | None = None) -> None:
        self.parent = parent
        self.current: Assembly | None = None

    def add(self, part: JobPart) -> pathlib.Path | None:
        """Keeps a verified chunk; the job archive's file once its job is complete.

        A chunk of another job than the unfinished one drops that one (logged).

        Raises:
            JobRejectedError: the chunk does not fit its job's other chunks, or
                the complete job is not the archive its chunks named; the
                job's chunks are dropped.
        """
        if self.current is not None and self.current.job_id != part.job_id:
            logger.warning("dropped the unfinished %s: a chunk of job %r arrived",
                           self.current.describe(), part.job_id)
            self.discard()
        if self.current is None:
            self.current = Assembly(part, self.parent)
        try:
            if not self.current.add(part):
                return None
            return self.current.finish()
        except BaseException:
            self.discard()
            raise

    def discard(self, job_id: str | None = None) -> None:
        """Drops the unfinished (or finished, unpacked) job: any, or only job `job_id`'s."""
        if self.current is not None and job_id in (None, self.current.job_id):
            self.current.close()
            self.current = None

    def pending(self) -> str | None:
        """What is received of an unfinished job, or None."""
        return None if self.current is None else self.current.describe()
