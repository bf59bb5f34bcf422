"""`autodist.optimize` and the `search` / `export` commands on captured example models."""
from __future__ import annotations

import pathlib
import time

import numpy as np
import pytest

import autodist
from autodist import cli, models
from autodist.api import default_cost_model
from autodist.ir.strategy import AllReduceSynchronizer
from autodist.search.cost_model import CostModelError, SimulatorCostModel
from autodist.search.database import Database
from autodist.search.space import SpaceOptions
from autodist.search.tuner import Tuner


@pytest.mark.parametrize("name", ["mlp", "ncf", "transformer"])
def test_optimize_returns_a_valid_strategy_in_seconds(name):
    model = models.build(name)
    gi = autodist.capture(model)
    spec = autodist.ResourceSpec.local(workers=4, ps=2, bandwidth_gbps=1)
    start = time.perf_counter()
    plan = autodist.optimize(model, spec, graph_item=gi)
    elapsed = time.perf_counter() - start
    assert elapsed < 20, f"optimize took {elapsed:.1f}s"
    plan.strategy.validate(gi, spec)
    assert plan.strategy.origin == "search"
    # The builders are candidates: the ranking that chose the pick (the shipped
    # cost model when there is one) never places it below a builder.
    tuner = Tuner(gi, spec, cost_model=default_cost_model(), search_budget=10)
    scores = tuner.score(np.stack([tuner.space.encode(plan.strategy)]
                                  + list(tuner.seeds.values())))
    assert scores[0] <= scores[1:].min() + 1e-12
    assert 0 < plan.lower_bound_step_time_s <= plan.predicted_step_time_s
    # With the simulator alone, that ranking is in predicted seconds.
    simulated = autodist.optimize(model, spec, graph_item=gi, cost_model="simulator")
    assert simulated.strategy.proto.performance.predictor == "simulator"
    assert simulated.predicted_step_time_s <= min(simulated.builder_step_times_s.values()) + 1e-12
    text = plan.explain()
    for var in gi.variable_names:
        assert var in text
    assert "Parallax" in text and "predicted step time" in text
    assert "ms/step" in repr(plan)


def test_optimize_densifies_a_small_table_looked_up_many_times():
    """ctr: 50 lookups per example into 500 rows; a 20k-row user table looked up once."""
    model = models.build("ctr", num_users=20_000, optimizer="sgd")
    spec = autodist.ResourceSpec.local(workers=2, ps=1, bandwidth_gbps=0.1)
    plan = autodist.optimize(model, spec, batch_size=64, cost_model="simulator")
    syncs = {c.var_name: c.shards[0] for c in plan.strategy.proto.variables}
    category = syncs["category_embedding/embeddings"]
    assert category.WhichOneof("kind") == "all_reduce"
    assert category.all_reduce.spec == AllReduceSynchronizer.RING        # densified
    user = syncs["user_embedding/embeddings"]
    assert not (user.WhichOneof("kind") == "all_reduce"
                and user.all_reduce.spec == AllReduceSynchronizer.RING)  # rows, not 2.5 MB
    assert plan.predicted_step_time_s < 0.9 * min(plan.builder_step_times_s.values())
    text = plan.explain()
    assert "), densified" in text and "ALL_GATHER" in text


def test_optimize_defaults_and_errors():
    model = models.build("mlp", hidden=(32,))
    plan = autodist.optimize(model, space_options=SpaceOptions(compressors=("none", "fp16")))
    assert plan.resource_spec.num_worker_tasks == 2 and len(plan.resource_spec.ps_devices) == 1
    assert plan.builder_errors == {}            # every builder builds for this cluster
    # The simulator as an object ranks exactly as "simulator" does.
    by_name = autodist.optimize(model, cost_model="simulator")
    by_object = autodist.optimize(model, cost_model=SimulatorCostModel())
    assert list(by_object.strategy.proto.variables) == list(by_name.strategy.proto.variables)
    assert by_object.strategy.proto.performance.predictor == "simulator"
    with pytest.raises(CostModelError, match="cannot read cost model file"):
        autodist.optimize(model, cost_model="no/such/model.json")
    with pytest.raises(ValueError, match="trials counts measured trials"):
        autodist.optimize(model, trials=3)


def test_cli_search_writes_a_strategy_and_export_reads_the_database(tmp_path, capsys):
    out = tmp_path / "s.pbtxt"
    assert cli.main(["search", "--model", "ncf", "--budget", "500", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "search space of 'ncf'" in printed and "strategy written to" in printed
    strategy = autodist.Strategy.load(out)
    assert strategy.origin == "search"

    # export picks the fastest measured record of the database's workload.
    from autodist.search.tuner import Tuner
    gi = cli.load_graph_item("ncf")
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    tuner = Tuner(gi, spec, search_budget=200)
    db = Database(tmp_path / "trials.jsonl")
    slow = autodist.builders.PS().build(gi, spec)
    fast = autodist.builders.AllReduce().build(gi, spec)
    db.extend([tuner.record(slow, [0.02, 0.03], None, origin="PS"),
               tuner.record(fast, [0.01, 0.012], None, origin="AllReduce"),
               tuner.record(fast, [], "RuntimeError: boom", origin="AllReduce")])
    exported = tmp_path / "best.pb"
    assert cli.main(["export", str(tmp_path / "trials.jsonl"), "--out", str(exported)]) == 0
    assert "origin AllReduce" in capsys.readouterr().out
    loaded = autodist.Strategy.load(exported)   # with the trial's measured step times
    assert list(loaded.proto.performance.measured_step_time_s) == [0.01, 0.012]
    loaded.proto.ClearField("performance")
    assert loaded == fast
    np.testing.assert_equal(len(db.records()), 3)
    assert cli.main(["export", str(tmp_path / "trials.jsonl"), "--workload", "nope",
                     "--out", str(exported)]) == 2
    assert "no measured trial of workload 'nope'" in capsys.readouterr().err


def test_optimize_with_a_measured_calibration():
    from autodist.search.simulator import Calibration
    model = models.build("ncf")
    plan = autodist.optimize(model, calibration="measure")
    assert plan.predicted_step_time_s > 0
    slow = autodist.optimize(model, calibration=Calibration(flops_per_s=1e6))
    assert slow.predicted_step_time_s > plan.predicted_step_time_s
    with pytest.raises(ValueError, match="calibration must be"):
        autodist.optimize(model, calibration="guess")


def test_optimize_ranks_with_the_shipped_cost_model_or_the_simulator():
    """The trainer ships a model only when it picks as well as the simulator.

    benchmarks/train_cost_model.py decides (benchmarks/results/cost_model.md);
    without a shipped file, optimize ranks with the simulator.
    """
    from autodist.search.features import FEATURE_NAMES

    shipped = default_cost_model()
    model = models.build("mlp", hidden=(32,))
    plan = autodist.optimize(model)
    if shipped is None:
        report = pathlib.Path(__file__).parents[1] / "benchmarks" / "results" / "cost_model.md"
        assert "Decision: ship nothing" in report.read_text()
        assert plan.strategy.proto.performance.predictor == "simulator"
        return
    shipped.check_features(FEATURE_NAMES)
    assert shipped.training_stats["num_rows"] >= 500
    assert plan.strategy.proto.performance.predictor == f"lightgbm-{shipped.kind}"
