"""Task and device names as values, and the op of a tensor name."""
from __future__ import annotations

import pytest

from autodist.ir.device_names import (DeviceName, DeviceNameError, TaskName, input_op,
                                      op_name)
from autodist.ir.errors import AutodistError


def test_task_parses_formats_and_round_trips():
    task = TaskName.parse("/job:worker/task:12")
    assert (task.job, task.index) == ("worker", 12)
    assert str(task) == "/job:worker/task:12"
    assert task.short == "worker:12"
    assert task.device_prefix == "/job:worker/task:12/"
    assert TaskName.parse_short("ps:3") == TaskName("ps", 3)
    assert task.with_index(2) == TaskName("worker", 2)
    assert sorted([TaskName("worker", 2), TaskName("worker", 10)])[0].index == 2


def test_device_parses_formats_and_round_trips():
    text = "/job:worker/task:1/device:GPU:3"
    device = DeviceName.parse(text)
    assert str(device) == text
    assert (device.job, device.index, device.kind, device.number) == ("worker", 1, "GPU", 3)
    assert device.task == TaskName("worker", 1)
    assert device.short == "worker:1 GPU:3"
    assert str(device.on_task(TaskName("ps", 0))) == "/job:ps/task:0/device:GPU:3"
    assert TaskName("worker", 0).device("CPU", 1) == \
        DeviceName.parse("/job:worker/task:0/device:CPU:1")
    assert DeviceName.parse(text) == device and hash(DeviceName.parse(text)) == hash(device)


@pytest.mark.parametrize("text", ["", "worker:1", "/job:worker", "/job:worker/task:x",
                                  "/job:worker/task:1/device:CPU:0", "/job:/task:1",
                                  "/job:worker/task:-1", " /job:worker/task:1"])
def test_bad_task_names_are_refused_naming_what_was_received(text):
    with pytest.raises(DeviceNameError, match=r"/job:<job>/task:<index>.*Received: ") as info:
        TaskName.parse(text)
    assert repr(text) in str(info.value)
    assert isinstance(info.value, AutodistError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("text", ["", "worker", "worker:", ":1", "worker:1:2", "worker:one",
                                  "/job:worker/task:1"])
def test_bad_short_task_names_are_refused(text):
    with pytest.raises(DeviceNameError, match=r"<job>:<index>.*Received: "):
        TaskName.parse_short(text)


@pytest.mark.parametrize("text", ["/job:worker/task:1", "/job:worker/task:1/device:CPU",
                                  "/job:worker/task:1/device:CPU:0/", "/job:worker/replica:0/"
                                  "task:1/device:CPU:0", "job:worker/task:1/device:CPU:0"])
def test_bad_device_names_are_refused(text):
    with pytest.raises(DeviceNameError, match=r"device:<kind>:<number>.*Received: "):
        DeviceName.parse(text)


@pytest.mark.parametrize("value", [None, 3, b"/job:worker/task:1"])
def test_non_strings_are_refused_not_crashed_on(value):
    with pytest.raises(DeviceNameError):
        TaskName.parse(value)
    with pytest.raises(DeviceNameError):
        DeviceName.parse(value)


def test_a_huge_name_is_echoed_short():
    with pytest.raises(DeviceNameError) as info:
        DeviceName.parse("x" * 100_000)
    assert len(str(info.value)) < 500


def test_op_name_and_input_op():
    assert op_name("dense/MatMul:0") == "dense/MatMul"
    assert op_name("dense/MatMul") == "dense/MatMul"
    assert op_name("a:1:2") == "a"
    assert input_op("^init") == "init"
    assert input_op("split:1") == "split"
    assert input_op("x") == "x"
