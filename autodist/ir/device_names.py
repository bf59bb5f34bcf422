"""Names of TensorFlow tasks and devices, and of tensors in a GraphDef, as values.

A task is ``/job:worker/task:1`` (``worker:1`` in short, as failures and the
CLI's ``--task`` name it); a device is a task and one of its devices,
``/job:worker/task:1/device:CPU:0``. Strategies and resource specs hold them
as strings (the protobuf schema); code that reads or rewrites one parses it
here instead of cutting the string.

A tensor of a GraphDef is ``op:index`` and a node's input ``op:index``,
``op`` or ``^op`` (a control input): `op_name` and `input_op` give the op.
"""
from __future__ import annotations

import dataclasses
import re

from autodist.ir.errors import AutodistError, short_repr

_TASK = re.compile(r"/job:([A-Za-z_][\w-]*)/task:(\d+)")
_DEVICE = re.compile(_TASK.pattern + r"/device:([A-Za-z_]+):(\d+)")
_SHORT_TASK = re.compile(r"([A-Za-z_][\w-]*):(\d+)")


class DeviceNameError(AutodistError, ValueError):
    """A task or device name that does not parse."""


@dataclasses.dataclass(frozen=True, order=True)
class TaskName:
    """A TensorFlow task: its job and index, e.g. ``/job:worker/task:1``.

    Attributes:
        job: The job, e.g. "worker", "ps".
        index: The task's index in its job.
    """

    job: str
    index: int

    @classmethod
    def parse(cls, text: str) -> TaskName:
        """The task ``/job:<job>/task:<index>``.

        Raises:
            DeviceNameError: `text` is not a task name (a device name is not one
                either: see `DeviceName.parse`).
        """
        match = _TASK.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise DeviceNameError(f"a task name is /job:<job>/task:<index>, e.g. "
                                  f"/job:worker/task:1. Received: {short_repr(text)}")
        return cls(match.group(1), int(match.group(2)))

    @classmethod
    def parse_short(cls, text: str) -> TaskName:
        """The task ``<job>:<index>`` (as failures and ``--task`` name it), e.g. "worker:1".

        Raises:
            DeviceNameError: `text` is not ``<job>:<index>``.
        """
        match = _SHORT_TASK.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise DeviceNameError(f"a task is named <job>:<index>, e.g. worker:1. "
                                  f"Received: {short_repr(text)}")
        return cls(match.group(1), int(match.group(2)))

    @property
    def short(self) -> str:
        """``<job>:<index>``, e.g. "worker:1"."""
        return f"{self.job}:{self.index}"

    @property
    def device_prefix(self) -> str:
        """What the names of this task's devices start with: ``/job:<job>/task:<index>/``."""
        return f"{self}/"

    def device(self, kind: str, number: int) -> DeviceName:
        """The device ``<kind>:<number>`` of this task, e.g. `device("CPU", 0)`."""
        return DeviceName(self, kind, number)

    def with_index(self, index: int) -> TaskName:
        """The task of the same job with another index."""
        return TaskName(self.job, index)

    def __str__(self) -> str:
        return f"/job:{self.job}/task:{self.index}"


@dataclasses.dataclass(frozen=True, order=True)
class DeviceName:
    """A device of a task, e.g. ``/job:worker/task:1/device:CPU:0``.

    Attributes:
        task: The task holding the device.
        kind: "CPU" or "GPU".
        number: The device's number on its task.
    """

    task: TaskName
    kind: str
    number: int

    @classmethod
    def parse(cls, text: str) -> DeviceName:
        """The device ``/job:<job>/task:<index>/device:<kind>:<number>``.

        Raises:
            DeviceNameError: `text` is not such a device name.
        """
        match = _DEVICE.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise DeviceNameError(
                "a device name is /job:<job>/task:<index>/device:<kind>:<number>, e.g. "
                f"/job:worker/task:1/device:CPU:0. Received: {short_repr(text)}")
        return cls(TaskName(match.group(1), int(match.group(2))), match.group(3),
                   int(match.group(4)))

    @property
    def job(self) -> str:
        """The job of the device's task."""
        return self.task.job

    @property
    def index(self) -> int:
        """The index of the device's task in its job."""
        return self.task.index

    @property
    def short(self) -> str:
        """``<job>:<index> <kind>:<number>``, e.g. "worker:0 CPU:0"."""
        return f"{self.task.short} {self.kind}:{self.number}"

    def on_task(self, task: TaskName) -> DeviceName:
        """The same device on another task."""
        return DeviceName(task, self.kind, self.number)

    def __str__(self) -> str:
        return f"{self.task}/device:{self.kind}:{self.number}"


def op_name(tensor_name: str) -> str:
    """The op of a tensor or of a node's data input: "dense/MatMul:0" -> "dense/MatMul".

    A name without an output index is the op itself.
    """
    return tensor_name.split(":", 1)[0]


def input_op(node_input: str) -> str:
    """The op a node's input reads, data or control: "^init" and "init:1" -> "init"."""
    return op_name(node_input.lstrip("^"))
