"""The tuner with a fake runner: records, failures as data, resume, refit, explain."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autodist.ir.resource_spec import ResourceSpec
from autodist.search.database import Database
from autodist.search.simulator import Calibration, Simulator
from autodist.search.tuner import Tuner
from tests.search import workloads


class FakeRunner:
    """'Measures' with a differently calibrated simulator; fails on async strategies."""

    def __init__(self, graph_item, spec, fail_when=None):
        self.calls = 0
        self.fail_when = fail_when
        self.truth = Calibration(latency_s=3e-4, memory_bytes_per_s=2e9)
        self.graph_item, self.spec = graph_item, spec

    def measure(self, strategy):
        self.calls += 1
        if self.fail_when and self.fail_when(strategy):
            raise RuntimeError("worker:1 died (fake)")
        from autodist.search.space import SearchSpace  # pylint: disable=C0415
        sim = Simulator(SearchSpace(self.graph_item, self.spec), self.truth)
        t = float(sim.predict_strategy(strategy).step_time_s[0])
        return [t * f for f in (1.0, 1.02, 0.98)]


@pytest.fixture(name="workload")
def _workload():
    gi = workloads.graph_item([("emb", (20000, 64), True), ("kernel", (512, 512), False),
                               ("bias", (512,), False), ("out", (512, 10), False)],
                              flops=2e8, lookups_per_example=4)
    return gi, ResourceSpec.local(workers=4, ps=2, bandwidth_gbps=1)


def test_without_measurement_the_pick_is_never_predicted_slower_than_a_builder(workload):
    gi, spec = workload
    result = Tuner(gi, spec, search_budget=1000).tune()
    assert result.predicted_step_time_s <= min(result.builder_step_times_s.values()) + 1e-12
    assert len(result.builder_step_times_s) == 8
    result.strategy.validate(gi, spec)
    perf = result.strategy.proto.performance
    assert perf.predictor == "simulator"
    assert perf.predicted_step_time_s == pytest.approx(result.predicted_step_time_s)
    assert 0 < perf.lower_bound_step_time_s <= perf.predicted_step_time_s
    for name in ("emb", "kernel", "bias", "out", "Parallax", "AllReduce"):
        assert name in result.explanation


def test_trials_are_recorded_failures_are_data_and_the_fastest_measured_wins(workload, tmp_path):
    gi, spec = workload
    db = Database(tmp_path / "trials.jsonl")
    fails_on_first = {"n": 0}

    def fail_first(_strategy):
        fails_on_first["n"] += 1
        return fails_on_first["n"] == 1
    runner = FakeRunner(gi, spec, fail_when=fail_first)
    result = Tuner(gi, spec, database=db, runner=runner, search_budget=500).tune(trials=5)
    records = db.records()
    assert len(records) == 5 == runner.calls == len(result.trials)
    assert records[0].error == "RuntimeError: worker:1 died (fake)" and not records[0].ok
    assert all(r.ok for r in records[1:])
    best = min(records[1:], key=lambda r: r.median_step_time_s)
    assert result.strategy.proto.performance.measured_step_time_s
    assert np.median(result.strategy.proto.performance.measured_step_time_s) == \
        pytest.approx(best.median_step_time_s)
    assert all(r.features and r.workload == records[0].workload for r in records)


def test_a_tuner_resumes_from_its_database(workload, tmp_path):
    gi, spec = workload
    db = Database(tmp_path / "trials.jsonl")
    runner = FakeRunner(gi, spec)
    first = Tuner(gi, spec, database=db, runner=runner, search_budget=500).tune(trials=3)
    again = Tuner(gi, spec, database=db, runner=runner, search_budget=500).tune(trials=3)
    # The same search proposes the same candidates; none is measured twice.
    measured = [r.strategy for r in db.records()]
    assert len(measured) == len(set(measured)) == runner.calls == 6
    assert again.strategy.proto.performance.measured_step_time_s
    del first


def test_refit_switches_to_a_learned_cost_model(workload, tmp_path):
    gi, spec = workload
    db = Database(tmp_path / "trials.jsonl")
    tuner = Tuner(gi, spec, database=db, runner=FakeRunner(gi, spec), search_budget=400)
    result = tuner.tune(trials=10, measure_per_round=5)
    assert tuner.cost_model is not None and tuner.cost_model.kind == "regressor"
    assert result.strategy.proto.performance.predictor == "lightgbm-regressor"


def test_measuring_needs_a_runner(workload):
    gi, spec = workload
    with pytest.raises(ValueError, match="needs a runner"):
        Tuner(gi, spec).tune(trials=1)
    with pytest.raises(ValueError, match="trials must be >= 0"):
        Tuner(gi, spec).tune(trials=-1)


def test_records_round_trip_through_the_database(workload, tmp_path):
    gi, spec = workload
    tuner = Tuner(gi, spec, search_budget=200)
    strategy = tuner.tune().strategy
    record = tuner.record(strategy, [0.01, 0.02], None, 0.015, origin="test")
    db = Database(tmp_path / "t.jsonl")
    db.append(record)
    (loaded,) = db.records()
    assert dataclasses.asdict(loaded)["strategy"] == strategy.serialize()
    assert loaded.median_step_time_s == pytest.approx(0.015)


def test_measuring_includes_the_builders_predicted_fastest(workload, tmp_path):
    gi, spec = workload
    db = Database(tmp_path / "trials.jsonl")
    tuner = Tuner(gi, spec, database=db, runner=FakeRunner(gi, spec), search_budget=400)
    result = tuner.tune(trials=4)
    origins = [r.origin for r in db.records()]
    fastest = sorted(result.builder_step_times_s, key=result.builder_step_times_s.get)[:2]
    assert origins[:2] == fastest and origins[2:] == ["search", "search"]
    best_builder = min(r.median_step_time_s for r in db.records()[:2])
    assert np.median(result.strategy.proto.performance.measured_step_time_s) <= best_builder
    assert result.strategy.origin in fastest + ["search"]
