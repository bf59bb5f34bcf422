"""Which GPUs this host shows a process, found without starting CUDA.

A node's ``gpus`` in a `ResourceSpec` are positions among the GPUs its host
shows: those listed in ``CUDA_VISIBLE_DEVICES`` when it is set, else every
GPU ``nvidia-smi -L`` lists. A task process is given only its node's GPUs
(its own ``CUDA_VISIBLE_DEVICES``, see `autodist.launch.devices`), so inside
it they are ``GPU:0`` .. ``GPU:n-1``.

Detection runs ``nvidia-smi -L`` (bounded by a timeout) rather than asking
TensorFlow: listing devices through TensorFlow initializes CUDA in the
calling process (the user's script, which also builds the model), and a
subprocess that imports TensorFlow takes seconds. The price: a GPU host with
a CPU-only TensorFlow build is reported with its GPUs (pass
``gpus_per_worker=0`` there); the task process then fails with a message
naming the GPUs it expected and those TensorFlow shows it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Mapping

NVIDIA_SMI_TIMEOUT_S = 10.0


def visible_gpus(environ: Mapping[str, str] | None = None,
                 timeout_s: float = NVIDIA_SMI_TIMEOUT_S) -> list[str]:
    """The GPUs a process on this host can use, as CUDA names them.

    Args:
        environ: The environment to read ``CUDA_VISIBLE_DEVICES`` from
            (default: this process's).
        timeout_s: Bound on ``nvidia-smi -L``.

    Returns:
        The entries of ``CUDA_VISIBLE_DEVICES`` when it is set (up to an
        invalid ``-1``, as CUDA reads it; empty: no GPU), else ``"0"`` ..
        ``"K-1"`` for the K GPUs ``nvidia-smi -L`` lists; [] when it is
        absent, fails or times out.
    """
    environ = os.environ if environ is None else environ
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        out = []
        for entry in (e.strip() for e in listed.split(",")):
            if not entry or entry.startswith("-"):
                break
            out.append(entry)
        return out
    return [str(i) for i in range(_nvidia_smi_count(timeout_s))]


def _nvidia_smi_count(timeout_s: float) -> int:
    """GPUs that ``nvidia-smi -L`` lists (lines "GPU i: ..."); 0 without it."""
    command = shutil.which("nvidia-smi")
    if command is None:
        return 0
    try:
        done = subprocess.run([command, "-L"], capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if done.returncode != 0:
        return 0
    return sum(1 for line in done.stdout.splitlines() if line.startswith("GPU "))
