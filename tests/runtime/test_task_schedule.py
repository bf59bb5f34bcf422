"""Which worker tasks a scheduled elastic run needs when (`elastic.task_schedule`); no
TensorFlow."""
from __future__ import annotations

import pytest

from autodist.ir.errors import AutodistError
from autodist.runtime.elastic import TaskSchedule, scheduled_tasks, task_schedule
from autodist.runtime.run_config import RunConfig


def test_a_run_without_a_schedule_needs_every_task_throughout():
    assert task_schedule(None, 3) == TaskSchedule((0, 1, 2))
    assert task_schedule({}, 2) == TaskSchedule((0, 1))


def test_late_joiners_absent_tasks_and_released_leavers():
    schedule = task_schedule({"0": [0, 1], "3": [0, 1, 2], "6": [0, 1]}, 4)
    assert schedule.start == (0, 1)
    assert schedule.late == {2}        # served later is enough
    assert schedule.absent == {3}      # in no segment: takes no part
    assert schedule.released == {2}    # leaves for good at step 6


def test_sizes_follow_the_members_and_a_schedule_may_start_later():
    schedule = task_schedule({0: 2, 3: 3, 6: 1}, 3)
    assert (schedule.start, schedule.late, schedule.released) == ((0, 1), {2}, {1, 2})
    schedule = task_schedule({5: 1, 7: [0, 2]}, 3)   # every task from step 0
    assert (schedule.start, schedule.late, schedule.absent, schedule.released) == \
        ((0, 1, 2), set(), set(), {1})


def test_a_task_that_leaves_and_comes_back_is_not_released():
    schedule = task_schedule({0: [0, 1, 2], 2: [0, 2], 4: [0, 1, 2]}, 3)
    assert schedule.released == set() and schedule.late == set()


def test_a_followed_run_starts_on_its_starting_members_and_may_grow_onto_any_other():
    config = RunConfig(job_id="j", global_batch_size=8, epochs=1, follow_steps=True,
                       resize_at={"0": [0, 1]})
    assert scheduled_tasks(config, 3) == TaskSchedule((0, 1), late=frozenset({2}))
    config = RunConfig(job_id="j", global_batch_size=8, epochs=1, follow_steps=True)
    assert scheduled_tasks(config, 3) == TaskSchedule((0, 1, 2))


def test_bad_members_are_named():
    with pytest.raises(AutodistError, match=r"resize_at\[3\]"):
        task_schedule({0: [0, 1], 3: 7}, 3)
