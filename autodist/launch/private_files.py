"""Files only this user can reach: directories 0700, files 0600, never through a link.

A job directory holds the model's graph, its weights and the training data,
and what a task reads from it is what it runs. So every directory autodist
makes for a job is 0700 and every file it writes there 0600. A file is
written under a new random temporary name opened with
``O_CREAT | O_EXCL | O_NOFOLLOW`` (a link or file planted at that name makes
the write fail instead of being followed) and renamed into place, so a
reader sees the old file or the new one, never half of one.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
import stat
from typing import BinaryIO, Iterator

from autodist.ir.atomic import create_exclusive
from autodist.ir.errors import AutodistError

DIR_MODE = 0o700
FILE_MODE = 0o600
_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


class PrivateDirError(AutodistError, PermissionError):
    """A directory given for job files could be read or changed by other users.

    Attributes:
        path: The directory.
    """

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


def make_private_dir(path: str | os.PathLike) -> pathlib.Path:
    """Creates `path` (and missing parents) with mode 0700, or checks an existing one.

    An existing directory must belong to this user and be closed to group
    and others (a directory others can write into lets them plant files or
    links that autodist would read); it is refused, not changed.

    Raises:
        PrivateDirError: naming the directory, its owner or mode, and what to do.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=DIR_MODE)
        return path
    except FileExistsError:
        pass
    info = os.stat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise PrivateDirError(f"job directory {str(path)!r} exists and is not a directory",
                              str(path))
    if info.st_uid != os.geteuid():
        raise PrivateDirError(
            f"job directory {str(path)!r} belongs to uid {info.st_uid}, not to this user "
            f"(uid {os.geteuid()}); give a path that does not exist yet (autodist creates "
            "it with mode 0700)", str(path))
    if info.st_mode & 0o077:
        raise PrivateDirError(
            f"job directory {str(path)!r} has mode {stat.S_IMODE(info.st_mode):04o}: other "
            "users could read the job or plant files in it. `chmod 700` it, or give a path "
            "that does not exist yet (autodist creates it with mode 0700)", str(path))
    return path


@contextlib.contextmanager
def private_writer(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A file object whose contents replace `path` (mode 0600) when the block ends.

    Written under a new random name beside `path`, created with
    ``O_EXCL | O_NOFOLLOW``, then renamed over `path`; removed if the block
    raises. Not synced to disk: job files are read by processes, not after a
    crash.
    """
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = create_exclusive(tmp, FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_private(path: str | os.PathLike, data: bytes) -> None:
    """Replaces `path` with `data` (mode 0600), atomically (see `private_writer`)."""
    with private_writer(path) as f:
        f.write(data)


def open_private_append(path: str | os.PathLike) -> BinaryIO:
    """`path` opened for appending, created 0600 if missing; a link there is refused.

    Raises:
        OSError: `path` is a symbolic link (ELOOP), or cannot be opened.
    """
    return os.fdopen(os.open(path, _APPEND, FILE_MODE), "ab")
