"""The measured search's own ranker: which model orders the candidates the tuner measures.

No cluster: a simulated runner measures. LightGBM trains on a few dozen rows.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from autodist.ir.resource_spec import ResourceSpec
from autodist.search import cost_model as cost_models
from autodist.search.cost_model import (CostModel, DefaultCostModel, SimulatorCostModel,
                                        resolve_cost_model, shipped_measured_search_model)
from autodist.search.database import Database
from autodist.search.measurement import MeasureResult
from autodist.search.simulator import Prediction, Simulator
from autodist.search.tuner import Tuner
from tests.doubles import skewed_runner
from tests.search import workloads


class SlowestFirst(SimulatorCostModel):
    """Orders candidates slowest-first by the simulator: unmistakable in what gets measured."""

    @property
    def name(self) -> str:
        return "slowest-first"

    def predict_candidates(self, simulator: Simulator, candidates: np.ndarray,
                           prediction: Prediction | None = None) -> np.ndarray:
        return -super().predict_candidates(simulator, candidates, prediction)


class Recording:
    """A runner that remembers the strategies asked for, in order, and times them 10 ms."""

    def __init__(self) -> None:
        self.asked = []

    def run(self, strategies):
        self.asked += list(strategies)
        return [MeasureResult(step_times_s=(0.01,)) for _ in strategies]


@pytest.fixture(name="workload")
def _workload():
    gi = workloads.graph_item([("emb", (20000, 64), True), ("kernel", (512, 512), False),
                               ("bias", (512,), False), ("out", (512, 10), False)],
                              flops=2e8, lookups_per_example=4)
    return gi, ResourceSpec.local(workers=4, ps=2, bandwidth_gbps=1)


def _simulated_seconds(tuner: Tuner, strategies) -> np.ndarray:
    return tuner.simulator.predict(np.stack([tuner.space.encode(s) for s in strategies])
                                   ).step_time_s


def test_the_measured_search_model_orders_what_is_measured(workload):
    gi, spec = workload
    measured = {}
    for label, ranker in (("simulator", None), ("model", SlowestFirst())):
        runner = Recording()
        tuner = Tuner(gi, spec, runner=runner, search_budget=300, callbacks=[],
                      cost_model=DefaultCostModel(SimulatorCostModel(), ranker, "a test"))
        result = tuner.tune(trials=6)
        measured[label] = (tuner, runner.asked, result)
    sim_tuner, sim_asked, sim_result = measured["simulator"]
    tuner, asked, result = measured["model"]
    builders = _simulated_seconds(tuner, tuner.builder_strategies.values())
    # Builders: the three the model ranks first (simulated slowest), not the fastest three.
    first_builders = [s for s in asked if s.origin != "search"]
    # (Builders whose strategies coincide are measured once.)
    assert min(_simulated_seconds(tuner, first_builders)) >= sorted(builders)[-3]
    sim_builders = [s for s in sim_asked if s.origin != "search"]
    assert max(_simulated_seconds(sim_tuner, sim_builders)) <= sorted(builders)[2]
    # Searched candidates: the model's picks are ones the simulator finds slower.
    searched = _simulated_seconds(tuner, [s for s in asked if s.origin == "search"])
    sim_searched = _simulated_seconds(sim_tuner, [s for s in sim_asked if s.origin == "search"])
    assert searched.min() > sim_searched.max()
    # The prediction side is untouched: the simulator still ranks and predicts.
    assert tuner.predictor == "simulator" and result.strategy.proto.performance.predictor == \
        "simulator"
    assert tuner.measured_ordered_by == ["slowest-first"] * 2
    assert "measured search: slowest-first ordered the measured candidates (a test)" in \
        result.explanation
    assert "measured search: simulator ordered the measured candidates" in \
        sim_result.explanation


def test_without_trials_the_measured_search_model_is_only_named(workload):
    gi, spec = workload
    plain = Tuner(gi, spec, search_budget=300).tune()
    tuner = Tuner(gi, spec, search_budget=300,
                  cost_model=DefaultCostModel(SimulatorCostModel(), SlowestFirst(), "a test"))
    result = tuner.tune()
    np.testing.assert_array_equal(tuner.space.encode(result.strategy),
                                  tuner.space.encode(plain.strategy))
    assert result.predicted_step_time_s == plain.predicted_step_time_s
    assert ("measured search: no trials; with trials, slowest-first would order the "
            "candidates to measure (a test)") in result.explanation


def test_a_refit_takes_over_the_order(workload, tmp_path):
    gi, spec = workload
    tuner = Tuner(gi, spec, database=Database(tmp_path / "t.jsonl"),
                  runner=skewed_runner(gi, spec), search_budget=300,
                  measured_search_model=SlowestFirst())
    result = tuner.tune(trials=10, measure_per_round=2, builder_trials=0)
    assert tuner.measured_ordered_by[:4] == ["slowest-first"] * 4
    assert tuner.measured_ordered_by[4] == "lightgbm-regressor"
    assert "given as measured_search_model" in result.explanation
    assert "a refit on the trials replaced the cost model" in result.explanation


@pytest.fixture(name="regressor", scope="module")
def _regressor(tmp_path_factory):
    gi = workloads.graph_item([("kernel", (256, 256), False), ("out", (256, 10), False)],
                              flops=1e8)
    spec = ResourceSpec.local(workers=2, ps=1, bandwidth_gbps=1)
    db = Database(tmp_path_factory.mktemp("trials") / "t.jsonl")
    Tuner(gi, spec, database=db, runner=skewed_runner(gi, spec), search_budget=200,
          callbacks=None).tune(trials=8, measure_per_round=4)
    model = SimulatorCostModel("regressor").update(db.records())
    return model.annotate(shipped_because="it won the test")


def test_the_shipped_measured_search_model_is_read_with_its_reason(regressor, tmp_path):
    path = tmp_path / "measured_search_model.txt"
    regressor.save(path)
    model, why = shipped_measured_search_model(path)
    assert model.kind == "regressor" and model.notes == {"shipped_because": "it won the test"}
    assert why == "the shipped measured-search model: it won the test"
    missing, why = shipped_measured_search_model(tmp_path / "none.txt")
    assert missing is None and why.startswith("no measured-search model ships")


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_a_damaged_measured_search_model_falls_back_with_a_warning(regressor, tmp_path,
                                                                    damage, workload):
    path = tmp_path / "measured_search_model.txt"
    regressor.save(path)
    text = path.read_text()
    path.write_text({"truncate": text[: len(text) // 2],
                     "flip": text.replace("Tree=0", "Tree=1", 1),
                     "garbage": "not a model"}[damage])
    with pytest.warns(RuntimeWarning, match="measured-search model is not used"):
        model, why = shipped_measured_search_model(path)
    assert model is None and "could not be used" in why
    gi, spec = workload
    tuner = Tuner(gi, spec, search_budget=100,
                  cost_model=DefaultCostModel(SimulatorCostModel(), model, why))
    assert tuner.measure_ranker is tuner.cost_model
    assert "simulator would order the candidates to measure (the shipped measured-search " \
        "model measured_search_model.txt could not be used" in tuner.tune().explanation


def test_the_default_brings_the_shipped_measured_search_model(regressor, tmp_path,
                                                              monkeypatch, workload):
    path = tmp_path / "measured_search_model.txt"
    regressor.save(path)
    monkeypatch.setattr(cost_models, "SHIPPED_MEASURED_SEARCH_MODEL", path)
    default = resolve_cost_model(None)
    assert isinstance(default, DefaultCostModel)
    assert default.measured_search.kind == "regressor"
    assert "it won the test" in default.measured_search_why
    assert isinstance(resolve_cost_model("simulator"), SimulatorCostModel)
    gi, spec = workload
    tuner = Tuner(gi, spec, search_budget=100, cost_model=default)
    assert tuner.measure_ranker.name == "lightgbm-regressor"
    assert tuner.cost_model is default.ranking
    monkeypatch.setattr(cost_models, "SHIPPED_MEASURED_SEARCH_MODEL", tmp_path / "gone.txt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_cost_model(None).measured_search is None


def test_the_package_ships_what_the_report_decided():
    """benchmarks/train_cost_model.py writes both the file and the decision."""
    import pathlib

    report = (pathlib.Path(__file__).parents[2] / "benchmarks" / "results" /
              "cost_model.md").read_text()
    model, _ = shipped_measured_search_model()
    if model is None:
        assert "Measured-search decision: ship none" in report
    else:
        assert f"Measured-search decision: ship the {model.kind} as the measured-search model" \
            in report
        assert model.training_stats["num_rows"] >= 500 and "shipped_because" in model.notes
        assert isinstance(model, CostModel)
