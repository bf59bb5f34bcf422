"""The search's local runner (`autodist.runtime.local_runner`).

Without a cluster, through a fake launch function: the switch schedule,
slicing a launch's step times per strategy (warm-up untimed), chunking,
the fallback to smaller launches when one fails (a failing strategy becomes
a result with its error), and pooling two launch orders. On a real local
cluster: two strategies measured in one launch and a failing one isolated by
the fallback, the model's weights untouched.
"""
from __future__ import annotations

import numpy as np
import pytest

from autodist.ir.errors import AutodistError
from autodist.runtime.local_runner import (LaunchRecord, LocalRunner, chunks, measure_with_fallback,
                                     slice_step_times, switch_schedule, switch_seconds,
                                     trial_starts)
from autodist.search.measurement import MeasureResult, pool


# ------------------------------------------------------------- the schedule
def test_switch_schedule_and_slices():
    first, switch_at, total = switch_schedule(["a", "b", "c"], warmup=2, steps=3)
    assert first == "a" and switch_at == {5: "b", 10: "c"} and total == 15
    times = [float(i) for i in range(15)]
    parts = slice_step_times(times, 3, warmup=2, steps=3)
    assert parts == [([0, 1], [2, 3, 4]), ([5, 6], [7, 8, 9]), ([10, 11], [12, 13, 14])]
    with pytest.raises(AutodistError, match="recorded 14 step times.*need 15"):
        slice_step_times(times[:14], 3, warmup=2, steps=3)
    with pytest.raises(AutodistError, match="warmup >= 0"):
        trial_starts(2, -1, 3)


def test_switch_seconds_checks_every_planned_switch():
    resizes = [{"step": 5, "plan": 1, "seconds": 0.5, "workers": 2},
               {"step": 10, "plan": 2, "seconds": 0.7, "workers": 2}]
    assert switch_seconds(resizes, 3, 2, 3) == [None, 0.5, 0.7]
    with pytest.raises(AutodistError, match=r"did not switch at steps \[10\]"):
        switch_seconds(resizes[:1], 3, 2, 3)


def test_chunks_are_balanced():
    assert chunks(list(range(5)), 2) == [[0, 1], [2, 3], [4]]
    assert [len(c) for c in chunks(list(range(41)), 20)] == [14, 14, 13]
    assert chunks([], 3) == []
    with pytest.raises(AutodistError, match="size must be >= 1. Received: 0"):
        chunks([1], 0)


def test_fallback_isolates_the_failing_strategy():
    launches = []

    def launch(strategies):
        launches.append(list(strategies))
        if "bad" in strategies:
            raise RuntimeError("cannot build bad")
        return [MeasureResult((0.1,), launch_size=len(strategies)) for _ in strategies]

    lines = []
    results = measure_with_fallback(["a", "b", "bad", "c"], launch, lines.append)
    assert [r.error for r in results] == [None, None, "RuntimeError: cannot build bad", None]
    assert [r.launch_size for r in results] == [2, 2, 1, 1]
    assert launches == [["a", "b", "bad", "c"], ["a", "b"], ["bad", "c"], ["bad"], ["c"]]
    assert len(lines) == 3 and "launch of 4 failed" in lines[0]
    assert measure_with_fallback([], launch) == []
    # A launch returning too few results counts as failed.
    results = measure_with_fallback(
        ["a", "b"], lambda s: [MeasureResult((0.1,))] if len(s) == 1 else [])
    assert [r.error for r in results] == [None, None]


def test_pool_concatenates_successful_passes():
    a = MeasureResult((1.0, 2.0), warmup_times_s=(9.0,), switch_s=0.5, launch_size=3)
    b = MeasureResult((3.0,), warmup_times_s=(8.0,), launch_size=3)
    failed = MeasureResult.failure(RuntimeError("boom"))
    pooled = pool([a, failed, b])
    assert pooled.step_times_s == (1.0, 2.0, 3.0) and pooled.warmup_times_s == (9.0, 8.0)
    assert pooled.switch_s == 0.5 and pooled.median_step_time_s == 2.0 and pooled.ok
    assert pool([failed]).error == "RuntimeError: boom" and not pool([failed]).ok


# ------------------------------------------------- LocalRunner, fake launch
class FakeLaunch:
    """Step k of a launch takes `1000 * strategy + k` ms; strategy "bad" breaks the launch."""

    def __init__(self):
        self.launches: list[list] = []

    def __call__(self, first, switch_at, total):
        plan = {0: first, **switch_at}
        self.launches.append([plan[s] for s in sorted(plan)])
        if "bad" in plan.values():
            raise AutodistError("switching strategies needs synchronous training (fake)")
        current, times = first, []
        for step in range(total):
            current = plan.get(step, current)
            times.append(1.0 * current + step / 1000)
        return LaunchRecord(times, [{"step": s, "seconds": 0.25} for s in switch_at])


def test_local_runner_measures_a_batch_in_one_launch_without_warmup():
    launch = FakeLaunch()
    runner = LocalRunner(None, None, steps=3, warmup_steps=2, launch=launch)
    first, second = runner.run([1, 2])
    assert launch.launches == [[1, 2]]
    assert first.step_times_s == (1.002, 1.003, 1.004) and first.warmup_times_s == (1.0, 1.001)
    assert second.step_times_s == (2.007, 2.008, 2.009) and second.switch_s == 0.25
    assert first.switch_s is None and first.launch_size == second.launch_size == 2
    assert runner.run([]) == []


def test_local_runner_falls_back_and_chunks():
    launch, lines = FakeLaunch(), []
    runner = LocalRunner(None, None, steps=2, warmup_steps=1, per_launch=3, launch=launch,
                         log=lines.append)
    results = runner.run([1, 2, "bad", 3, 4])
    assert launch.launches == [[1, 2, "bad"], [1], [2, "bad"], [2], ["bad"], [3, 4]]
    assert [r.ok for r in results] == [True, True, False, True, True]
    assert results[2].error.startswith("AutodistError: switching strategies needs")
    assert [r.launch_size for r in results] == [1, 1, 1, 2, 2]
    assert results[4].step_times_s == (4.004, 4.005)
    assert len(lines) == 3 and lines[0].startswith("launch of 3 failed: AutodistError")


def test_local_runner_pools_a_reverse_order_pass():
    launch = FakeLaunch()
    runner = LocalRunner(None, None, steps=2, warmup_steps=1, orders=2, launch=launch)
    a, b = runner.run([1, 2])
    assert launch.launches == [[1, 2], [2, 1]]
    # Late in one launch, early in the other.
    assert a.step_times_s == (1.001, 1.002, 1.004, 1.005)
    assert b.step_times_s == (2.004, 2.005, 2.001, 2.002)
    (single,) = runner.run([3])
    assert launch.launches[-1] == [3] and len(single.step_times_s) == 2   # one pass is enough


def test_a_launch_that_does_not_switch_as_planned_fails():
    runner = LocalRunner(None, None, steps=1, warmup_steps=1,
                         launch=lambda first, switch_at, total: LaunchRecord([0.1] * total))
    a, b = runner.run([1, 2])
    assert a.ok and b.ok            # measured one per launch after the failed pair
    assert a.launch_size == b.launch_size == 1


def test_local_runner_rejects_bad_settings():
    with pytest.raises(AutodistError, match="steps must be >= 1.*Received: steps=0"):
        LocalRunner(None, None, steps=0, launch=FakeLaunch())
    with pytest.raises(AutodistError, match="orders must be 1 or 2. Received: 3"):
        LocalRunner(None, None, orders=3, launch=FakeLaunch())
    with pytest.raises(AutodistError, match="per_launch must be >= 1 or None. Received: 0"):
        LocalRunner(None, None, per_launch=0, launch=FakeLaunch())
    with pytest.raises(AutodistError, match="needs a model"):
        LocalRunner(None, None)


# ----------------------------------------------------- on a real cluster
@pytest.mark.cluster
def test_two_strategies_in_one_launch_and_a_failing_one_isolated(tmp_path):
    import autodist
    from autodist import models
    from autodist.search import builders

    model = models.build("ncf", num_users=300, num_items=500, dim=8, optimizer="adam")
    graph_item = autodist.capture(model)
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    before = [w.copy() for w in model.get_weights()]
    ps, all_reduce = (builders.PS().build(graph_item, spec),
                      builders.AllReduce().build(graph_item, spec))
    # Built for three workers: invalid on this cluster, so its launch fails.
    bad = builders.AllReduce().build(graph_item, autodist.ResourceSpec.local(workers=3, ps=1))
    lines = []
    runner = LocalRunner(model, spec, graph_item=graph_item, batch_size=32, steps=4,
                         warmup_steps=2, log=lines.append)
    results = runner.run([ps, all_reduce, bad, ps])
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)   # measuring never trains the user's model
    first, second, failed, alone = results
    assert first.ok and second.ok and alone.ok, [r.error for r in results]
    assert (first.launch_size, second.launch_size, alone.launch_size) == (2, 2, 1)
    for r in (first, second, alone):
        assert len(r.step_times_s) == 4 and len(r.warmup_times_s) == 2
        assert min(r.step_times_s) > 0
    assert first.switch_s is None and second.switch_s > 0 and alone.switch_s is None
    assert not failed.ok and failed.error.startswith("StrategyError") and failed.launch_size == 1
    assert "launch of 4 failed" in lines[0]
