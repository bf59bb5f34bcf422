"""Adaptation policies: their decisions on given metrics, and a real run.

Unit tests drive the built-in policies with metrics made up step by step and
a stand-in run that records the requests. The cluster test slows a worker
mid-run (SIGSTOP duty cycle, as a slowed link would): `ThroughputReplan`
sees the throughput drop, re-plans with the bandwidth scaled by the drop,
every worker switches at one step boundary, and the weights still equal
Keras `fit` (within 2e-5).
"""
from __future__ import annotations

import dataclasses
import pathlib
import threading
import time

import numpy as np
import pytest

import autodist
from autodist import models, policies
from autodist.ir.errors import AutodistError, StrategyError
from autodist.kernels import monitoring
from autodist.adapt import autoscaler, driver
from autodist.runtime.records import MonitorSample, ProgressRecord
from autodist.runtime.progress import step_metrics
from autodist.search import builders
from tests import small_mlp
from tests.doubles import StandInRun


def _metrics(step, examples_per_s, workers=2, plan=0):
    return policies.StepMetrics(step=step, epoch=0, loss=1.0, seconds=64 / examples_per_s,
                              examples_per_s=examples_per_s, workers=workers, plan=plan)


@pytest.fixture
def control(mlp_item):
    spec = autodist.ResourceSpec.local(workers=2, ps=1, bandwidth_gbps=1.0)
    run = StandInRun(mlp_item, builders.AllReduce().build(mlp_item, spec), spec)
    return policies.Control(run, 64)


def test_scheduled_resize(control):
    resize = policies.ScheduledResize({5: 1, 9: 2})
    for step in range(12):
        control.metrics.append(_metrics(step, 1000.0, workers=control.workers))
        resize.on_step_end(control.metrics[-1], control)
    # Asked when the driver sees the step before the scheduled one.
    assert control.run.requests == [("resize", 1), ("resize", 2)]
    assert [(a["step"], a["workers"]) for a in control.actions] == [(4, 1), (8, 2)]
    with pytest.raises(AutodistError, match="ScheduledResize needs"):
        policies.ScheduledResize({3: 0})


def test_throughput_replan_triggers_on_a_drop_only(control):
    seen = []

    def replanner(graph_item, spec, current):
        seen.append(spec.nodes[0].network_bandwidth_gbps)
        return builders.PS().build(graph_item, spec)

    control.replanner = replanner
    watch = policies.ThroughputReplan(fraction=0.7, window=3, warmup=2)
    speeds = [500, 900, 1000, 1000, 1000, 1000, 950, 1050, 1000, 400, 400, 400, 400]
    for step, speed in enumerate(speeds):
        control.metrics.append(_metrics(step, float(speed)))
        watch.on_step_end(control.metrics[-1], control)
    # Reference: median of steps 2..4 = 1000/s; steps 8..10 (1000, 400, 400)
    # give a median of 400/s < 700/s: one re-plan, bandwidth scaled by 0.4.
    assert watch.replans == 1
    assert seen == [pytest.approx(0.4)]
    assert [r[0] for r in control.run.requests] == ["replan"]
    assert control.actions[0]["step"] == 10 and control.actions[0]["changed"]
    # After a switch the new membership gets a fresh reference.
    for step, speed in enumerate([400] * 10, start=len(speeds)):
        control.metrics.append(_metrics(step, float(speed), plan=1))
        watch.on_step_end(control.metrics[-1], control)
    assert watch.replans == 1 and watch.reference == 400
    with pytest.raises(AutodistError, match=r"fraction must be in \(0, 1\). Received: 1.5"):
        policies.ThroughputReplan(fraction=1.5)


def test_replan_to_the_same_distribution_does_nothing(control):
    control.replanner = lambda gi, spec, current: builders.AllReduce().build(gi, spec)
    assert control.replan() is control.strategy
    assert control.run.requests == [] and control.actions[0]["changed"] is False


def test_set_compressor(control, mlp_item):
    compressed = control.set_compressor("fp16")
    assert control.run.requests == [("replan", compressed)]
    codes = {s.all_reduce.compressor for c in compressed.variables for s in c.shards}
    assert codes == {1}
    compressed.validate(mlp_item, control.run.resource_spec)
    with pytest.raises(StrategyError, match="unknown compressor 'zip'"):
        control.strategy.with_compressor("zip")
    with pytest.raises(StrategyError, match="variable 'nope' is not in the strategy"):
        control.strategy.with_compressor("fp16", ["nope"])


def test_scaled_bandwidth():
    spec = autodist.ResourceSpec.local(workers=2, ps=1, bandwidth_gbps=10.0)
    assert [n.network_bandwidth_gbps for n in policies.scaled_bandwidth(spec, 0.5).nodes] == \
        [5.0, 5.0, 5.0]
    with pytest.raises(AutodistError, match="bandwidth_scale must be a positive number"):
        policies.scaled_bandwidth(spec, 0.0)


def test_step_records_become_metrics_with_the_global_step(control):
    """A policy sees the record's global step (not one re-derived from epoch lengths)."""
    got = []

    class Watch(policies.Policy):
        def on_step_end(self, metrics, control):
            got.append(metrics)

    policy_driver = driver.PolicyDriver(control, [Watch()])
    record = ProgressRecord(
        step=9, epoch=1, epoch_step=2, loss=0.5, seconds=0.032, examples=64,
        last_of_epoch=False, workers=2, plan=1,
        monitor=MonitorSample(batches=(8, 8, 16), sq_norms=(3.0, 5.0, 2.5),
                              compute_s=(0.01, 0.03), tasks=(0, 1), examples=(32, 32)))
    policy_driver.step(step_metrics(record, monitoring.SmoothedNoiseScale(0.9)))
    metrics = got[0]
    assert (metrics.step, metrics.epoch, metrics.workers, metrics.plan) == (9, 1, 2, 1)
    assert metrics.examples_per_s == pytest.approx(2000.0)
    assert metrics.per_worker == pytest.approx({0: 3200.0, 1: 32 / 0.03})
    expected = monitoring.noise_scale_fit([8, 8, 16], [3.0, 5.0, 2.5])
    assert metrics.gradient_variance == pytest.approx(expected.trace_sigma)
    assert metrics.noise_scale.noise_scale == pytest.approx(expected.noise_scale)
    assert control.metrics == [metrics]
    with pytest.raises(AutodistError, match="policies must be autodist Policy objects"):
        driver.PolicyDriver(control, [object()])


class _SlowWorkerAfter(policies.Policy):
    """Test harness: once the chief has logged `step` steps, worker 1 runs `fraction` of
    the time.

    The step count is read from the job's progress file, not from the driver's
    `on_step_end`: the workers run ahead of the driver, and under load a slowdown started
    by the driver's callbacks came after the last step (no drop, no re-plan)."""

    def __init__(self, job_dir, step, fraction, period_s):
        from autodist.bench.slowdown import Slowdown

        self.slowdown = Slowdown(job_dir, 1, fraction, period_s=period_s)
        self.progress = pathlib.Path(job_dir) / "progress.jsonl"
        self.step, self.started = step, None
        self._done = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True)

    def _watch(self):
        deadline = time.monotonic() + 300
        while not self._done.is_set() and time.monotonic() < deadline:
            try:
                logged = self.progress.read_bytes().count(b"\n")
            except OSError:
                logged = 0
            if logged >= self.step:
                self.started = logged
                self.slowdown.__enter__()
                return
            time.sleep(0.005)

    def on_train_begin(self, control):
        self._watcher.start()

    def on_train_end(self, control):
        self._done.set()
        self._watcher.join(timeout=5)
        if self.started is not None:
            self.slowdown.__exit__(None, None, None)


@pytest.mark.cluster
def test_throughput_replan_on_a_slowed_worker(tmp_path):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(1536, 256)).astype("float32")
    y = rng.integers(0, 10, 1536).astype("int32")
    model = models.mlp(input_dim=256, hidden=(512, 512), optimizer="sgd")
    expected = small_mlp.keras_weights(model, x, y, 128, 3)
    item = autodist.capture(model)
    spec = autodist.ResourceSpec.local(workers=2, ps=1, bandwidth_gbps=1.0)
    start = builders.AllReduce().build(item, spec)
    scales = []

    def replanner(graph_item, spec_now, current):
        scales.append(spec_now.nodes[0].network_bandwidth_gbps)
        return builders.PS().build(graph_item, spec_now)

    job_dir = str(tmp_path / "job")
    run = autodist.distribute(model, start, spec, graph_item=item, job_dir=job_dir)
    # The reference is the median of steps 4-8 (the first steps are slower, and a
    # reference taken there missed the drop in CI); worker 1 at 2% of its speed from
    # step 10 takes throughput to a few % of it. The trigger, 35%, is far from both:
    # at 60% the load of a busy machine alone once re-planned before the slowdown, and
    # with worker 1 at 5-10% a reference measured while other processes loaded the
    # machine was low enough that the drop stayed above 35% of it (no re-plan). The
    # 20 ms period keeps the 0.4 ms slices of running longer than a sleep's overshoot.
    slow = _SlowWorkerAfter(job_dir, step=10, fraction=0.02, period_s=0.02)
    watch = policies.ThroughputReplan(fraction=0.35, window=5, warmup=4, max_replans=1)
    seen = _Throughputs()
    history = run.fit(x, y, batch_size=128, epochs=3, verbose=0,
                      policies=[slow, seen, watch], replanner=replanner, shuffle=False)
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    replans = [a for a in history.actions if a.action == "replan"]
    assert len(replans) == 1 and replans[0].details["changed"], (
        history.actions, slow.started, watch.reference, seen.per_step)
    # The replanner sees the cluster's 1 Gbit/s scaled by the measured drop, which is
    # below the trigger (how far below depends on the machine's load).
    assert replans[0].step > slow.started and scales[0] < watch.fraction
    switches = [r for r in history.resizes if r.plan == 1]
    assert len(switches) == 1 and switches[0].step > replans[0].step


class _Throughputs(policies.Policy):
    """Test harness: the examples/s the policies saw at each step (for failure messages)."""

    def __init__(self):
        self.per_step = []

    def on_step_end(self, metrics, control):
        self.per_step.append((metrics.step, round(metrics.examples_per_s)))


def _drive(policy_, control, curve, steps):
    """Feeds `steps` steps whose throughput is curve(current workers)."""
    policy_.on_train_begin(control)
    for step in range(steps):
        control.metrics.append(_metrics(step, curve(control.workers), workers=control.workers))
        policy_.on_step_end(control.metrics[-1], control)
    policy_.on_train_end(control)


def test_autoscale_settles_where_the_autoscaler_does(mlp_item):
    def curve(n):
        return 1000.0 * n / (n + 6)  # settles at 4 (theta 0.6) after 5 trials

    spec = autodist.ResourceSpec.local(workers=6, ps=1)
    offline = autoscaler.Autoscaler(autoscaler.ScalingEfficiency(theta=0.6), 1, 6).run(
        curve, start=1)
    for predict in (None, lambda n: 900.0 * n / (n + 6)):
        run = StandInRun(mlp_item, builders.AllReduce().build(mlp_item, spec), spec)
        control = policies.Control(run, 64)
        run.members = control.members = (0,)
        scale = policies.Autoscale(
            autoscaler.Autoscaler(autoscaler.ScalingEfficiency(theta=0.6), 1, 6), predict,
            window=3, warmup=1)
        _drive(scale, control, curve, 60)
        assert scale.error is None and scale.result is not None
        assert scale.result.workers == offline.workers == control.workers
        trials = [t.workers for t in scale.result.trials]
        if predict is None:
            assert trials == [t.workers for t in offline.trials]
        else:
            assert len(trials) < offline.num_trials
        sizes = [r[1] for r in run.requests]
        assert sizes[-1] == offline.workers == 4


def test_autoscale_reports_a_search_error(mlp_item):
    spec = autodist.ResourceSpec.local(workers=4, ps=1)
    run = StandInRun(mlp_item, builders.AllReduce().build(mlp_item, spec), spec)
    control = policies.Control(run, 64)
    scale = policies.Autoscale(autoscaler.Autoscaler(autoscaler.ScalingEfficiency(), 1, 4),
                             predict=lambda n: float("nan"), window=2)
    _drive(scale, control, lambda n: 100.0 * n, 10)
    assert isinstance(scale.error, AutodistError)
    assert control.actions[-1]["action"] == "autoscale_failed"
    with pytest.raises(AutodistError, match="up to 8 workers; the spec has 4"):
        policies.Autoscale(autoscaler.Autoscaler(autoscaler.ScalingEfficiency(), 1, 8)) \
            .on_train_begin(control)


class _SetBatchAfterFirstEpoch(policies.Policy):
    def __init__(self, batch):
        self.batch = batch

    def on_epoch_end(self, epoch, logs, control):
        if epoch == 0:
            control.set_batch_size(self.batch, learning_rate_rule="linear")


@pytest.mark.cluster
def test_set_batch_size_at_an_epoch_end_equals_keras_with_the_new_batch_and_rate(tmp_path):
    import keras

    examples, batch, bigger = 96, 32, 48
    x, y = small_mlp.data(examples)
    reference = models.single_device_twin(small_mlp.mlp())
    model = small_mlp.mlp()
    reference.set_weights(model.get_weights())
    first = reference.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    reference.optimizer.learning_rate.assign(0.1 * bigger / batch)
    later = reference.fit(x, y, batch_size=bigger, epochs=2, shuffle=False, verbose=0)
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    item = autodist.capture(model)
    strategy = builders.PS().build(item, spec).with_virtual_nodes(batch, 4)
    run = autodist.distribute(model, strategy, spec, graph_item=item,
                              job_dir=str(tmp_path / "job"), step_timeout_s=60)
    history = run.fit(x, y, epochs=3, shuffle=False, verbose=0,
                      policies=[_SetBatchAfterFirstEpoch(bigger)],
                      callbacks=[keras.callbacks.Callback()])
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    assert len(history.step_losses) == 3 + 2 + 2
    np.testing.assert_allclose(history.history["loss"],
                               first.history["loss"] + later.history["loss"], rtol=1e-5)
    action = next(a for a in history.actions if a.action == "set_batch_size")
    assert action.details["global_batch_size"] == bigger
    assert action.details["learning_rate"] == pytest.approx(0.15)
    assert [(r.step, r.plan) for r in history.resizes] == [(3, 1)]


def test_adaptive_batch_size_follows_the_noise_scale(control, mlp_item):
    spec = control.run.resource_spec
    control.run.strategy = control.strategy = builders.AllReduce().build(
        mlp_item, spec).with_virtual_nodes(64, 4)
    adapt = policies.AdaptiveBatchSize(min_batch=32, max_batch=256, factor=1.5)
    noise = monitoring.NoiseScale(gradient_sq=1.0, trace_sigma=150.0, noise_scale=150.0)
    adapt.on_step_end(dataclasses.replace(_metrics(0, 1000.0), noise_scale=noise), control)
    adapt.on_epoch_end(0, {}, control)
    # 150 rounds down to 148 (4 virtual nodes): >= 1.5 x 64, so the batch grows.
    assert control.global_batch_size == 148
    (kind, strategy), = control.run.requests
    assert kind == "replan" and strategy.global_batch_size == 148
    assert strategy.num_virtual_nodes == 4
    lr = mlp_item.optimizer.hyperparameters["learning_rate"]
    assert strategy.hyperparameters["learning_rate"] == pytest.approx(lr * 148 / 64)
    # Within the hysteresis: no change; far above the maximum: clipped.
    adapt.on_epoch_end(1, {}, control)
    noise = monitoring.NoiseScale(1.0, 5000.0, 5000.0)
    adapt.on_step_end(dataclasses.replace(_metrics(1, 1000.0), noise_scale=noise), control)
    adapt.on_epoch_end(2, {}, control)
    assert control.global_batch_size == 256 and len(control.run.requests) == 2
    with pytest.raises(AutodistError, match="positive multiple of the 4 virtual nodes"):
        control.set_batch_size(30)
    with pytest.raises(AutodistError, match="learning_rate_rule must be one of"):
        control.set_batch_size(32, learning_rate_rule="cubic")


def test_epoch_schedule_with_a_batch_change():
    from autodist.runtime.batching import EpochSchedule

    # 100 examples: batch 32 for epoch 0 (4 steps), 48 from step 4 (3 steps each).
    schedule = EpochSchedule(100, 3, None, lambda step: 32 if step < 4 else 48)
    assert schedule.starts() == [0, 4, 7, 10] and schedule.total() == 10
    assert schedule.locate(3) == (0, 3, 32, 4)
    assert schedule.locate(4) == (1, 0, 48, 3)
    assert schedule.locate(9) == (2, 2, 48, 3)
    assert [schedule.examples(i) for i in range(10)] == [32, 32, 32, 4, 48, 48, 4, 48, 48, 4]
