"""The GPU suite (`scripts/gpu_check.sh` runs it): skipped where no GPU is usable.

Set here, before TensorFlow starts in the test process (the driver, which
builds the models and the Keras references) and inherited by the task
processes it starts:

* ``TF_FORCE_GPU_ALLOW_GROWTH``: the driver takes GPU memory as it needs it,
  so the task processes on the same GPUs find theirs.
* ``NVIDIA_TF32_OVERRIDE=0``: no TensorFloat-32 matmuls (on by default on
  Ampere and later), which differ from float32 by about 1e-3; the checks
  compare with Keras to 2e-5.
"""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")

from tests.gpu.helpers import usable_gpus


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items or usable_gpus():
        return
    skip = pytest.mark.skip(reason="no GPU that TensorFlow can use (run scripts/gpu_check.sh on "
                                   "a GPU machine)")
    for item in gpu_items:
        item.add_marker(skip)

