"""Durable, atomic file writes: a reader sees the old file or the new one, never half.

The data goes to a fresh temporary file beside the target, created with
``O_CREAT | O_EXCL | O_NOFOLLOW`` under an unpredictable name (so a file or
symbolic link planted there is never written through), is fsynced, renamed
over the target, and the directory is fsynced so the rename survives a crash.
"""
from __future__ import annotations

import errno
import os
import pathlib
import secrets
import stat

# Mode of files and directories only their owner may read (job and checkpoint files).
PRIVATE_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700


class NotRegularFileError(OSError):
    """A path that is not a regular file (a FIFO, a device, a directory)."""


def read_regular(path: str | os.PathLike, limit: int) -> bytes:
    """Up to `limit` bytes of a regular file, opened without blocking.

    A FIFO or a device in the file's place would block a plain open or read
    forever; the type is checked on the opened descriptor, so nothing can
    be swapped in between the check and the read.

    Raises:
        FileNotFoundError: nothing is at `path`.
        NotRegularFileError: something other than a regular file is.
        OSError: it cannot be read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFileError(f"{str(path)!r} is not a regular file")
        with os.fdopen(fd, "rb") as f:
            fd = -1
            return f.read(limit)
    finally:
        if fd >= 0:
            os.close(fd)


def create_exclusive(path: str | os.PathLike, mode: int = PRIVATE_FILE_MODE) -> int:
    """Opens a new file for writing; fails if anything (a link included) is at `path`."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                   mode)


def write_all(fd: int, data: bytes) -> None:
    """Writes all of `data` to `fd`, continuing after short writes."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def fsync_path(path: str | os.PathLike) -> None:
    """fsyncs a file or a directory (a directory: so entries created in it survive a crash)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(path: str | os.PathLike) -> None:
    """fsyncs a directory, where its filesystem can (some cannot fsync directories)."""
    try:
        fsync_path(path)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise


def make_owner_dir(path: str | os.PathLike) -> pathlib.Path:
    """Creates `path` (and missing parents) with the new leaf only its owner may open.

    An existing directory is left as it is (`launch.private_files.make_private_dir`
    also refuses one others can reach).
    """
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    return path


def _inherited_mode(path: pathlib.Path) -> int | None:
    """A replaced file keeps its mode; a new one in a private directory is private.

    None: a new file in a shared directory, created as `open` would (0o666 less
    the umask).
    """
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        pass
    try:
        parent = stat.S_IMODE(os.stat(path.parent).st_mode)
    except FileNotFoundError:
        return None
    return PRIVATE_FILE_MODE if not parent & 0o077 else None


def atomic_write(path: str | os.PathLike, data: bytes, *, mode: int | None = None) -> None:
    """Replaces `path` by `data` atomically and durably.

    Args:
        path: The file.
        data: Its new content.
        mode: Permission bits of the file. Default: an existing file's; for a
            new file 0o600 in a directory only its owner may open, else 0o666
            less the umask (as `open` creates files).
    """
    path = pathlib.Path(path)
    if mode is None:
        mode = _inherited_mode(path)
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(8)}")
    fd = create_exclusive(tmp, 0o666 if mode is None else mode)
    try:
        try:
            write_all(fd, data)
            if mode is not None:
                os.fchmod(fd, mode)   # exactly `mode`, whatever the umask
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)
