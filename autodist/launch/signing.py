"""Signed jobs: a multi-host task runs only jobs from a holder of the cluster's secret.

A job is code: its GraphItem may hold any TensorFlow op, and a task runs it
with the task's files and credentials. So the chief signs each job it ships
with a secret shared by every host (a file, as Kubernetes mounts secrets, or
an environment variable), and `autodist serve` verifies the signature before
it unpacks anything; a job that fails is rejected, logged, and the task goes
on waiting for the next one.

A job travels as signed messages of one of two formats, named by their
first 8 bytes:

    MAGIC (8 bytes) | tag (32 bytes) | header length (4 bytes, big-endian) | header | body

* Format v1 (``b"ADJOB\\x00v1"``, `seal` / `unseal`): the whole job archive in one
  message (what autodist sent before jobs were chunked; still read, so a
  task takes a job from an older chief).
* Format v2 (``b"ADJOB\\x00v2"``, `seal_chunk`; what a chief sends): one chunk of
  the archive per message (`autodist.launch.chunks`), so no message nears
  TensorFlow's 2 GiB limit on a string tensor. Its header also holds the
  chunk's index, the chunk count, the archive's total size, the chunk size
  and the archive's sha256; every chunk is verified on its own before the
  task keeps it, and the whole is checked (size and sha256) before it is
  unpacked.

`unseal_part` reads both, as a `JobPart`; a message of another format is
rejected naming its version. The header is JSON: the job id, the task it is
for ("worker:1") and when it was sealed (Unix seconds), and in v2 the chunk
fields. The tag is HMAC-SHA256 under the secret over everything but itself
(the magic, the header length, the header and the body). A message is
accepted only for its own task and within `MAX_AGE_S` of the receiver's
clock, so a captured job cannot be sent to another task, or replayed after
that window (within it, a replay runs the same job again). A chief without
a secret sends an all-zero tag: only a task serving with ``--insecure``
accepts that. Before its tag is verified nothing of a message is parsed
but the fixed-size prefix; its claimed job id is read with a bounded pattern
only to address the rejection receipt.

What this does not do: TensorFlow's servers authenticate nobody, so a peer
that reaches a task's port can still run TensorFlow ops there directly
(read and write files), without a job. The secret keeps the task's own job
loop from running anyone else's job; only the network keeps peers away from
the ports. Run multi-host clusters on trusted networks only.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import re
import struct

from autodist.ir.errors import AutodistError

SECRET_ENV = "AUTODIST_SECRET"
SECRET_FILE_ENV = "AUTODIST_SECRET_FILE"
MIN_SECRET_BYTES = 16
MAX_AGE_S = 600.0
MAGIC = b"ADJOB\x00v1"        # format v1: a whole job in one message
CHUNK_MAGIC = b"ADJOB\x00v2"  # format v2: one chunk of a job per message
_MAGIC_PREFIX = b"ADJOB\x00v"
FORMATS = {MAGIC: 1, CHUNK_MAGIC: 2}
# What a task accepts of a chunked job (checked before anything is kept): the archive's
# size, the chunk size and the number of chunks.
MAX_JOB_BYTES = 1 << 40            # 1 TiB
MAX_CHUNK_BYTES = 1 << 30          # 1 GiB, well under TensorFlow's 2 GiB per message
MAX_CHUNKS = 1 << 20
_TAG_BYTES = 32
_UNSIGNED = bytes(_TAG_BYTES)
_MAX_HEADER_BYTES = 4096
_LENGTH = struct.Struct(">I")


class SecretError(AutodistError, ValueError):
    """The shared secret cannot be read or is too short."""


class JobRejectedError(AutodistError, PermissionError):
    """A job message failed verification: unsigned, a wrong tag, another task's, too old.

    Attributes:
        reason: What was wrong (never secret material).
        job_id: The job id the message claimed ("" if unreadable).
    """

    def __init__(self, reason: str, job_id: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.job_id = job_id


@dataclasses.dataclass(frozen=True)
class JobPart:
    """One chunk of a job archive, as a message carries it.

    Attributes:
        job_id: The job's id.
        index: The chunk's position (0-based).
        count: How many chunks the archive is cut into.
        total: The archive's size in bytes.
        chunk_bytes: The size of every chunk but the last (which holds the rest).
        sha256: The whole archive's sha256 (hex).
        data: The chunk's bytes.
        version: The message format it came in (1: a whole job, 2: a chunk).
    """

    job_id: str
    index: int
    count: int
    total: int
    chunk_bytes: int
    sha256: str
    data: bytes | memoryview
    version: int = 2

    @classmethod
    def whole(cls, job_id: str, archive: bytes | memoryview, version: int = 2) -> JobPart:
        """A job archive as a single chunk."""
        return cls(job_id, 0, 1, len(archive), max(len(archive), 1),
                   hashlib.sha256(archive).hexdigest(), archive, version)

    @property
    def offset(self) -> int:
        """Where the chunk's bytes start in the archive."""
        return self.index * self.chunk_bytes


def chunk_count(total: int, chunk_bytes: int) -> int:
    """How many chunks of `chunk_bytes` hold `total` bytes (an empty archive: one, empty)."""
    return max(1, -(-total // chunk_bytes))


def load_secret(secret_file: str | None = None) -> bytes | None:
    """The cluster's shared secret, or None when none is given.

    From `secret_file`, else the file named by ``AUTODIST_SECRET_FILE``, else
    the value of ``AUTODIST_SECRET``. Surrounding whitespace (a file's final
    newline) is dropped.

    Raises:
        SecretError: the file cannot be read, or the secret is shorter than
            `MIN_SECRET_BYTES` (naming where it came from, never its value).
    """
    path = secret_file or os.environ.get(SECRET_FILE_ENV)
    if path:
        source = f"secret file {path!r}"
        try:
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as e:
            raise SecretError(f"cannot read the {source}: {e.strerror}") from e
    elif os.environ.get(SECRET_ENV) is not None:
        source = f"environment variable {SECRET_ENV}"
        secret = os.environ[SECRET_ENV].encode().strip()
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(f"the {source} holds a secret of {len(secret)} bytes; use at least "
                          f"{MIN_SECRET_BYTES} random bytes (e.g. `head -c 32 /dev/urandom | "
                          "base64`)")
    return secret


def seal(secret: bytes | None, job_id: str, task: str, archive: bytes, now: float) -> bytes:
    """The format-v1 job message for `task` ("job:index"): header, tag and the whole archive.

    A chief sends format v2 (`seal_chunk`); v1 is what older chiefs send, and
    what a task still reads.

    Args:
        secret: The shared secret; None sends the job unsigned.
        job_id: The job's id.
        task: The task the job is for.
        archive: The job archive (`JobDir.pack`).
        now: The time it is sealed (Unix seconds).
    """
    return _seal(MAGIC, secret, {"job_id": job_id, "task": task, "sealed_at": now}, archive)


def seal_chunk(secret: bytes | None, task: str, part: JobPart, now: float) -> bytes:
    """The format-v2 message of one chunk of a job for `task` ("job:index").

    The tag covers the job id, the task, the time, the chunk's index, the
    chunk count, the archive's total size, the chunk size, the archive's
    sha256 and the chunk's bytes.

    Args:
        secret: The shared secret; None sends the chunk unsigned.
        task: The task the job is for.
        part: The chunk (`autodist.launch.chunks.sealed_chunks` cuts them).
        now: The time it is sealed (Unix seconds).
    """
    fields = {"job_id": part.job_id, "task": task, "sealed_at": now, "index": part.index,
              "count": part.count, "total": part.total, "chunk_bytes": part.chunk_bytes,
              "sha256": part.sha256}
    return _seal(CHUNK_MAGIC, secret, fields, part.data)


def _seal(magic: bytes, secret: bytes | None, fields: dict, body: bytes | memoryview) -> bytes:
    header = json.dumps(fields, sort_keys=True).encode()
    length = _LENGTH.pack(len(header))
    tag = _tag(secret, magic, length, header, body) if secret is not None else _UNSIGNED
    return b"".join((magic, tag, length, header, body))


def unseal(message: bytes, secret: bytes | None, task: str, now: float) -> tuple[str, bytes]:
    """(job id, archive) of a format-v1 job message for `task`, verified before anything is read.

    Args:
        message: What arrived in the task's job box.
        secret: The shared secret; None (``--insecure``) accepts unsigned
            and signed jobs without checking the tag.
        task: This task ("job:index").
        now: The receiver's clock (Unix seconds).

    Raises:
        JobRejectedError: saying what was wrong.
    """
    claimed, _, archive = _open(MAGIC, message, secret, task, now)
    return claimed, bytes(archive)


def unseal_part(message: bytes, secret: bytes | None, task: str, now: float) -> JobPart:
    """The job chunk a message for `task` carries (format v1: the whole job as one chunk).

    The tag is verified before anything of the message is parsed; then the
    header's task and time, and in format v2 its chunk fields: the archive at
    most `MAX_JOB_BYTES`, the chunk size at most `MAX_CHUNK_BYTES`, at most
    `MAX_CHUNKS` chunks, the index among them and the chunk's length what
    its index says.

    Args:
        message: What arrived in the task's job box.
        secret: The shared secret; None (``--insecure``) accepts unsigned
            and signed messages without checking the tag.
        task: This task ("job:index").
        now: The receiver's clock (Unix seconds).

    Raises:
        JobRejectedError: saying what was wrong (a message of a format this
            autodist does not read names its version).
    """
    view = memoryview(message)
    magic = bytes(view[:len(MAGIC)])
    if magic == MAGIC:
        claimed, _, archive = _open(MAGIC, message, secret, task, now)
        return JobPart.whole(claimed, archive, version=1)
    if magic != CHUNK_MAGIC and magic.startswith(_MAGIC_PREFIX) and len(magic) == len(MAGIC):
        version = magic[len(_MAGIC_PREFIX):].decode("ascii", "backslashreplace")
        raise JobRejectedError(f"job message format v{version!s:.8} is not one this autodist "
                               "reads (v1, v2): is the chief's autodist newer than this "
                               "task's?")
    claimed, fields, data = _open(CHUNK_MAGIC, message, secret, task, now)
    return _chunk(fields, data, claimed)


def _open(magic: bytes, message: bytes, secret: bytes | None, task: str,
          now: float) -> tuple[str, dict, memoryview]:
    """(claimed job id, header fields, body) of a message of format `magic`, verified."""
    prefix = len(magic) + _TAG_BYTES + _LENGTH.size
    view = memoryview(message)
    if len(view) < prefix or view[:len(magic)] != magic:
        raise JobRejectedError(f"not a job message ({len(view)} bytes without the autodist "
                               "job header)")
    tag = bytes(view[len(magic):len(magic) + _TAG_BYTES])
    length = view[len(magic) + _TAG_BYTES:prefix]
    (size,) = _LENGTH.unpack(length)
    if size > _MAX_HEADER_BYTES or prefix + size > len(view):
        raise JobRejectedError(f"malformed job header (length {size})")
    header = bytes(view[prefix:prefix + size])
    body = view[prefix + size:]
    claimed = _claimed_job_id(header)
    if secret is not None:
        if tag == _UNSIGNED:
            raise JobRejectedError("the job is unsigned: the chief has no secret (give it "
                                   f"the cluster's secret: secret_file=, {SECRET_FILE_ENV} or "
                                   f"{SECRET_ENV})", claimed)
        if not hmac.compare_digest(tag, _tag(secret, magic, length, header, body)):
            raise JobRejectedError("bad signature: the job was not signed with this task's "
                                   "secret (or was changed on the way)", claimed)
    fields = _read_header(header, claimed)
    for_task, sealed_at = fields["task"], fields["sealed_at"]
    if for_task != task:
        raise JobRejectedError(f"the job is for task {for_task[:64]!r}, not this task "
                               f"{task!r}", claimed)
    age = now - sealed_at
    if abs(age) > MAX_AGE_S:
        raise JobRejectedError(f"the job was sealed {age:+.0f}s from this host's clock; "
                               f"accepted within {MAX_AGE_S:.0f}s (are the hosts' clocks in "
                               "sync?)", claimed)
    return claimed, fields, body


def _tag(secret: bytes, magic: bytes, length, header, body) -> bytes:
    mac = hmac.new(secret, magic, hashlib.sha256)
    for part in (length, header, body):
        mac.update(part)
    return mac.digest()


def _read_header(header: bytes, claimed: str) -> dict:
    """The header's fields, its task a string and `sealed_at` a number; raises
    JobRejectedError if it is malformed."""
    try:
        fields = json.loads(header)
        task, sealed_at = fields["task"], float(fields["sealed_at"])
    except (ValueError, KeyError, TypeError, RecursionError, OverflowError) as e:
        raise JobRejectedError(f"malformed job header ({type(e).__name__})", claimed) from e
    if not isinstance(task, str) or sealed_at != sealed_at:  # NaN
        raise JobRejectedError("malformed job header (task or time)", claimed)
    return dict(fields, sealed_at=sealed_at)


_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_JOB_ID_TEXT = re.compile(r"[0-9A-Za-z_\-]{1,64}")


def _chunk(fields: dict, data: memoryview, claimed: str) -> JobPart:
    """The chunk a verified format-v2 header and body describe; raises JobRejectedError
    for a field of the wrong type or out of bounds, or a body of another length."""
    job_id = fields.get("job_id")
    if not isinstance(job_id, str) or not _JOB_ID_TEXT.fullmatch(job_id) or job_id != claimed:
        raise JobRejectedError(f"malformed chunk header: job_id must be 1 to 64 letters, "
                               f"digits, '-' or '_'. Received: {str(job_id)[:80]!r}", claimed)
    numbers = {}
    for key in ("index", "count", "total", "chunk_bytes"):
        value = fields.get(key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise JobRejectedError(f"malformed chunk header: {key} must be an integer. "
                                   f"Received: {str(value)[:64]!r}", claimed)
        numbers[key] = value
    index, count, total, chunk_bytes = (numbers[k] for k in ("index", "count", "total",
                                                             "chunk_bytes"))
    digest = fields.get("sha256")
    if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest):
        raise JobRejectedError(f"malformed chunk header: sha256 must be 64 hex digits. "
                               f"Received: {str(digest)[:80]!r}", claimed)
    if not 0 <= total <= MAX_JOB_BYTES:
        raise JobRejectedError(f"the job claims an archive of {total} bytes; a task takes at "
                               f"most {MAX_JOB_BYTES} (MAX_JOB_BYTES)", claimed)
    if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise JobRejectedError(f"the job claims chunks of {chunk_bytes} bytes; a task takes "
                               f"1 to {MAX_CHUNK_BYTES} (MAX_CHUNK_BYTES)", claimed)
    expected = chunk_count(total, chunk_bytes)
    if count != expected or count > MAX_CHUNKS:
        raise JobRejectedError(f"the job claims {count} chunks for {total} bytes in chunks of "
                               f"{chunk_bytes} ({expected} chunks); a task takes at most "
                               f"{MAX_CHUNKS} (MAX_CHUNKS)", claimed)
    if not 0 <= index < count:
        raise JobRejectedError(f"chunk index {index} is not among the job's {count} chunks",
                               claimed)
    length = min(chunk_bytes, total - index * chunk_bytes)
    if len(data) != length:
        raise JobRejectedError(f"chunk {index} of {count} holds {len(data)} bytes; its index "
                               f"says {length}", claimed)
    return JobPart(claimed, index, count, total, chunk_bytes, digest, data)


# The job id as `seal` and `seal_chunk` write it (sorted keys, JSON): read without parsing
# the header, which may come from anyone and is parsed only once its tag is verified.
_JOB_ID = re.compile(rb'"job_id": "([0-9A-Za-z_\-]{1,64})"')


def _claimed_job_id(header: bytes) -> str:
    """The job id a header claims ("" if there is none; not verified, not parsed)."""
    match = _JOB_ID.search(header)
    return match.group(1).decode() if match else ""
