"""Counting the GPUs a host shows, without CUDA: CUDA_VISIBLE_DEVICES, else nvidia-smi -L."""
from __future__ import annotations

import pytest

from autodist.ir.gpus import visible_gpus


@pytest.mark.parametrize("value,expected", [
    ("0,1", ["0", "1"]),
    ("3, 1", ["3", "1"]),
    ("", []),
    ("-1", []),
    ("2,-1,3", ["2"]),  # CUDA stops at an invalid entry
    ("GPU-8f1c,GPU-77aa", ["GPU-8f1c", "GPU-77aa"]),
])
def test_cuda_visible_devices_decides(value, expected):
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": value}) == expected


def _fake_nvidia_smi(tmp_path, script: str) -> dict[str, str]:
    tool = tmp_path / "nvidia-smi"
    tool.write_text("#!/bin/sh\n" + script)
    tool.chmod(0o755)
    return {"PATH": str(tmp_path)}


def test_nvidia_smi_lists_the_gpus(tmp_path, monkeypatch):
    env = _fake_nvidia_smi(tmp_path, 'echo "GPU 0: NVIDIA H200 (UUID: GPU-1)"\n'
                                     'echo "  MIG 1g.18gb Device 0: (UUID: MIG-2)"\n'
                                     'echo "GPU 1: NVIDIA H200 (UUID: GPU-3)"\n')
    monkeypatch.setenv("PATH", env["PATH"])
    assert visible_gpus({}) == ["0", "1"]


@pytest.mark.parametrize("script", ["exit 9\n", "exec sleep 5\n"])
def test_no_gpu_when_nvidia_smi_fails_or_hangs(tmp_path, monkeypatch, script):
    monkeypatch.setenv("PATH", _fake_nvidia_smi(tmp_path, script)["PATH"])
    assert visible_gpus({}, timeout_s=0.5) == []


def test_no_gpu_without_nvidia_smi(monkeypatch):
    monkeypatch.setenv("PATH", "")
    assert visible_gpus({}) == []
