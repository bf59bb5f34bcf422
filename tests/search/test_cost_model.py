"""Tests of the cost models (autodist.search.cost_model) and their metrics (.metrics).

The models are trained with real LightGBM on synthetic trials whose step time
is a known, noisy function of five features, and scored on held-out
workloads. The metrics are checked against values computed by hand. The
simulator and the LightGBM models are checked as the search's cost-model role
(`predict_candidates`, `update`, `save`/load, what `optimize` accepts).
"""
from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest

from autodist.search.cost_model import (COST_MODEL_FORMAT_VERSION, SIMULATOR_FEATURE, CostModel,
                                        CostModelError, SimulatorCostModel, leave_one_group_out,
                                        load_cost_model, relevance_labels, resolve_cost_model,
                                        shipped_cost_model)
from autodist.search.features import FEATURE_NAMES
from autodist.search.metrics import kendall_tau, log_rmse, pairwise_accuracy

FEATURES = ["x0", "x1", "x2", "x3", "x4", "log_scale"]
NOISE_SIGMA = 0.03   # log-normal measurement noise of the synthetic step times


def synthetic(num_workloads: int, trials: int, seed: int, prefix: str = "w"):
    """Step time = workload scale * f(x0..x4) * noise; the scale is a feature too."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(size=(num_workloads * trials, 5))
    scale = np.repeat(rng.uniform(0.01, 1.0, num_workloads), trials)
    clean = scale * (1 + 2 * x[:, 0] + 1.5 * x[:, 1] ** 2 + x[:, 2] * x[:, 3] - 0.5 * x[:, 4])
    times = clean * np.exp(rng.normal(0.0, NOISE_SIGMA, len(clean)))
    workloads = [f"{prefix}{seed}_{i}" for i in np.repeat(np.arange(num_workloads), trials)]
    return np.column_stack([x, np.log(scale)]), times, workloads


@pytest.fixture(scope="module")
def train_data():
    return synthetic(30, 20, seed=1)


@pytest.fixture(scope="module")
def test_data():
    return synthetic(10, 20, seed=2)


RESIDUAL_FEATURES = ["x0", "x1", "x2", SIMULATOR_FEATURE]


def synthetic_residual(num_workloads: int, trials: int, seed: int):
    """A simulator that is right about x1 and x2 but blind to x0: the measured time is
    its prediction times exp(0.8 * x0 - 0.4) and a noise."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(size=(num_workloads * trials, 3))
    scale = np.repeat(rng.uniform(0.01, 1.0, num_workloads), trials)
    simulated = scale * (1 + 1.5 * x[:, 1] + x[:, 2])
    times = simulated * np.exp(0.8 * x[:, 0] - 0.4 + rng.normal(0.0, NOISE_SIGMA, len(x)))
    workloads = [f"r{seed}_{i}" for i in np.repeat(np.arange(num_workloads), trials)]
    return np.column_stack([x, simulated]), times, workloads


@pytest.fixture(scope="module")
def residual_data():
    return synthetic_residual(30, 20, seed=11), synthetic_residual(10, 20, seed=12)


@pytest.fixture(scope="module")
def residual(residual_data):
    (X, t, w), _ = residual_data
    return CostModel("residual", num_boost_round=100).fit(X, t, w, RESIDUAL_FEATURES)


@pytest.fixture(scope="module")
def ranker(train_data):
    X, t, w = train_data
    return CostModel("ranker", num_boost_round=100).fit(X, t, w, FEATURES)


@pytest.fixture(scope="module")
def regressor(train_data):
    X, t, w = train_data
    return CostModel("regressor", num_boost_round=100).fit(X, t, w, FEATURES)


# --------------------------------------------------------------- learning
def test_ranker_learns_the_order_of_held_out_workloads(ranker, test_data):
    X, t, w = test_data
    metrics = ranker.evaluate(X, t, w)
    assert metrics["pairwise_accuracy"] > 0.85, metrics
    assert metrics["kendall_tau"] > 0.7, metrics
    assert metrics["num_rows"] == 200 and metrics["num_workloads"] == 10
    # Lower = predicted faster: the predicted best of each workload is among its fastest.
    for name in sorted(set(w)):
        rows = np.flatnonzero(np.asarray(w) == name)
        best = rows[np.argmin(ranker.predict(X[rows]))]
        assert np.sum(t[rows] < t[best]) <= 3, name
    stats = ranker.training_stats
    assert stats["num_rows"] == 600 and stats["num_workloads"] == 30
    assert stats["train_pairwise_accuracy"] > metrics["pairwise_accuracy"] - 0.1


def test_regressor_predicts_held_out_step_times(regressor, test_data):
    X, t, w = test_data
    pred = regressor.predict(X)
    assert (pred > 0).all()
    # Stated error: RMSE of log time below 0.15 (the noise alone is 0.03),
    # i.e. typical predictions within ~15% of the measured time.
    metrics = regressor.evaluate(X, t, w)
    assert metrics["log_rmse"] < 0.15, metrics
    assert metrics["log_rmse"] == pytest.approx(log_rmse(pred, t))
    assert np.median(np.abs(pred / t - 1)) < 0.15
    assert metrics["pairwise_accuracy"] > 0.85 and metrics["kendall_tau"] > 0.7


def test_residual_model_corrects_the_simulator_on_held_out_workloads(residual, residual_data):
    _, (X, t, w) = residual_data
    simulated = X[:, 3]
    pred = residual.predict(X)
    # Its seconds are the simulator's times exp(the learned residual).
    raw = residual._booster.predict(X)
    np.testing.assert_allclose(pred, simulated * np.exp(raw), rtol=1e-12)
    # The simulator alone is off by exp(0.8 x0 - 0.4): log RMSE ~0.25 and a
    # pairwise accuracy ~0.8; corrected, the noise (0.03) and the fit remain.
    metrics = residual.evaluate(X, t, w)
    assert log_rmse(simulated, t) > 0.2
    assert metrics["log_rmse"] < 0.08, metrics
    assert metrics["pairwise_accuracy"] > pairwise_accuracy(simulated, t, w) + 0.08, metrics
    assert metrics["pairwise_accuracy"] > 0.9 and metrics["kendall_tau"] > 0.8
    assert residual.predicts_seconds and residual.name == "lightgbm-residual"


def test_residual_model_keeps_the_simulators_order_when_it_is_right():
    # Measured = 1.5 x simulated: nothing to correct but the scale, so the
    # seconds are the simulator's times 1.5 and the order is exactly its.
    X, _, w = synthetic_residual(20, 15, seed=13)
    model = CostModel("residual", num_boost_round=50).fit(X, 1.5 * X[:, 3], w,
                                                          RESIDUAL_FEATURES)
    Xt, tt, wt = synthetic_residual(5, 15, seed=14)
    pred = model.predict(Xt)
    np.testing.assert_allclose(pred, 1.5 * Xt[:, 3], rtol=1e-6)   # LightGBM: float32 labels
    assert pairwise_accuracy(pred, tt, wt) == pairwise_accuracy(Xt[:, 3], tt, wt)


def test_residual_model_needs_the_simulators_positive_step_time(residual_data, residual):
    (X, t, w), _ = residual_data
    with pytest.raises(CostModelError, match=r"needs the feature 'sim_step_time_s' .*"
                                             r"Received: \['x0', 'x1', 'x2', 'x3'\]"):
        CostModel("residual").fit(X, t, w, ["x0", "x1", "x2", "x3"])
    bad = X.copy()
    bad[7, 3] = 0.0
    with pytest.raises(CostModelError, match=r"column 'sim_step_time_s' must hold positive "
                                             r"seconds. Received 0.0 at row 7"):
        CostModel("residual").fit(bad, t, w, RESIDUAL_FEATURES)
    with pytest.raises(CostModelError, match=r"Received -1.0 at row 2"):
        residual.predict(np.array([[0.5, 0.5, 0.5, 1.0]] * 2 + [[0.5, 0.5, 0.5, -1.0]]))
    with pytest.raises(CostModelError, match="a residual needs at least 2 rows. Received: 1"):
        CostModel("residual").fit(X[:1], t[:1], w[:1], RESIDUAL_FEATURES)


def test_training_is_deterministic(train_data):
    X, t, w = train_data
    a = CostModel("ranker", num_boost_round=20, seed=3).fit(X, t, w, FEATURES)
    b = CostModel("ranker", num_boost_round=20, seed=3).fit(X, t, w, FEATURES)
    assert a.to_json() == b.to_json()
    assert a.params["deterministic"] is True and a.params["num_threads"] == 1
    assert a.params["seed"] == 3 and a.params["verbose"] == -1


def test_rows_of_a_workload_need_not_be_contiguous(train_data, test_data):
    X, t, w = train_data
    perm = np.random.default_rng(0).permutation(len(t))
    shuffled = CostModel("ranker", num_boost_round=100).fit(X[perm], t[perm],
                                                            [w[i] for i in perm], FEATURES)
    Xt, tt, wt = test_data
    assert shuffled.evaluate(Xt, tt, wt)["pairwise_accuracy"] > 0.85


def test_feature_importance_names_the_features(ranker):
    importance = ranker.feature_importance()
    assert list(importance) == FEATURES
    # x0 has the largest effect on step time; the workload scale none within a workload.
    assert max(importance, key=importance.get) == "x0"
    assert importance["x0"] > importance["log_scale"]


# ------------------------------------------------------------ persistence
@pytest.mark.parametrize("kind", ["ranker", "regressor", "residual"])
def test_save_and_load_give_identical_predictions(kind, ranker, regressor, residual, test_data,
                                                  residual_data, tmp_path):
    model = {"ranker": ranker, "regressor": regressor, "residual": residual}[kind]
    features, X = ((RESIDUAL_FEATURES, residual_data[1][0]) if kind == "residual"
                   else (FEATURES, test_data[0]))
    path = tmp_path / "model.json"
    model.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["model.json"]   # one file, no leftovers
    saved = json.loads(path.read_text())
    assert saved["version"] == COST_MODEL_FORMAT_VERSION == 3 and saved["kind"] == kind
    assert saved["feature_names"] == features and saved["training"]["num_rows"] == 600
    loaded = CostModel.load(path, feature_names=features)
    np.testing.assert_array_equal(loaded.predict(X), model.predict(X))
    assert loaded.kind == kind and loaded.feature_names == features
    assert loaded.training_stats == model.training_stats
    assert loaded.to_json() == model.to_json()


def test_load_checks_the_callers_features(ranker, tmp_path):
    path = tmp_path / "model.json"
    ranker.save(path)
    with pytest.raises(CostModelError, match=r"missing \['log_scale'\], unexpected \['y'\]"):
        CostModel.load(path, feature_names=FEATURES[:-1] + ["y"])
    with pytest.raises(CostModelError, match="different order"):
        ranker.check_features(list(reversed(FEATURES)))
    ranker.check_features(FEATURES)


def test_load_rejects_bad_files(ranker, tmp_path):
    with pytest.raises(CostModelError, match="cannot read cost model file"):
        CostModel.load(tmp_path / "missing.json")
    garbage = tmp_path / "garbage.json"
    garbage.write_text("tree\nversion=v4\n")
    with pytest.raises(CostModelError, match="not a saved cost model"):
        CostModel.load(garbage)
    newer = json.loads(ranker.to_json())
    newer["version"] = COST_MODEL_FORMAT_VERSION + 1
    path = tmp_path / "newer.json"
    path.write_text(json.dumps(newer))
    with pytest.raises(CostModelError, match="newer than"):
        CostModel.load(path)


# ---------------------------------------------------------------- metrics
# Two workloads, computed by hand:
#   A: actual [1, 2, 3], pred [1, 3, 2]: pairs (0,1) and (0,2) right, (1,2) wrong.
#      tau-b = (C - D) / 3 = (2 - 1) / 3.
#   B: actual [5, 5, 1], pred [0, 1, 2]: (0,1) tied in actual (not counted),
#      (0,2) and (1,2) wrong. tau-b = (0 - 2) / sqrt(3 * (3 - 1)).
HAND_PRED = [1, 3, 2, 0, 1, 2]
HAND_ACTUAL = [1, 2, 3, 5, 5, 1]
HAND_WORKLOADS = ["A", "A", "A", "B", "B", "B"]


def test_pairwise_accuracy_hand_computed():
    assert pairwise_accuracy(HAND_PRED, HAND_ACTUAL, HAND_WORKLOADS) == pytest.approx(2 / 5)
    assert pairwise_accuracy([1, 2, 3], [10, 20, 30], ["A"] * 3) == 1.0
    assert pairwise_accuracy([3, 2, 1], [10, 20, 30], ["A"] * 3) == 0.0
    assert pairwise_accuracy([7, 7], [1, 2], ["A", "A"]) == 0.5           # tie = half
    # Pairs across workloads do not count: each workload alone is ordered right.
    assert pairwise_accuracy([1, 2, -5, -4], [1, 2, 10, 20], ["A", "A", "B", "B"]) == 1.0
    assert math.isnan(pairwise_accuracy([1, 2], [1, 1], ["A", "A"]))       # no pair
    assert math.isnan(pairwise_accuracy([1, 2], [1, 2], ["A", "B"]))


def test_kendall_tau_hand_computed():
    expected = ((2 - 1) / 3 + (0 - 2) / math.sqrt(3 * 2)) / 2
    assert kendall_tau(HAND_PRED, HAND_ACTUAL, HAND_WORKLOADS) == pytest.approx(expected)
    assert kendall_tau([1, 2, 3], [10, 20, 30], ["A"] * 3) == 1.0
    assert kendall_tau([3, 2, 1], [10, 20, 30], ["A"] * 3) == -1.0
    # A single-row workload and an all-tied prediction have no tau-b: left out of the mean.
    assert kendall_tau([1, 2, 0, 4, 4], [1, 2, 9, 1, 2], ["A", "A", "C", "D", "D"]) == 1.0
    assert math.isnan(kendall_tau([1], [1], ["A"]))


def test_metrics_agree_with_scipy_on_random_data():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(5)
    pred = rng.integers(0, 6, 700).astype(float)       # many ties; > one pair block
    actual = rng.integers(0, 8, 700).astype(float)
    workloads = ["A"] * 600 + ["B"] * 100
    expected = np.mean([stats.kendalltau(pred[:600], actual[:600]).statistic,
                        stats.kendalltau(pred[600:], actual[600:]).statistic])
    assert kendall_tau(pred, actual, workloads) == pytest.approx(expected, abs=1e-12)


def test_relevance_labels_grade_by_rank_within_workload():
    labels = relevance_labels([3.0, 1.0, 2.0, 2.0, 50.0, 40.0, 7.0], ["A"] * 4 + ["B", "B", "C"])
    assert labels.tolist() == [0, 30, 15, 15, 0, 30, 0]
    assert relevance_labels(np.linspace(1, 2, 61), ["A"] * 61).tolist() == \
        [30 - i // 2 for i in range(61)]   # halves round up


# ------------------------------------------------------------ bad inputs
def test_fit_rejects_bad_input(train_data):
    X, t, w = train_data
    model = CostModel("ranker", num_boost_round=5)
    with pytest.raises(CostModelError, match=r"one entry per row. Received lengths"):
        model.fit(X, t[:-1], w, FEATURES)
    with pytest.raises(CostModelError, match=r"6 columns but 5 feature names"):
        model.fit(X, t, w, FEATURES[:5])
    nan = X.copy()
    nan[3, 2] = np.nan
    with pytest.raises(CostModelError, match=r"X must be finite. Received nan at row 3, column 2"):
        model.fit(nan, t, w, FEATURES)
    inf = t.copy()
    inf[4] = np.inf
    with pytest.raises(CostModelError, match=r"step_times must be finite. Received inf at row 4"):
        model.fit(X, inf, w, FEATURES)
    zero = t.copy()
    zero[5] = 0.0
    with pytest.raises(CostModelError, match=r"positive seconds. Received 0.0 at row 5"):
        model.fit(X, zero, w, FEATURES)
    with pytest.raises(CostModelError, match="must be 2-D"):
        model.fit(X[0], t, w, FEATURES)
    with pytest.raises(CostModelError, match=r"unique. Received duplicates: \['x0'\]"):
        model.fit(X, t, w, ["x0"] * 6)
    with pytest.raises(CostModelError, match="not a single string"):
        model.fit(X[:1], t[:1], "w", FEATURES)
    with pytest.raises(CostModelError, match="needs at least one workload with two trials"):
        model.fit(X[:3], t[:3], ["a", "b", "c"], FEATURES)
    with pytest.raises(CostModelError, match="regressor needs at least 2 rows"):
        CostModel("regressor").fit(X[:1], t[:1], ["a"], FEATURES)
    assert not model.is_fitted


def test_constructor_and_predict_reject_bad_input(ranker):
    with pytest.raises(CostModelError, match=r"kind must be one of \['ranker', 'regressor', "
                                             r"'residual'\]. Received: 'classifier'"):
        CostModel("classifier")
    with pytest.raises(CostModelError, match=r"may not set \['objective'\]"):
        CostModel(params={"objective": "binary"})
    with pytest.raises(CostModelError, match="num_boost_round must be a positive integer"):
        CostModel(num_boost_round=0)
    with pytest.raises(CostModelError, match="not trained; call fit first"):
        CostModel().predict(np.zeros((1, 6)))
    with pytest.raises(CostModelError, match="X has 5 columns; the model was trained with 6"):
        ranker.predict(np.zeros((2, 5)))
    assert ranker.predict(np.zeros((0, 6))).shape == (0,)


# ------------------------------------------------------ leave one group out
def test_leave_one_group_out_reports_each_held_out_group():
    parts = [synthetic(6, 15, seed=10 + k, prefix=f"m{k}_") for k in range(3)]
    X = np.concatenate([p[0] for p in parts])
    t = np.concatenate([p[1] for p in parts])
    w = [name for p in parts for name in p[2]]
    groups = [f"model{k}" for k, p in enumerate(parts) for _ in p[1]]
    results = leave_one_group_out(X, t, w, groups, FEATURES,
                                  make_model=lambda: CostModel(num_boost_round=50))
    assert list(results) == ["model0", "model1", "model2"]
    for metrics in results.values():
        assert metrics["num_rows"] == 90 and metrics["num_train_rows"] == 180
        assert metrics["pairwise_accuracy"] > 0.8, results
    with pytest.raises(CostModelError, match="lies in groups 'model0' and 'model1'"):
        leave_one_group_out(X, t, w, ["model0"] * 89 + ["model1"] * 181, FEATURES)
    with pytest.raises(CostModelError, match="at least 2 groups"):
        leave_one_group_out(X, t, w, ["one"] * len(t), FEATURES)


def test_refining_a_trained_model_keeps_what_it_learned(ranker, test_data):
    # A few trials of one new workload: a model of those alone ranks other
    # workloads worse than the trained model refined with them.
    X, t, w = synthetic(1, 12, seed=7)
    alone = CostModel("ranker", num_boost_round=100).fit(X, t, w, FEATURES)
    refined = CostModel("ranker", num_boost_round=100).fit(X, t, w, FEATURES, init_model=ranker)
    assert refined._booster.num_trees() > ranker._booster.num_trees()
    Xt, tt, wt = test_data
    assert pairwise_accuracy(refined.predict(Xt), tt, wt) > \
        pairwise_accuracy(alone.predict(Xt), tt, wt) + 0.05
    with pytest.raises(CostModelError, match="init_model must be a fitted ranker"):
        CostModel("ranker").fit(X, t, w, FEATURES, init_model=CostModel("ranker"))


# --------------------------------------------------- the cost-model role
@pytest.fixture(scope="module")
def workload_simulator():
    from autodist.ir.resource_spec import ResourceSpec
    from autodist.search.simulator import Simulator
    from autodist.search.space import SearchSpace
    from tests.search import workloads

    gi = workloads.graph_item([("emb", (5000, 32), True), ("kernel", (256, 256), False)],
                              flops=1e8, lookups_per_example=4)
    spec = ResourceSpec.local(workers=2, ps=1, bandwidth_gbps=1)
    return gi, spec, Simulator(SearchSpace(gi, spec), batch_size=64)


def _records(gi, spec, simulator, n=12, seed=0):
    """n measured trials whose step time is the simulator's times a noisy factor."""
    from autodist.search.database import TrialRecord
    from autodist.search.features import featurize_strategy

    rng = np.random.default_rng(seed)
    out = []
    for candidate in simulator.space.sample(n, rng):
        strategy = simulator.space.decode(candidate)
        features = featurize_strategy(simulator, strategy)
        t = features["sim_step_time_s"] * float(rng.uniform(0.9, 1.1))
        out.append(TrialRecord.from_trial(gi, spec, strategy, step_times_s=(t, t),
                                          features=features))
    return out


def test_the_simulator_is_a_cost_model(workload_simulator, tmp_path):
    gi, spec, simulator = workload_simulator
    model = SimulatorCostModel()
    candidates = simulator.space.sample(20, np.random.default_rng(1))
    prediction = simulator.predict(candidates)
    np.testing.assert_array_equal(model.predict_candidates(simulator, candidates),
                                  prediction.step_time_s)
    assert model.name == "simulator" and model.predicts_seconds
    model.check_features(["anything"])            # reads no features
    # It learns nothing: what learns from its trials is a LightGBM regressor.
    learned = model.update(_records(gi, spec, simulator), seed=3)
    assert isinstance(learned, CostModel) and learned.kind == "regressor" and learned.is_fitted
    assert learned.name == "lightgbm-regressor" and learned.predicts_seconds
    assert learned.predict_candidates(simulator, candidates).shape == (20,)
    with pytest.raises(CostModelError, match="a regressor needs at least 2 rows"):
        model.update(_records(gi, spec, simulator)[:1])
    path = tmp_path / "simulator.json"
    SimulatorCostModel("ranker").save(path)
    loaded = load_cost_model(path)
    assert isinstance(loaded, SimulatorCostModel) and loaded.refit_kind == "ranker"
    with pytest.raises(CostModelError, match=r"refit_kind must be one of .* Received: 'x'"):
        SimulatorCostModel("x")


def test_a_learned_model_updates_from_itself(workload_simulator, ranker):
    gi, spec, simulator = workload_simulator
    assert ranker.name == "lightgbm-ranker" and not ranker.predicts_seconds
    records = _records(gi, spec, simulator)
    fresh = CostModel("ranker", num_boost_round=20).fit(
        *_rows(records), feature_names=list(FEATURE_NAMES))
    refined = fresh.update(records, seed=1)
    assert refined is not fresh and refined.kind == "ranker"
    assert refined._booster.num_trees() > fresh._booster.num_trees()
    # A model of other features starts afresh rather than failing.
    assert ranker.update(records).feature_names == list(FEATURE_NAMES)


def test_a_residual_model_is_a_cost_model(workload_simulator):
    gi, spec, simulator = workload_simulator
    records = _records(gi, spec, simulator, n=16)
    learned = SimulatorCostModel("residual").update(records, seed=2)
    assert learned.kind == "residual" and learned.name == "lightgbm-residual"
    candidates = simulator.space.sample(20, np.random.default_rng(4))
    prediction = simulator.predict(candidates)
    seconds = learned.predict_candidates(simulator, candidates, prediction)
    # The trials are the simulator's times 0.9..1.1: the residual stays near 1.
    ratio = seconds / prediction.step_time_s
    assert ((ratio > 0.85) & (ratio < 1.15)).all(), ratio
    refined = learned.update(records, seed=2)                # continues from itself
    assert refined.kind == "residual"
    assert refined._booster.num_trees() > learned._booster.num_trees()


def _rows(records):
    from autodist.search.predictor import training_rows

    x, y, workloads = training_rows(records)
    return x, y, workloads


def test_resolve_cost_model_accepts_what_optimize_accepts(ranker, tmp_path):
    assert resolve_cost_model(ranker) is ranker
    assert isinstance(resolve_cost_model("simulator"), SimulatorCostModel)
    shipped = shipped_cost_model()
    default = resolve_cost_model(None)   # the shipped defaults: ranking + measured search
    assert isinstance(default.ranking, CostModel if shipped is not None else SimulatorCostModel)
    assert default.name == default.ranking.name
    ranker.save(tmp_path / "m.json")
    assert resolve_cost_model(str(tmp_path / "m.json")).kind == "ranker"
    assert resolve_cost_model(tmp_path / "m.json").kind == "ranker"
    with pytest.raises(CostModelError, match="cannot read cost model file"):
        resolve_cost_model(tmp_path / "missing.json")
    with pytest.raises(CostModelError, match="cost_model must be a Predictor.*Received: int"):
        resolve_cost_model(3)


# ------------------------------------------------------------- damaged files
def test_a_damaged_model_text_is_caught_before_lightgbm_reads_it(ranker, tmp_path):
    path = tmp_path / "model.json"
    ranker.save(path)
    doc = json.loads(path.read_text())
    assert doc["model_sha256"] == hashlib.sha256(doc["model"].encode()).hexdigest()
    doc["model"] = doc["model"].replace("leaf_value=", "leaf_valuf=", 1)   # one flipped bit
    path.write_text(json.dumps(doc))
    with pytest.raises(CostModelError, match="is damaged: the model text's sha256 is [0-9a-f]{64}"
                                             ", the file records '[0-9a-f]{64}'"):
        CostModel.load(path)


def test_a_file_without_a_checksum_loads_only_unverified(ranker, test_data, tmp_path):
    doc = json.loads(ranker.to_json())
    del doc["model_sha256"]
    doc["version"] = 1                     # as autodist wrote it before checksums
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(CostModelError, match="has no model checksum .*verify=False"):
        CostModel.load(path)
    X, _, _ = test_data
    old = CostModel.load(path, verify=False)
    np.testing.assert_array_equal(old.predict(X), ranker.predict(X))
    old.save(path)                         # saved again: verified from now on
    CostModel.load(path)


@pytest.mark.parametrize("field, value, match", [
    ("train_params", {"num_threads": 2 ** 31}, r"num_threads must be an integer in \[1, 1024\]"),
    ("params", ["not", "a", "dict"], "params must be a JSON object"),
    ("feature_names", 7, "feature_names must be a sequence of names. Received: 7"),
    ("kind", ["ranker"], r"kind must be one of \['ranker', 'regressor', 'residual'\]"),
    ("kind", "residual", r"a residual model needs the feature 'sim_step_time_s'. "
                         r"Received feature_names: \['x0', 'x1', 'x2', 'x3', 'x4', 'log_scale'\]"),
    ("version", 10 ** 30, "newer than"),
])
def test_malformed_metadata_is_named(ranker, tmp_path, field, value, match):
    doc = json.loads(ranker.to_json())
    doc[field] = value
    path = tmp_path / "model.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(CostModelError, match=match):
        CostModel.load(path)
