"""The tuner with a simulated runner: records, failures as data, resume, refit, explain,
callbacks, failing builders."""
from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest

from autodist.ir.resource_spec import ResourceSpec
from autodist.search.cost_model import SimulatorCostModel
from autodist.search.database import Database
from autodist.search.measure_callback import (AddToDatabase, LogProgress, RefitCostModel,
                                              default_callbacks)
from autodist.search.measurement import MeasureResult, RunnerError
from autodist.search.metrics import CostModelError, log_rmse
from autodist.search.tuner import Tuner
from tests.doubles import BrokenRunner, RoundRecorder, skewed_runner
from tests.search import workloads


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
    runner = skewed_runner(gi, spec, fail_when=fail_first)
    result = Tuner(gi, spec, database=db, runner=runner, search_budget=500).tune(trials=5)
    records = db.records()
    assert len(records) == 5 == runner.calls == len(result.trials)
    assert records[0].error == "RuntimeError: worker:1 died (simulated)" and not records[0].ok
    assert all(r.ok for r in records[1:])
    best = min(records[1:], key=lambda r: r.median_step_time_s)
    assert result.strategy.proto.performance.measured_step_time_s
    assert np.median(result.strategy.proto.performance.measured_step_time_s) == \
        pytest.approx(best.median_step_time_s)
    assert all(r.features and r.workload == records[0].workload for r in records)


def test_a_tuner_resumes_from_its_database(workload, tmp_path):
    gi, spec = workload
    db = Database(tmp_path / "trials.jsonl")
    runner = skewed_runner(gi, spec)
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
    tuner = Tuner(gi, spec, database=db, runner=skewed_runner(gi, spec), search_budget=400)
    result = tuner.tune(trials=10, measure_per_round=5)
    assert tuner.cost_model is not None and tuner.cost_model.kind == "regressor"
    assert result.strategy.proto.performance.predictor == "lightgbm-regressor"


def test_a_residual_model_ranks_predicts_seconds_and_refits_in_the_tuner(workload, tmp_path):
    gi, spec = workload
    db = Database(tmp_path / "trials.jsonl")
    Tuner(gi, spec, database=db, runner=skewed_runner(gi, spec),
          search_budget=400).tune(trials=10, measure_per_round=5)
    residual = SimulatorCostModel("residual").update(db.records())
    tuner = Tuner(gi, spec, cost_model=residual, database=db, runner=skewed_runner(gi, spec),
                  search_budget=400)
    result = tuner.tune(trials=4)
    # Refitted after each round (14 trials >= 8), continuing from the residual model.
    assert tuner.cost_model is not residual and tuner.cost_model.kind == "residual"
    assert result.strategy.proto.performance.predictor == "lightgbm-residual"
    # Its seconds are its own, and closer to the runner's than the simulator's are.
    records = [r for r in db.records() if r.ok]
    assert len(records) == 14
    candidates = np.stack([tuner.space.encode(r.load_strategy()) for r in records])
    measured = np.array([r.median_step_time_s for r in records])
    seconds, _ = tuner.predict_seconds(candidates)
    simulated = tuner.simulator.predict(candidates).step_time_s
    assert log_rmse(seconds, measured) < 0.5 * log_rmse(simulated, measured)


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
    tuner = Tuner(gi, spec, database=db, runner=skewed_runner(gi, spec), search_budget=400)
    result = tuner.tune(trials=4)
    origins = [r.origin for r in db.records()]
    fastest = sorted(result.builder_step_times_s, key=result.builder_step_times_s.get)[:2]
    assert origins[:2] == fastest and origins[2:] == ["search", "search"]
    best_builder = min(r.median_step_time_s for r in db.records()[:2])
    assert np.median(result.strategy.proto.performance.measured_step_time_s) <= best_builder
    assert result.strategy.origin in fastest + ["search"]


# ------------------------------------------------------------- callbacks
def test_callbacks_run_after_each_round_the_first_with_the_builders(workload, tmp_path):
    gi, spec = workload
    db = Database(tmp_path / "trials.jsonl")
    recorder = RoundRecorder()
    runner = skewed_runner(gi, spec)
    tuner = Tuner(gi, spec, database=db, runner=runner, search_budget=300,
                  callbacks=default_callbacks() + [recorder])
    result = tuner.tune(trials=5, measure_per_round=2)
    # Round 1: the 2 builders predicted fastest and 2 searched candidates, in one run call.
    assert runner.batches == [4, 1]
    assert [origins for origins, _ in recorder.rounds] == [
        [result.trials[0].origin, result.trials[1].origin, "search", "search"], ["search"]]
    assert [r.origin for r in db.records()] == [t.origin for t in result.trials]
    assert isinstance(tuner.cost_model, SimulatorCostModel)      # < 8 trials: no refit


def test_without_callbacks_nothing_is_recorded_or_refitted(workload, tmp_path):
    gi, spec = workload
    db = Database(tmp_path / "trials.jsonl")
    tuner = Tuner(gi, spec, database=db, runner=skewed_runner(gi, spec), search_budget=300,
                  callbacks=[])
    result = tuner.tune(trials=10, measure_per_round=5)
    assert len(result.trials) == 10 and db.records() == []
    assert tuner.cost_model is tuner.base_cost_model


def test_refit_callback_continues_from_the_base_model_and_the_tuner_searches_again(
        workload, tmp_path):
    gi, spec = workload
    db = Database(tmp_path / "trials.jsonl")
    recorder = RoundRecorder()
    tuner = Tuner(gi, spec, database=db, runner=skewed_runner(gi, spec), search_budget=300,
                  callbacks=[AddToDatabase(), RefitCostModel(min_trials=4), recorder])
    tuner.tune(trials=6, measure_per_round=2)
    # Round 1 (3 builders + 2 searched) leaves 5 records >= 4: a regressor ranks from then on.
    assert [name for _, name in recorder.rounds][-1] == "lightgbm-regressor"
    assert isinstance(tuner.base_cost_model, SimulatorCostModel)
    with pytest.raises(CostModelError, match="min_trials must be a positive integer"):
        RefitCostModel(min_trials=0)


def test_log_progress_prints_a_line_per_trial(workload):
    gi, spec = workload
    stream = io.StringIO()
    runner = skewed_runner(gi, spec, fail_when=lambda s: s.origin == "search")
    Tuner(gi, spec, runner=runner, search_budget=200,
          callbacks=[LogProgress(stream)]).tune(trials=2)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("trial (") and " ms, measured " in lines[0]
    assert lines[1] == lines[1].split(" measured ")[0] + \
        " measured failed: RuntimeError: worker:1 died (simulated)"


# ------------------------------------------------ runners and builders
def test_a_crashing_runner_fails_its_trials_and_a_lying_one_is_an_error(workload, tmp_path):
    gi, spec = workload
    db = Database(tmp_path / "trials.jsonl")
    result = Tuner(gi, spec, database=db, runner=BrokenRunner(),
                   search_budget=200).tune(trials=2)
    assert [t.error for t in result.trials] == ["ConnectionError: cluster unreachable"] * 2
    assert [r.error for r in db.records()] == ["ConnectionError: cluster unreachable"] * 2
    assert not result.strategy.proto.performance.measured_step_time_s
    empty = Tuner(gi, spec, runner=BrokenRunner([MeasureResult()]),
                  search_budget=200).tune(trials=1, builder_trials=1)
    assert empty.trials[0].error == "the runner returned no step times"
    with pytest.raises(RunnerError, match="returned 1 results for 2 strategies"):
        Tuner(gi, spec, runner=BrokenRunner([MeasureResult((0.1,))]),
              search_budget=200).tune(trials=2)


def test_a_builder_that_fails_for_the_workload_is_recorded(tmp_path):
    gi = workloads.graph_item([("kernel", (256, 256), False), ("bias", (256,), False)],
                              flops=1e8)
    workers_only = ResourceSpec.from_dict({"nodes": [
        {"address": "localhost", "cpus": [0], "roles": ["worker"], "chief": True},
        {"address": "127.0.0.2", "cpus": [0], "roles": ["worker"]}]})
    result = Tuner(gi, workers_only, search_budget=200).tune()
    assert set(result.builder_errors) == {"PS", "PSLoadBalancing", "PartitionedPS",
                                          "UnevenPartitionedPS"}
    assert all(e.startswith("StrategyError: no devices to place variables on")
               for e in result.builder_errors.values())
    assert set(result.builder_step_times_s).isdisjoint(result.builder_errors)
    assert "PS                     failed to build: StrategyError" in result.explanation


def test_the_simulator_ranks_by_default_as_an_object(workload):
    gi, spec = workload
    tuner = Tuner(gi, spec, cost_model=None, search_budget=100)
    assert isinstance(tuner.cost_model, SimulatorCostModel) and tuner.predictor == "simulator"
    candidates = np.stack(list(tuner.seeds.values()))
    np.testing.assert_array_equal(tuner.score(candidates),
                                  tuner.simulator.predict(candidates).step_time_s)
