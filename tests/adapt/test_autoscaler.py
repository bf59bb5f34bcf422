"""The autoscaler's decisions on simulated, noise-free throughput curves.

Every expected size is worked out by hand in a comment; `_reference_knee`
re-derives the scaling-efficiency choice by the plain rule, independently of
the ladder walk.
"""
from __future__ import annotations

import math
import sys

import pytest

from autodist.ir.errors import AutodistError
from autodist.adapt.autoscaler import (Autoscaler, AutoscalerError, CostUtility, Decision,
                                         Heuristic, Observation, ScalingCurve,
                                         ScalingEfficiency, StragglerReplacement, settle,
                                         simulator_predictor, smoothed_worker_throughput)
from tests.doubles import comm_curve, flat, linear, peaked, saturating


# ------------------------------------------------------------------ curves
# batch 256, c = 2.4 s, a = 0.02 s, b = 0.08 s: 256 n / (0.1 n + 2.32) = 2560 n / (n + 23.2).
# The step n -> n+1 pays at theta 0.8 iff 23.2 / (n + 24.2) >= 0.8:
#   n = 4: 23.2 / 28.2 = 0.823 (pays);  n = 5: 23.2 / 29.2 = 0.795 (does not) -> 5 workers.
KNEE_5 = comm_curve(256, 2.4, 0.02, 0.08)
# m = 42: n = 9: 42 / 52 = 0.808 (pays); n = 10: 42 / 53 = 0.792 (does not) -> 10 workers.
KNEE_10 = saturating(1000.0, 42.0)
LINEAR = linear   # every step adds the average -> max_workers


def _reference_knee(curve, theta: float, lo: int, hi: int) -> int:
    """The rule itself: grow by one from `lo` while the step pays."""
    n = lo
    while n < hi and (curve(n + 1) - curve(n)) >= theta * curve(n) / n:
        n += 1
    return n


# ---------------------------------------------------------- scaling curve
def test_curve_takes_the_median_of_repeats():
    curve = ScalingCurve([Observation(2, 100.0), Observation(2, 300.0), Observation(2, 110.0),
                          Observation(1, 60.0)])
    assert curve.throughput(2) == 110.0          # one outlier does not move it
    assert curve.sizes() == [1, 2] and 2 in curve and 3 not in curve and len(curve) == 4
    assert curve.as_dict() == {1: 60.0, 2: 110.0}
    with pytest.raises(AutoscalerError, match=r"no throughput measured at 3 workers"):
        curve.throughput(3)


def test_scaling_efficiency_rule():
    h = ScalingEfficiency(theta=0.8)
    curve = ScalingCurve([Observation(2, 200.0), Observation(4, 360.0), Observation(6, 470.0)])
    # 2 -> 4: (360 - 200) / 2 = 80 per added worker >= 0.8 x 100 = 80: pays (equal counts).
    assert h.step_pays(curve, 2, 4)[0]
    # 4 -> 6: (470 - 360) / 2 = 55 < 0.8 x 90 = 72: does not.
    pays, why = h.step_pays(curve, 4, 6)
    assert not pays and "55" in why and "90" in why
    assert ScalingEfficiency(step=3).ladder(2, 10) == [2, 5, 8, 10]
    assert ScalingEfficiency(step=3).support(8, 2, 10) == (8, 5, 10)
    assert ScalingEfficiency().support(1, 1, 4) == (1, 2)


# ------------------------------------------------------- trial and error
@pytest.mark.parametrize("curve, theta, hi, expected", [
    (KNEE_5, 0.8, 16, 5),
    (KNEE_10, 0.8, 16, 10),
    (LINEAR, 0.8, 8, 8),     # grows to max_workers
    # 100n - 6n^2 at theta 0.5: the step n -> n+1 adds 94 - 12n, the average is 100 - 6n;
    # n = 4: 46 >= 38 pays; n = 5: 34 < 35 does not -> 5 (before the peak at 8).
    (peaked, 0.5, 12, 5),
    (flat, 0.8, 8, 1),       # 1 -> 2 adds nothing: stays at min_workers
])
def test_scaling_efficiency_picks_the_knee(curve, theta, hi, expected):
    assert _reference_knee(curve, theta, 1, hi) == expected
    result = Autoscaler(ScalingEfficiency(theta), 1, hi).run(curve)
    assert result.workers == expected and result.decision.done
    # Trial and error from 1 measures 1..expected and the failing step after it.
    assert [t.workers for t in result.trials] == list(range(1, min(expected + 1, hi) + 1))
    assert result.num_trials == len(result.trials) and result.mode == "trial-and-error"
    assert all(t.throughput == pytest.approx(curve(t.workers)) for t in result.trials)


def test_trial_and_error_from_above_the_knee_walks_down():
    result = Autoscaler(ScalingEfficiency(0.8), 1, 16).run(KNEE_5, start=8)
    assert result.workers == 5
    # 8, then 7 (7 -> 8 fails), 6, 5, and 4 to check the step into 5.
    assert [t.workers for t in result.trials] == [8, 7, 6, 5, 4]


def test_trial_and_error_from_below_the_knee_checks_the_start():
    result = Autoscaler(ScalingEfficiency(0.8), 1, 16).run(KNEE_5, start=3)
    assert result.workers == 5
    assert [t.workers for t in result.trials] == [3, 2, 4, 5, 6]


def test_growth_step_and_bounds():
    # Ladder 2, 4, 6, 8 on 2560 n / (n + 23.2): 2 -> 4 adds (398.0 - 204.7) / 2 = 96.7
    # >= 0.8 x 102.4; 4 -> 6 adds (555.2 - 398.0) / 2 = 78.6 < 0.8 x 99.5 = 79.6 -> 4.
    result = Autoscaler(ScalingEfficiency(0.8, step=2), 2, 8).run(KNEE_5)
    assert result.workers == 4 and [t.workers for t in result.trials] == [2, 4, 6]
    # Capped: the knee at 10 is above max_workers 7.
    assert Autoscaler(ScalingEfficiency(0.8), 1, 7).run(KNEE_10).workers == 7
    assert Autoscaler(ScalingEfficiency(0.8), 3, 3).run(KNEE_10).num_trials == 1


def test_repeats_measure_each_size_several_times():
    calls = []

    def measure(n):
        calls.append(n)
        return KNEE_5(n) * (2.0 if len(calls) % 3 == 0 else 1.0)   # every third is an outlier

    result = Autoscaler(ScalingEfficiency(0.8), 1, 16, repeats=3).run(measure)
    assert result.workers == 5 and result.num_trials == 18      # 6 sizes x 3
    assert result.curve.throughput(5) == pytest.approx(KNEE_5(5))


def test_cost_utility_picks_the_argmax():
    # U(n) = 1.0 x T x 3600 / 1e6 - 7.2 n = 0.0036 (T - 2000 n) with T = 10000 n - 600 n^2:
    # T - 2000n = 8000 n - 600 n^2: 26400 at 6, 26600 at 7, 25600 at 8 -> 7,
    # below the throughput's own peak at 8.3.
    h = CostUtility(worker_cost_per_hour=7.2, value_per_million_examples=1.0)

    def curve(n):
        return 10000.0 * n - 600.0 * n * n

    argmax = max(range(1, 13), key=lambda n: h.utility(n, curve(n)))
    assert argmax == 7
    assert h.utility(7, curve(7)) == pytest.approx(0.0036 * 26600)
    result = Autoscaler(h, 1, 12).run(curve)
    assert result.workers == 7 and result.num_trials == 8
    # Free workers: utility grows with throughput, so it climbs to the throughput peak.
    assert Autoscaler(CostUtility(0.0, 1.0), 1, 12).run(curve).workers == 8


# ------------------------------------------------------------ stragglers
def _observations(rows):
    return [Observation(len(row), sum(row), dict(enumerate(row))) for row in rows]


def test_straggler_flags_the_persistently_slow_worker_not_a_one_off_dip():
    rows = [[100.0, 100.0, 50.0, 100.0]] * 5 + [[100.0, 30.0, 50.0, 100.0]]
    curve = ScalingCurve(_observations(rows))
    smoothed = smoothed_worker_throughput(curve.observations(4), 0.3)
    # Worker 1: 100 five times then 30: 0.3 x 30 + 0.7 x 100 = 79 >= 0.7 x median.
    assert smoothed[1] == pytest.approx(79.0)
    assert smoothed[2] == pytest.approx(50.0)
    # Median of (100, 79, 50, 100) = 89.5; limit 62.65: only worker 2 is below.
    decision = StragglerReplacement(threshold=0.7, smoothing=0.3).next_size(curve, 4, 1, 8)
    assert decision == Decision(4, decision.reason, done=True, replace=(2,))
    assert "worker 2" in decision.reason and "worker 1" not in decision.reason
    # Without smoothing the dip alone (30 < 0.7 x 75) would flag worker 1 too.
    unsmoothed = StragglerReplacement(threshold=0.7, smoothing=1.0).next_size(curve, 4, 1, 8)
    assert unsmoothed.replace == (1, 2)


def test_straggler_through_the_autoscaler_keeps_the_size():
    def measure(n):
        rates = {i: (40.0 if i == 3 else 100.0) for i in range(n)}
        return Observation(n, sum(rates.values()), rates)

    result = Autoscaler(StragglerReplacement(), 1, 8, repeats=3).run(measure, start=6)
    assert result.workers == 6 and result.replace == (3,) and result.num_trials == 3
    healthy = StragglerReplacement().next_size(ScalingCurve([Observation(2, 10.0)]), 2, 1, 4)
    assert healthy.done and healthy.replace == () and "no per-worker" in healthy.reason


# ------------------------------------------------------------ guided mode
GUIDED_CASES = [
    ("comm-bound, knee 5", ScalingEfficiency(0.8), 16, KNEE_5, 5),
    ("saturating, knee 10", ScalingEfficiency(0.8), 16, KNEE_10, 10),
    ("linear", ScalingEfficiency(0.8), 8, LINEAR, 8),
    ("peaked", ScalingEfficiency(0.5), 12, peaked, 5),
    ("cost/utility", CostUtility(7.2, 1.0), 12, lambda n: 10000.0 * n - 600.0 * n * n, 7),
]


@pytest.mark.parametrize("name, heuristic, hi, curve, expected", GUIDED_CASES,
                         ids=[c[0] for c in GUIDED_CASES])
def test_guided_mode_needs_fewer_trials_with_a_good_prediction(name, heuristic, hi, curve,
                                                               expected):
    scaler = Autoscaler(heuristic, 1, hi)
    plain = scaler.run(curve)
    guided = scaler.run_guided(curve, predict=curve)
    print(f"\n{name}: trial-and-error {plain.num_trials} trials, guided {guided.num_trials} "
          f"trials, both -> {guided.workers}")
    assert plain.workers == guided.workers == expected and guided.mode == "guided"
    assert guided.num_trials < plain.num_trials
    # A right prediction costs only the target and its ladder neighbours.
    assert sorted(t.workers for t in guided.trials) == sorted(
        heuristic.support(expected, 1, hi))


@pytest.mark.parametrize("name, real, predicted, hi, expected", [
    # Off by 3x, knee predicted at 5, real at 10.
    ("knee later than predicted", KNEE_10, saturating(3000.0, 23.2), 16, 10),
    # Off by 1/3x, knee predicted at 10, real at 5.
    ("knee earlier than predicted", KNEE_5, saturating(333.0, 42.0), 16, 5),
    # Predicted at 3 (m = 16: n = 2: 16/19 = 0.84 pays; n = 3: 16/20 = 0.8 pays;
    # n = 4: 16/21 = 0.76 does not -> 4), real at 10, over 32 sizes.
    ("knee far off, wide range", KNEE_10, saturating(3000.0, 16.0), 32, 10),
    # Predicted to saturate (knee 5) while the real curve is linear.
    ("linear predicted to saturate", LINEAR, KNEE_5, 8, 8),
])
def test_guided_mode_with_a_wrong_prediction_still_ends_right(name, real, predicted, hi,
                                                              expected):
    scaler = Autoscaler(ScalingEfficiency(0.8), 1, hi)
    plain = scaler.run(real)
    guided = scaler.run_guided(real, predict=predicted)
    print(f"\n{name}: trial-and-error {plain.num_trials} trials, guided {guided.num_trials} "
          f"({[t.workers for t in guided.trials]}, targets {guided.targets})")
    assert settle(scaler.heuristic, predicted, 1, hi).workers != expected   # really wrong
    assert plain.workers == guided.workers == expected
    assert guided.num_trials <= plain.num_trials
    assert len({t.workers for t in guided.trials}) == guided.num_trials   # nothing twice


def test_guided_cost_utility_corrects_the_scale():
    # Utility is not scale-free: a prediction at half the throughput first points at 5.
    h = CostUtility(7.2, 1.0)

    def real(n):
        return 10000.0 * n - 600.0 * n * n

    assert settle(h, lambda n: 0.5 * real(n), 1, 12).workers == 5
    guided = Autoscaler(h, 1, 12).run_guided(real, predict=lambda n: 0.5 * real(n))
    assert guided.workers == 7 and guided.targets[0] == 5
    assert guided.num_trials < Autoscaler(h, 1, 12).run(real).num_trials


def test_guided_mode_falls_back_to_trial_and_error_after_max_rounds():
    scaler = Autoscaler(ScalingEfficiency(0.8), 1, 16)
    guided = scaler.run_guided(KNEE_10, predict=saturating(1.0, 23.2), max_rounds=1)
    assert guided.workers == 10 and guided.targets == [5]


# ------------------------------------------------------------ bad input
@pytest.mark.parametrize("make, match", [
    (lambda: ScalingEfficiency(theta=0.0), r"theta must be in \(0, 1\]. Received: 0.0"),
    (lambda: ScalingEfficiency(theta=1.5), r"Received: 1.5"),
    (lambda: ScalingEfficiency(theta=float("nan")), r"theta must be a finite number. "
                                                    r"Received: nan"),
    (lambda: ScalingEfficiency(step=0), r"step must be an integer >= 1. Received: 0"),
    (lambda: CostUtility(-1.0, 1.0), r"worker_cost_per_hour must be >= 0. Received: -1.0"),
    (lambda: CostUtility(1.0, 0), r"value_per_million_examples must be > 0. Received: 0"),
    (lambda: StragglerReplacement(threshold=1.0), r"threshold must be in \(0, 1\). "
                                                  r"Received: 1.0"),
    (lambda: StragglerReplacement(smoothing=0.0), r"smoothing must be in \(0, 1\]. "
                                                  r"Received: 0.0"),
    (lambda: Autoscaler(ScalingEfficiency(), 5, 3), r"min_workers must be <= max_workers. "
                                                    r"Received: min_workers=5, max_workers=3"),
    (lambda: Autoscaler(ScalingEfficiency(), 0, 3), r"min_workers must be an integer >= 1. "
                                                    r"Received: 0"),
    (lambda: Autoscaler("efficiency", 1, 3), r"heuristic must be a Heuristic. "
                                             r"Received: 'efficiency'"),
    (lambda: Autoscaler(ScalingEfficiency(), 1, 3, repeats=0), r"repeats .* Received: 0"),
    (lambda: Autoscaler(ScalingEfficiency(), 1, 4).run(LINEAR, start=9),
     r"current size must be an integer in \[1, 4\]. Received: 9"),
    (lambda: Autoscaler(ScalingEfficiency(), 1, 4).run(lambda n: 0.0),
     r"measure\(1\) must be > 0 examples/s. Received: 0.0"),
    (lambda: Autoscaler(ScalingEfficiency(), 1, 4).run(lambda n: -5.0 if n == 2 else 1.0),
     r"measure\(2\) must be > 0 examples/s. Received: -5.0"),
    (lambda: Autoscaler(ScalingEfficiency(), 1, 4).run(lambda n: math.nan),
     r"measure\(1\) must be a finite number. Received: nan"),
    (lambda: Autoscaler(ScalingEfficiency(), 1, 4).run(lambda n: "fast"),
     r"measure\(1\) must be a finite number. Received: 'fast'"),
    (lambda: Autoscaler(ScalingEfficiency(), 1, 4).run(lambda n: Observation(n + 1, 1.0)),
     r"measure\(1\) returned an Observation of 2 workers"),
    (lambda: Autoscaler(ScalingEfficiency(), 1, 4).run_guided(LINEAR, lambda n: math.inf),
     r"predict\(1\) must be a finite number. Received: inf"),
    (lambda: Observation(2, 10.0, {0: -1.0}), r"throughput of worker 0 must be >= 0. "
                                             r"Received: -1.0"),
])
def test_bad_input_raises_a_clear_error(make, match):
    with pytest.raises(AutodistError, match=match):
        make()


def test_a_misbehaving_heuristic_is_stopped():
    class Cycles(Heuristic):
        def next_size(self, curve, current, min_workers, max_workers):
            return Decision(1 if current == 2 else 2, "back and forth")

    class Outside(Heuristic):
        def next_size(self, curve, current, min_workers, max_workers):
            return Decision(max_workers + 1, "more!")

    with pytest.raises(AutoscalerError, match=r"made no final decision in \d+ steps"):
        Autoscaler(Cycles(), 1, 4).run(LINEAR)
    with pytest.raises(AutoscalerError, match=r"chose 5 workers, outside \[1, 4\]"):
        Autoscaler(Outside(), 1, 4).run(LINEAR)


# ------------------------------------------------------ simulator curves
def test_simulator_predictor_curves():
    from autodist.ir.resource_spec import ResourceSpec
    from autodist.search.builders import PS, AllReduce
    from autodist.search.simulator import Calibration, Simulator
    from autodist.search.space import SearchSpace
    from tests.search import workloads

    # 8 dense 2048 x 2048 float32 variables: 128 MiB of gradients; 5e9 FLOPs at batch 10.
    gi = workloads.graph_item([(f"w{i}", (2048, 2048), False) for i in range(8)], flops=5e9)
    cal = Calibration()
    sizes = range(1, 17)
    slow = simulator_predictor(gi, AllReduce().build, global_batch=512, bandwidth_gbps=1.0,
                               calibration=cal)
    fast = simulator_predictor(gi, AllReduce().build, global_batch=512, bandwidth_gbps=100.0,
                               calibration=cal)
    t_slow = [slow(n) for n in sizes]
    t_fast = [fast(n) for n in sizes]
    # One worker: no communication, the same compute either way.
    assert t_slow[0] == pytest.approx(t_fast[0])
    # At 1 Gbit/s the ring's 2(W-1)/W x 128 MiB caps the throughput: increasing, ever
    # smaller gains, and below batch / (2 x 15/16 x bytes / bandwidth) at 16 workers.
    gains = [b - a for a, b in zip(t_slow, t_slow[1:])]
    assert all(g > 0 for g in gains) and all(b < a for a, b in zip(gains, gains[1:]))
    ring_s = 2 * 15 / 16 * gi.total_variable_bytes / (1e9 / 8)
    assert t_slow[-1] < 512 / ring_s
    assert t_slow[-1] / t_slow[7] < 1.25
    # At 100 Gbit/s it scales almost linearly.
    assert t_fast[-1] / t_fast[0] > 14
    scaler = Autoscaler(ScalingEfficiency(0.8), 1, 16)
    assert scaler.run(slow).workers < scaler.run(fast).workers == 16
    # One parameter server at 1 Gbit/s: its link is the bottleneck, throughput peaks early.
    ps = simulator_predictor(gi, PS().build, global_batch=512, ps=1, bandwidth_gbps=1.0,
                             calibration=cal)
    t_ps = [ps(n) for n in range(1, 9)]
    peak = t_ps.index(max(t_ps))
    assert 0 < peak < 7 and t_ps[-1] < t_ps[peak]
    # The simulator's curve as a prediction for itself: the guided mode's best case.
    guided = scaler.run_guided(slow, predict=slow)
    plain = scaler.run(slow)
    assert guided.workers == plain.workers and guided.num_trials <= plain.num_trials
    with pytest.raises(AutoscalerError, match=r"more than global_batch 512"):
        slow(513)
    # The predictor's lean search space scores exactly as the full one.
    spec = ResourceSpec.local(workers=4, ps=0, bandwidth_gbps=1.0)
    full = Simulator(SearchSpace(gi, spec), cal, batch_size=512)
    step_s = full.predict_strategy(AllReduce().build(gi, spec)).step_time_s[0]
    assert slow(4) == pytest.approx(512 / step_s, rel=1e-12)
    # Workers sharing a 2-core host: beyond 2 workers compute stops shrinking.
    shared = simulator_predictor(gi, AllReduce().build, global_batch=512, bandwidth_gbps=100.0,
                                 calibration=cal, host_cores=2)
    assert shared(2) == pytest.approx(fast(2))
    compute_4 = full.predict_strategy(AllReduce().build(gi, spec)).parts["compute_s"][0]
    assert 512 / shared(4) == pytest.approx(512 / fast(4) + compute_4 * (4 / 2 - 1))


def test_simulator_predictor_with_a_cost_model():
    pytest.importorskip("lightgbm")
    from autodist.ir.resource_spec import ResourceSpec
    from autodist.search.builders import AllReduce
    from autodist.search.cost_model import CostModel
    from autodist.search.features import FEATURE_NAMES, featurize_strategy
    from autodist.search.simulator import Simulator
    from autodist.search.space import SearchSpace
    from tests.search import workloads

    gi = workloads.graph_item([("w", (512, 512), False)], flops=1e8)

    def features_and_time(n):
        spec = ResourceSpec.local(workers=n, bandwidth_gbps=1.0)
        sim = Simulator(SearchSpace(gi, spec), batch_size=64)
        strategy = AllReduce().build(gi, spec)
        row = featurize_strategy(sim, strategy)
        return [row[name] for name in FEATURE_NAMES], row["sim_step_time_s"]

    rows, times = zip(*(features_and_time(n) for n in range(1, 9)))
    model = CostModel("regressor", params={"min_data_in_leaf": 1, "min_data_in_bin": 1},
                      num_boost_round=20).fit(list(rows), list(times), ["w"] * 8, FEATURE_NAMES)
    predict = simulator_predictor(gi, AllReduce().build, global_batch=64, bandwidth_gbps=1.0,
                                  cost_model=model)
    # Same features through the predictor's lean space as through a full one.
    assert predict(3) == pytest.approx(64 / model.predict([rows[2]])[0], rel=1e-12)
    assert all(math.isfinite(predict(n)) and predict(n) > 0 for n in range(1, 9))
    with pytest.raises(AutoscalerError, match=r"fitted regressor"):
        simulator_predictor(gi, AllReduce().build, global_batch=64,
                            cost_model=CostModel("ranker"))
    with pytest.raises(AutoscalerError, match=r"fitted regressor"):
        simulator_predictor(gi, AllReduce().build, global_batch=64,
                            cost_model=CostModel("ranker"))
    with pytest.raises(AutoscalerError, match=r"fitted regressor"):
        simulator_predictor(gi, AllReduce().build, global_batch=64,
                            cost_model=CostModel("regressor"))


def test_module_imports_no_tensorflow():
    import subprocess
    code = ("import sys, autodist.adapt.autoscaler; "
            "print('tensorflow' in sys.modules, 'autodist.search.simulator' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.split() == ["False", "False"]
