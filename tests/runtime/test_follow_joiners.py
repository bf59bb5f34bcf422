"""The chief of a followed run and workers outside its starting membership, whose slot may
be served only later (`follow.ChiefFollower`); a stand-in mailbox, no cluster."""
from __future__ import annotations

import pytest

from autodist.launch import mailbox
from autodist.launch.job import JobDir
from autodist.runtime.elastic import Segment
from autodist.runtime.follow import CHIEF, ChiefFollower, FollowError
from autodist.runtime.records import RunLimit, WorkerMessage
from autodist.runtime.run_config import RunConfig

ADDRESSES = ["c:0", "h0:1", "h1:2"]


class _Mail:
    """Boxes in memory; tasks whose address is in `up` take messages."""

    def __init__(self) -> None:
        self.up = {"c:0", "h0:1"}
        self.boxes: dict[tuple, list[bytes]] = {}

    def address(self, task) -> str:
        return ADDRESSES[task[1]]

    def send(self, task, box, message, timeout_s) -> None:
        if self.address(task) not in self.up:
            raise mailbox.MailboxError("not up", mailbox.task_name(task), self.address(task))
        self.boxes.setdefault((task, box), []).append(message)

    def limits(self, task_index: int) -> list[RunLimit]:
        return [RunLimit.from_json(m)
                for m in self.boxes.get((("worker", task_index), mailbox.LIMIT), [])]


def _chief(tmp_path, mail: _Mail) -> ChiefFollower:
    config = RunConfig(job_id="j", global_batch_size=8, epochs=3, follow_steps=True,
                       elastic=True, step_timeout_s=0.2, startup_timeout_s=0.2)
    segments = [Segment(0, 0, 9, (0, 1))]
    return ChiefFollower(JobDir.create(tmp_path / "job"), mail, 3, 3, config, segments,
                         answers=mail.up.__contains__)


def test_a_worker_served_later_gets_the_latest_limit_once_its_slot_answers(tmp_path):
    mail = _Mail()
    chief = _chief(tmp_path, mail)
    assert chief.pending == {2}
    chief._set(6, False)   # worker 2 not served: only worker 1 hears it
    assert [m.limit for m in mail.limits(1)] == [6] and mail.limits(2) == []
    mail.up.add("h1:2")
    chief.segments.append(Segment(1, 6, 9, (0, 1, 2)))
    chief._set(9, True)
    (limit,) = mail.limits(2)   # everything it needs is in the one message
    assert limit.final and limit.segments[-1].members == (0, 1, 2)
    assert chief.pending == set()


def test_a_segment_with_a_joiner_that_never_answers_fails_naming_its_slot(tmp_path):
    mail = _Mail()
    chief = _chief(tmp_path, mail)
    chief.segments[:] = [Segment(0, 0, 3, (0, 1)), Segment(1, 3, 9, (0, 1, 2))]
    chief._wait_for_joiners(2)   # nobody joins at step 2
    with pytest.raises(FollowError, match=r"worker task 2 at h1:2 did not join .* step 3"):
        chief._wait_for_joiners(3)


def test_a_worker_never_served_gets_an_idle_result_from_the_chief(tmp_path):
    mail = _Mail()
    chief = _chief(tmp_path, mail)
    chief.end(9)
    (raw,) = mail.boxes[(CHIEF, mailbox.RESULTS)]
    message = WorkerMessage.from_json(raw)
    assert message.task == 2 and message.error is None
    assert message.result.losses == (0.0,) * 9 and message.result.steps_per_epoch == 3
    assert [m.final for m in mail.limits(1)] == [True]
