"""Keras' step that finds a dataset's end, and what it changes though it trains nothing.

When `fit` reads a dataset of unknown length (or `steps_per_epoch` outlasts
it), an epoch ends when Keras' next step finds the pass at its end. By then
the TensorFlow backend's train function has run the parts of the step that
wait for no data: every seed generator has advanced by one step's draws
(Dropout's, an augmentation's), and the optimizer has counted one iteration
more. The next epoch draws its masks from those seeds, and Adam's bias
correction and learning-rate schedules read that count: a run that skipped
them trained other numbers from the second epoch on (a Dropout model 8% off
Keras' loss, with SGD too).

A run does the same after the last step of each such epoch: the seed
generators' copies on every task advance by what one step advances them
(`SeedAdvance`, measured on the task's first step), and the update count the
optimizer reads is the updates applied plus the run-outs before the step
(`RunOuts.before`, fed to the step; the variable counting updates stays a
count of steps, as recovery and resizing read it). The model gets Keras'
iteration count back.
"""
from __future__ import annotations

import bisect
import dataclasses
import re
from typing import Callable, Sequence

import numpy as np

from autodist.kernels import replicator
from autodist.runtime import initial_values
from autodist.runtime.worker_session import ProgramSession, WorkerError

# Keras' SeedGenerator keeps its state under this name (the capture suffixes a repeated
# path: "..._1").
_SEED_STATE = re.compile(r"seed_generator_state(_\d+)?")


@dataclasses.dataclass(frozen=True)
class RunOuts:
    """Which epochs of a run end with Keras' step finding the data's end.

    Attributes:
        runs_out: Per epoch, whether it ends so.
        starts: The first step of each epoch, then the run's end.
    """

    runs_out: tuple[bool, ...]
    starts: tuple[int, ...]

    @classmethod
    def of(cls, epochs_run_out: Sequence[bool],
           starts: Callable[[], Sequence[int]]) -> RunOuts | None:
        """The run's run-outs (`starts` gives the epochs' first steps); None where no epoch
        runs out (nothing to do)."""
        if not any(epochs_run_out):
            return None
        return cls(tuple(bool(r) for r in epochs_run_out), tuple(int(s) for s in starts()))

    def before(self, index: int) -> int:
        """Run-outs of the epochs that ended before step `index` (Keras' extra
        iterations by then)."""
        ended = bisect.bisect_right(self.starts[1:], index)
        return sum(self.runs_out[:ended])

    def ending_after(self, index: int) -> int:
        """Run-outs right after step `index` (its epoch's, where it is the last step,
        and an empty epoch's after it)."""
        return self.before(index + 1) - self.before(index)


class SeedAdvance:
    """Advances this task's copies of the model's seed generators as one step does.

    Args:
        task: The task's program and session.
        assign_state: Sets the task's state variables (built once per program).
    """

    def __init__(self, task: ProgramSession, assign_state: initial_values.StateAssign) -> None:
        self.task = task
        self.assign_state = assign_state
        program = task.program
        self.names = sorted(s.name for s in task.graph_item.state_variables
                            if _SEED_STATE.fullmatch(s.name.rsplit("/", 1)[-1]))
        first = program.replicas[0].virtual_nodes[0].index
        with program.graph.as_default():
            self._reads = {name: program.storage[replicator.state_storage_name(name, first)]
                           .read_value() for name in self.names}
        self.step: dict[str, np.ndarray] | None = None   # what one step adds

    def measure(self, run_step: Callable[[], object]) -> object:
        """Runs `run_step` (this task's step) and keeps what it added to each seed."""
        if not self.names:
            self.step = {}
            return run_step()
        before = self.task.run(self._reads)
        result = run_step()
        after = self.task.run(self._reads)
        self.step = {name: np.asarray(after[name]) - np.asarray(before[name])
                     for name in self.names}
        return result

    def advance(self, steps: int) -> None:
        """Every virtual node's copy of each seed advanced by `steps` steps' draws."""
        if not self.names or steps <= 0:
            return
        if self.step is None:
            raise WorkerError("a run-out came before this task ran a step: what a step "
                              "adds to the seed generators is not known")
        now = self.task.run(self._reads)
        self.assign_state({
            name: np.asarray(now[name]) + steps * self.step[name] for name in self.names})
