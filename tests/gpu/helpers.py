"""What the GPU suite needs to know about this host."""
from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=None)
def usable_gpus() -> int:
    """GPUs TensorFlow shows this process; 0 without a CUDA build.

    TensorFlow is not imported on a host that shows no GPU at all.
    """
    from autodist.ir.gpus import visible_gpus

    if not visible_gpus():
        return 0
    import tensorflow as tf

    if not tf.test.is_built_with_cuda():
        return 0
    return len(tf.config.list_physical_devices("GPU"))


def needs_gpus(count: int):
    """Skips a test unless this host has `count` usable GPUs."""
    return pytest.mark.skipif(usable_gpus() < count,
                              reason=f"needs {count} GPUs; this host has {usable_gpus()}")
