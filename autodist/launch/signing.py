"""Signed jobs: a multi-host task runs only jobs from a holder of the cluster's secret.

A job is code: its GraphItem may hold any TensorFlow op, and a task runs it
with the task's files and credentials. So the chief signs each job it ships
with a secret shared by every host (a file, as Kubernetes mounts secrets, or
an environment variable), and `autodist serve` verifies the signature before
it unpacks anything; a job that fails is rejected, logged, and the task goes
on waiting for the next one.

The signed message (`seal` / `unseal`):

    MAGIC (8 bytes) | tag (32 bytes) | header length (4 bytes, big-endian) | header | archive

The header is JSON: the job id, the task it is for ("worker:1") and when it
was sealed (Unix seconds). The tag is HMAC-SHA256 under the secret over
everything but itself. A job is accepted only for its own task and within
`MAX_AGE_S` of the receiver's clock, so a captured job cannot be sent to
another task, or replayed after that window (within it, a replay runs the
same job again). A chief without a secret sends an all-zero tag: only a task
serving with ``--insecure`` accepts that.

What this does not do: TensorFlow's servers authenticate nobody, so a peer
that reaches a task's port can still run TensorFlow ops there directly
(read and write files), without a job. The secret keeps the task's own job
loop from running anyone else's job; only the network keeps peers away from
the ports. Run multi-host clusters on trusted networks only.
"""
from __future__ import annotations

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
MAGIC = b"ADJOB\x00v1"
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
    """The job message for `task` ("job:index"): header, tag and archive.

    Args:
        secret: The shared secret; None sends the job unsigned.
        job_id: The job's id.
        task: The task the job is for.
        archive: The job archive (`JobDir.pack`).
        now: The time it is sealed (Unix seconds).
    """
    header = json.dumps({"job_id": job_id, "task": task, "sealed_at": now},
                        sort_keys=True).encode()
    length = _LENGTH.pack(len(header))
    tag = _tag(secret, length, header, archive) if secret is not None else _UNSIGNED
    return b"".join((MAGIC, tag, length, header, archive))


def unseal(message: bytes, secret: bytes | None, task: str, now: float) -> tuple[str, bytes]:
    """(job id, archive) of a job message for `task`, verified before anything is read.

    Args:
        message: What arrived in the task's job box.
        secret: The shared secret; None (``--insecure``) accepts unsigned
            and signed jobs without checking the tag.
        task: This task ("job:index").
        now: The receiver's clock (Unix seconds).

    Raises:
        JobRejectedError: saying what was wrong.
    """
    prefix = len(MAGIC) + _TAG_BYTES + _LENGTH.size
    view = memoryview(message)
    if len(view) < prefix or view[:len(MAGIC)] != MAGIC:
        raise JobRejectedError(f"not a job message ({len(view)} bytes without the autodist "
                               "job header)")
    tag = bytes(view[len(MAGIC):len(MAGIC) + _TAG_BYTES])
    length = view[len(MAGIC) + _TAG_BYTES:prefix]
    (size,) = _LENGTH.unpack(length)
    if size > _MAX_HEADER_BYTES or prefix + size > len(view):
        raise JobRejectedError(f"malformed job header (length {size})")
    header = bytes(view[prefix:prefix + size])
    archive = view[prefix + size:]
    claimed = _claimed_job_id(header)
    if secret is not None:
        if tag == _UNSIGNED:
            raise JobRejectedError("the job is unsigned: the chief has no secret (give it "
                                   f"the cluster's secret: secret_file=, {SECRET_FILE_ENV} or "
                                   f"{SECRET_ENV})", claimed)
        if not hmac.compare_digest(tag, _tag(secret, length, header, archive)):
            raise JobRejectedError("bad signature: the job was not signed with this task's "
                                   "secret (or was changed on the way)", claimed)
    for_task, sealed_at = _read_header(header, claimed)
    if for_task != task:
        raise JobRejectedError(f"the job is for task {for_task[:64]!r}, not this task "
                               f"{task!r}", claimed)
    age = now - sealed_at
    if abs(age) > MAX_AGE_S:
        raise JobRejectedError(f"the job was sealed {age:+.0f}s from this host's clock; "
                               f"accepted within {MAX_AGE_S:.0f}s (are the hosts' clocks in "
                               "sync?)", claimed)
    return claimed, bytes(archive)


def _tag(secret: bytes, length, header, archive) -> bytes:
    mac = hmac.new(secret, MAGIC, hashlib.sha256)
    for part in (length, header, archive):
        mac.update(part)
    return mac.digest()


def _read_header(header: bytes, claimed: str) -> tuple[str, float]:
    """(task, sealed_at) of a header; raises JobRejectedError if it is malformed."""
    try:
        fields = json.loads(header)
        task, sealed_at = fields["task"], float(fields["sealed_at"])
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise JobRejectedError(f"malformed job header ({type(e).__name__})", claimed) from e
    if not isinstance(task, str) or sealed_at != sealed_at:  # NaN
        raise JobRejectedError("malformed job header (task or time)", claimed)
    return task, sealed_at


# The job id as `seal` writes it (sorted keys, JSON): read without parsing the header,
# which may come from anyone and is parsed only once its tag is verified.
_JOB_ID = re.compile(rb'"job_id": "([0-9A-Za-z_\-]{1,64})"')


def _claimed_job_id(header: bytes) -> str:
    """The job id a header claims ("" if there is none; not verified, not parsed)."""
    match = _JOB_ID.search(header)
    return match.group(1).decode() if match else ""
