"""Atomic file writes: a reader sees the old file or the new one, never half."""
from __future__ import annotations

import os
import pathlib


def atomic_write(path: str | os.PathLike, data: bytes) -> None:
    """Writes `data` to a temporary file beside `path`, syncs it, renames it."""
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
