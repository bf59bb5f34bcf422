"""The trial data set's pure parts, without a cluster (`autodist.bench.trials`, `.shipping`).

The collector's side (benchmarks/collect_trials.py): cluster shapes,
candidate selection and the records it writes, failures included. The
trainer's side (benchmarks/train_cost_model.py): reading plain and gzip
databases, rescoring, its metrics and the decision to ship. How a launch's
step times are sliced and failed launches fall back is the runner's
(tests/runtime/test_runner.py).
"""
from __future__ import annotations

import gzip

import numpy as np
import pytest

from autodist.bench import shipping, trials
from autodist.ir.resource_spec import ResourceSpec
from autodist.search import builders, metrics
from autodist.search.database import Database, TrialRecord, workload_key
from autodist.search.features import FEATURE_NAMES, featurize_strategy
from autodist.search.measurement import MeasureResult
from autodist.search.simulator import Simulator
from autodist.search.space import SearchSpace
from tests.doubles import LaunchCountingRunner


def test_shape_parse():
    assert trials.Shape.parse("2x1@100") == trials.Shape(2, 1, 100.0)
    assert str(trials.Shape.parse("3X2@1e4")) == "3x2@10000"
    for bad in ("2x1", "2@100", "axb@1", "0x1@100", "2x1@0"):
        with pytest.raises(ValueError, match="shape"):
            trials.Shape.parse(bad)


@pytest.fixture(scope="module")
def workload(mlp_item):
    spec = ResourceSpec.local(workers=2, ps=1)
    space = SearchSpace(mlp_item, spec)
    return mlp_item, spec, space, Simulator(space, None, batch_size=64)


def test_candidates_are_seeded_distinct_and_start_with_builders(workload):
    gi, spec, space, _ = workload
    first = trials.candidate_strategies(gi, spec, space, 20, seed=1)
    again = trials.candidate_strategies(gi, spec, space, 20, seed=1)
    assert [k for _, _, k in first] == [k for _, _, k in again]
    assert len(first) == 20 and len({k for _, _, k in first}) == 20
    origins = [o for o, _, _ in first]
    n_builders = sum(o != "sample" for o in origins)
    assert set(origins[:n_builders]) <= set(builders.STRATEGY_BUILDERS)
    assert origins[n_builders:] == ["sample"] * (20 - n_builders)
    for _, strategy, key in first:
        assert tuple(space.encode(strategy)) == key
    skipped = trials.candidate_strategies(gi, spec, space, 20, seed=1,
                                          skip={k for _, _, k in first})
    assert not {k for _, _, k in skipped} & {k for _, _, k in first}
    # Builders that cannot build for the workload are reported, not dropped silently.
    no_ps = ResourceSpec.from_dict({"nodes": [
        {"address": "localhost", "cpus": [0], "roles": ["worker"], "chief": True},
        {"address": "127.0.0.2", "cpus": [0], "roles": ["worker"]}]})
    errors: dict[str, str] = {}
    found = trials.candidate_strategies(gi, no_ps, SearchSpace(gi, no_ps), 5, seed=1,
                                        on_builder_error=errors.__setitem__)
    assert {"PS", "PartitionedPS"} <= set(errors) and "AllReduce" not in errors
    assert all(name not in errors for name, _, _ in found)


def test_records_round_trip_and_resume(tmp_path, workload):
    gi, spec, space, simulator = workload
    strategy = builders.PS().build(gi, spec)
    features = featurize_strategy(simulator, strategy)
    assert list(features) == list(FEATURE_NAMES)
    extra = {"command": "python benchmarks/collect_trials.py --seed 3", "shape": "2x1@100"}
    measured = MeasureResult((0.2, 0.1, 0.3), None, (0.9, 0.4), switch_s=0.5, launch_size=3)
    ok = trials.make_record(gi, spec, strategy, measured, model_key="mlp", batch_size=64,
                            features=features, predicted_s=0.12, extra=extra)
    # A failed result's step times are never recorded.
    failed = trials.make_record(gi, spec, strategy,
                                MeasureResult((0.2,), "AutodistError: no", launch_size=1),
                                model_key="mlp", batch_size=64, features=features,
                                predicted_s=0.12, extra=extra)
    db = Database(tmp_path / "trials.jsonl")
    db.extend([ok, failed])
    got_ok, got_failed = db.records()
    assert got_ok.ok and got_ok.median_step_time_s == pytest.approx(0.2)
    assert got_ok.origin == "PS" and got_ok.model_name == "mlp"
    assert got_ok.graph_summary["batch_size"] == 64.0
    assert got_ok.extra["switch_s"] == 0.5 and got_ok.extra["warmup_step_times_s"] == [0.9, 0.4]
    assert got_ok.extra["command"].endswith("--seed 3")
    assert not got_failed.ok and got_failed.step_times_s == ()
    assert got_failed.error == "AutodistError: no" and "switch_s" not in got_failed.extra
    assert trials.record_key(got_ok) == (got_ok.workload, 64.0)
    keys = trials.measured_keys(db.records(), got_ok.workload, 64, space)
    assert keys == {tuple(space.encode(strategy))}
    assert trials.measured_keys(db.records(), got_ok.workload, 128, space) == set()

    # The trainer reads the same records from a gzip-compressed copy.
    packed = tmp_path / "trials.jsonl.gz"
    packed.write_bytes(gzip.compress(db.path.read_bytes() + b"torn"))
    records, skipped = trials.read_records(packed)
    assert [r.to_json_dict() for r in records] == [got_ok.to_json_dict(),
                                                   got_failed.to_json_dict()]
    assert skipped == 1
    rows = trials.Rows(records, FEATURE_NAMES)
    assert rows.X.shape == (1, len(FEATURE_NAMES)) and rows.times.tolist() == [0.2]
    assert rows.workloads == [f"{got_ok.workload}@64"] and rows.simulator.tolist() == [0.12]
    with pytest.raises(FileNotFoundError, match="collect_trials"):
        trials.read_records(tmp_path / "missing.jsonl")


def test_repeated_launches_pool_steps_and_alternate_order():
    runner = LaunchCountingRunner()
    out = trials.measure_repeated(runner, ["a", "b", "c"], repeats=3)
    assert runner.orders == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    (a, a_medians), (b, b_medians), _ = out
    assert a.step_times_s == pytest.approx((0.1, 0.1, 0.11, 0.11, 0.12, 0.12))
    assert a_medians == pytest.approx([0.1, 0.11, 0.12])
    # A failed launch drops out of the pool; the others still count.
    assert b.ok and b.step_times_s == pytest.approx((0.2, 0.2, 0.22, 0.22))
    assert b_medians == pytest.approx([0.2, 0.22])
    with pytest.raises(ValueError, match="repeats must be >= 1. Received: 0"):
        trials.measure_repeated(runner, ["a"], repeats=0)


def test_trainer_metrics():
    actual = np.array([1.0, 1.05, 2.0, 1.0, 3.0])
    workloads = ["a", "a", "a", "b", "b"]
    pred = np.array([3.0, 2.0, 1.0, 0.0, 1.0])      # workload a reversed, b right
    # pairs > 10% apart: (1.0, 2.0), (1.05, 2.0) in a (both wrong), (1.0, 3.0) in b (right)
    assert metrics.significant_pairwise_accuracy(pred, actual, workloads) == pytest.approx(1 / 3)
    # a: ranks 2.0 first (2x the best); b: ranks the best first
    assert metrics.top1_slowdown(pred, actual, workloads) == pytest.approx(2 ** 0.5)
    m = shipping.ranking_metrics(pred, actual, workloads)
    assert m["pairwise"] == pytest.approx(1 / 4) and m["tau"] == pytest.approx(0.0)


def test_trainer_ships_only_what_ranks_about_as_well_as_the_simulator():
    def results(reg, rank, sim, top1=(1.05, 1.05, 1.05), resid=None):
        out = {"m": {"regressor": {"pairwise": reg, "top1": top1[0]},
                     "ranker": {"pairwise": rank, "top1": top1[1]},
                     "simulator": {"pairwise": sim, "top1": top1[2]}}}
        if resid is not None:
            out["m"]["residual"] = {"pairwise": resid[0], "top1": resid[1]}
        return out

    assert shipping.choose(results(0.70, 0.75, 0.755), 0.01)[0] == "ranker"
    assert shipping.choose(results(0.80, 0.75, 0.70), 0.01)[0] == "regressor"
    kind, why = shipping.choose(results(0.60, 0.65, 0.70), 0.01)
    assert kind == "simulator" and "nothing shipped" in why
    # A better order whose first pick is slower does not ship.
    assert shipping.choose(results(0.80, 0.75, 0.70, (1.15, 1.04, 1.10)), 0.01)[0] == "ranker"
    kind, why = shipping.choose(results(0.80, 0.75, 0.70, (1.15, 1.16, 1.10)), 0.01)
    assert kind == "simulator" and "top-1 slowdown" in why
    # The residual model ships on the same rule, and only on it.
    assert shipping.choose(results(0.80, 0.75, 0.70, (1.15, 1.16, 1.10), (0.72, 1.09)),
                           0.01)[0] == "residual"
    kind, why = shipping.choose(results(0.68, 0.67, 0.656, (1.14, 1.15, 1.10), (0.70, 1.12)),
                                0.01)
    assert kind == "simulator" and "residual 0.700 / 1.12; simulator 0.656 / 1.10" in why


def test_trainer_ships_nothing_whose_first_choices_lose_on_a_cluster_shape():
    """A mean won on one cluster shape and lost on another does not ship (the
    1200-trial data set: the regressor won 6x3 and lost 2x2, and picked a 2x slower
    strategy than all-reduce for NCF on 2 workers + 2 PS at 1 Gbit/s)."""
    results = {"m": {"regressor": {"pairwise": 0.70, "top1": 1.11},
                     "ranker": {"pairwise": 0.68, "top1": 1.14},
                     "simulator": {"pairwise": 0.61, "top1": 1.14}}}
    by_shape = {"2x2@1000": {"regressor": 1.125, "ranker": 1.152, "simulator": 1.104},
                "6x3@1000": {"regressor": 1.117, "ranker": 1.117, "simulator": 1.235}}
    assert shipping.choose(results, 0.01)[0] == "regressor"
    kind, why = shipping.choose(results, 0.01, by_shape)
    assert kind == "simulator"
    assert "regressor loses on 2x2@1000 1.125 vs 1.104" in why
    assert shipping.choose(results, 0.01, by_shape, shape_margin=0.05)[0] == "regressor"
    first = {"regressor": {"a": [1.2, 1.0], "b": [1.0, 1.0], "c": [1.5, 1.1]},
             "simulator": {"a": [1.0, 1.0], "b": [1.0, 1.0], "c": [1.0, 1.0]}}
    got = shipping.first_choices_by_shape(first, {"a": "2x1", "b": "2x1", "c": "4x2"})
    assert got["2x1"]["regressor"] == pytest.approx(1.2 ** 0.5)
    assert got["4x2"] == {"regressor": pytest.approx(1.5), "simulator": pytest.approx(1.0)}


def synthetic_rows(num_models: int = 3, workloads_per_model: int = 2, pool: int = 12,
                   seed: int = 0) -> trials.Rows:
    """Rows of trials whose time is the simulator's times a factor the features explain."""
    rng = np.random.default_rng(seed)
    records = []
    for m in range(num_models):
        for w in range(workloads_per_model):
            graph, spec = f"graph{m}", f"spec{w}"
            for _ in range(pool):
                features = dict(zip(FEATURE_NAMES, rng.uniform(0.1, 1.0, len(FEATURE_NAMES))))
                # The simulator sees little difference; the PS traffic it misses decides.
                simulated = features["sim_step_time_s"] = float(rng.uniform(0.9, 1.0))
                measured = simulated * np.exp(1.5 * features["ps_bytes"] + rng.normal(0, 0.02))
                records.append(TrialRecord(
                    workload=workload_key(graph, spec), graph_item_fingerprint=graph,
                    resource_spec_fingerprint=spec, model_name=f"m{m}",
                    graph_summary={"batch_size": 64.0}, resource_spec="", strategy=b"",
                    features=features, step_times_s=(float(measured),),
                    predicted_step_time_s=simulated))
    return trials.Rows(records, FEATURE_NAMES)


def _slowdowns(times, order, k_max):
    return [times[order[0]] / times.min()] + [times[order[:k]].min() / times.min()
                                              for k in range(1, k_max + 1)]


def test_few_shot_measures_each_models_top_k_and_picks_the_best_measured():
    rows = synthetic_rows()
    shots = shipping.few_shot(rows, max_trials=8, refit_min_trials=9, random_seeds=5)
    assert set(shots) == {"regressor", "ranker", "residual", "simulator", "random"}
    names = np.array(rows.workloads)
    for workload in dict.fromkeys(rows.workloads):
        idx = np.flatnonzero(names == workload)
        times = rows.times[idx]
        # The simulator measures its own top k.
        assert shots["simulator"][workload] == pytest.approx(
            _slowdowns(times, np.argsort(rows.simulator[idx], kind="stable"), 8))
        # Without refits, a learned model measures the pretrained model's top k.
        pretrained = shipping.train_without(rows, rows.models[idx[0]], "residual",
                                            FEATURE_NAMES)
        assert shots["residual"][workload] == pytest.approx(
            _slowdowns(times, np.argsort(pretrained.predict(rows.X[idx]), kind="stable"), 8))
        for predictor, slowdowns in shots.items():
            s = np.array(slowdowns[workload])
            assert len(s) == 9 and s[0] == s[1] and (s >= 1.0).all(), (predictor, s)
            assert (np.diff(s) <= 1e-12).all(), (predictor, s)
    # The residual model learns what the simulator misses; random draws do worst.
    means = {p: shipping.geometric_means(shots[p]) for p in shots}
    assert means["residual"][0] < means["simulator"][0]
    assert means["random"][3] > max(means[p][3] for p in shipping.PREDICTORS)


def test_few_shot_refits_as_the_tuner_does_after_enough_trials():
    rows = synthetic_rows(num_models=2, workloads_per_model=1)
    fixed = shipping.few_shot(rows, max_trials=6, refit_min_trials=7, random_seeds=2)
    refit = shipping.few_shot(rows, max_trials=6, refit_min_trials=2, random_seeds=2)
    for kind in shipping.LEARNED:
        for workload in refit[kind]:
            # The first refit follows the second trial: the first three picks agree.
            assert refit[kind][workload][:3] == fixed[kind][workload][:3]
    assert refit["simulator"] == fixed["simulator"]


def test_trainer_scores_stored_strategies_again_with_the_current_simulator():
    import keras

    from autodist import models
    from autodist.ir.capture import capture

    keras.backend.clear_session()
    gi = capture(models.build("mlp", hidden=(16,)))
    spec = ResourceSpec.local(workers=2, ps=1)
    strategy = builders.PartitionedPS(min_shard_bytes=64).build(gi, spec)
    stale = dict.fromkeys(FEATURE_NAMES, 0.0)
    record = trials.make_record(gi, spec, strategy,
                                MeasureResult((0.2, 0.1, 0.3), None, (0.9, 0.4)),
                                model_key="mlp", batch_size=64, features=stale,
                                predicted_s=0.5, extra={"model_kwargs": {"hidden": [16]}})
    failed = trials.make_record(gi, spec, strategy, MeasureResult((0.2,), "AutodistError: no"),
                                model_key="mlp", batch_size=64, features=stale,
                                predicted_s=0.5, extra={"model_kwargs": {"hidden": [16]}})
    fresh, kept = trials.rescore([record, failed])
    simulator = Simulator(SearchSpace(gi, spec), None, batch_size=64)
    want = featurize_strategy(simulator, strategy)
    assert fresh.features == pytest.approx(want)
    assert fresh.predicted_step_time_s == pytest.approx(want["sim_step_time_s"])
    assert fresh.step_times_s == record.step_times_s and kept is failed
    other = trials.make_record(gi, spec, strategy, MeasureResult((0.2,)), model_key="mlp",
                               batch_size=64, features=stale, predicted_s=0.5,
                               extra={"model_kwargs": {"hidden": [32]}})
    with pytest.raises(ValueError, match="captures to another graph"):
        trials.rescore([other])
