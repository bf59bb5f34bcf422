"""A worker's view of an elastic run: who runs which steps, and the hand-over.

`Membership` holds the run's segments (`elastic.Segment`: the member worker
tasks and the strategy of a range of steps) and the strategies switched to;
a followed run extends both in place while it goes. At a segment's end
every member hands its state to the chief (`hand_over`), which sends the
whole to each member of the next segment (`receive_snapshot`).
"""
from __future__ import annotations

import numpy as np

from autodist.ir.strategy import Strategy
from autodist.launch import mailbox
from autodist.launch.mailbox import Mailboxes
from autodist.runtime.elastic import Segment
from autodist.runtime.follow import CHIEF
from autodist.runtime.trained_values import TrainedValues, pack, unpack
from autodist.runtime.worker_session import ProgramSession, WorkerError


class Membership:
    """The run's segments and the strategies it switches to.

    Args:
        strategy: The run's strategy (plan 0).
        plans: The strategies switched to, as text (plan 1 on).
        global_batch_size: The run's global batch, where a plan sets none.
    """

    def __init__(self, strategy: Strategy, plans: list[str], global_batch_size: int) -> None:
        self.segments: list[Segment] = []  # set once the run's length is known
        self.plans = plans
        self.global_batch_size = global_batch_size
        self._strategies: dict[int, Strategy] = {0: strategy}

    def plan(self, plan: int) -> Strategy:
        """The strategy of plan `plan` (0: the run's)."""
        if plan not in self._strategies:
            self._strategies[plan] = Strategy.from_text(self.plans[plan - 1])
        return self._strategies[plan]

    def segment_at(self, step: int) -> Segment:
        """The segment that runs `step` (the last one past the end)."""
        return next((s for s in self.segments if s.start <= step < s.end), self.segments[-1])

    def batch_at(self, step: int) -> int:
        """The global batch of the strategy that runs `step`."""
        return self.plan(self.segment_at(step).plan).global_batch_size or \
            self.global_batch_size


def hand_over(task: ProgramSession, values: TrainedValues, mail: Mailboxes, is_chief: bool,
              segment: Segment, following: Segment, timeout_s: float,
              ) -> dict[str, np.ndarray] | None:
    """End of a membership version: the chief gathers the state, sends it on.

    Every member sends the chief its virtual nodes' state variables; the
    chief adds every variable, slot and the step count (its own view,
    equal to everyone's in synchronous training) and sends the whole to
    each member of the next version, which starts from it.

    Args:
        task: This task's program and session of `segment`.
        values: Its trained values (the chief's are handed over).
        mail: The cluster's mailboxes.
        is_chief: Whether this task is the chief.
        segment: The segment that ends.
        following: The segment that starts.
        timeout_s: How long a message may take.

    Returns:
        The chief: the state it sent (it starts from it too); others: None.
    """
    own_state = {}
    if task.graph_item.state_variables:
        program = task.program
        with program.graph.as_default():
            reads = {name: var.read_value() for name, var in program.storage.items()
                     if program.roles[name].kind == "state"}
        own_state = task.run(reads)
    if not is_chief:
        mail.send(CHIEF, mailbox.STATE_UP, pack(own_state), timeout_s)
        return None
    snapshot = dict(own_state)
    for _ in range(1, segment.workers):
        snapshot.update(unpack(mail.receive(CHIEF, mailbox.STATE_UP, timeout_s)))
    snapshot.update(values.handed_over())
    message = pack(snapshot)
    wait_for_joiners(mail, [t for t in following.members if not segment.has(t)],
                     following.start, timeout_s)
    for task_index in following.members[1:]:
        mail.send(("worker", task_index), mailbox.STATE, message, timeout_s)
    return snapshot


def wait_for_joiners(mail: Mailboxes, joiners: list[int], step: int, timeout_s: float) -> None:
    """Chief: waits until the tasks the run grows onto at `step` answer. A task that
    was not a member before may have no process yet: under launch="remote" its slot's
    `autodist serve` may start after launch, and gets the job once it answers.

    Raises:
        WorkerError: naming the first task that did not answer within `timeout_s`,
            and its address.
    """
    for task_index in joiners:
        task = ("worker", task_index)
        try:
            mail.wait_until_up([task], timeout_s)
        except mailbox.MailboxError as e:
            raise WorkerError(
                f"worker task {task_index} at {mail.address(task)} did not join the run at "
                f"step {step} within {timeout_s:g}s: nothing served its slot (start "
                "`autodist serve --tf-config` there, with the cluster's TF_CONFIG and "
                f"secret). {e}") from e


def receive_snapshot(mail: Mailboxes, task_index: int, timeout_s: float,
                     ) -> dict[str, np.ndarray]:
    """A task joining a later membership version: the state the chief sends."""
    return unpack(mail.receive(("worker", task_index), mailbox.STATE, timeout_s))

