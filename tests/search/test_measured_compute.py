"""The simulator with a model's compute measured on the cluster instead of estimated."""
from __future__ import annotations

import math

import pytest

from autodist.ir.errors import InvalidArgumentError
from autodist.ir.resource_spec import ResourceSpec
from autodist.search.measured_compute import MeasuredCompute
from autodist.search.simulator import Calibration, Simulator
from autodist.search.space import SearchSpace
from autodist.search.tuner import Tuner
from tests.search import workloads

CAL = Calibration(flops_per_s=1e9, op_overhead_s=1e-5, latency_s=1e-4,
                  memory_bytes_per_s=1e9, host_cores=1)


def _space() -> SearchSpace:
    # 1e6 FLOPs at batch 10; 2 CPU replicas on one host of 1 core (shared).
    return SearchSpace(workloads.graph_item([("w", (1000, 250), False)], flops=1e6),
                       ResourceSpec.local(workers=2, ps=1, bandwidth_gbps=8))


def test_measured_compute_replaces_the_estimate_scaled_to_the_batch():
    space = _space()
    estimated = Simulator(space, CAL, batch_size=40)
    measured = Simulator(space, CAL, batch_size=40,
                         measured_compute=MeasuredCompute(0.004, 10))
    # Measured at 10 examples a replica, asked at 20: twice the time; no op runs on top.
    assert measured.compute_s == pytest.approx(0.008)
    assert measured.op_runs == 0.0 and estimated.op_runs > 0
    candidate = [[0, 0]]
    a, b = estimated.predict(candidate), measured.predict(candidate)
    assert b.parts["compute_s"][0] == pytest.approx(0.008)
    # The rest of the prediction is the same model of the same strategy.
    for part in ("bandwidth_s", "latency_s", "update_s", "sync_s"):
        assert b.parts[part][0] == pytest.approx(a.parts[part][0]), part
    assert a.parts["compute_s"][0] != pytest.approx(0.008)


@pytest.mark.parametrize("seconds,examples,field", [
    (0.0, 8, "seconds"), (-1.0, 8, "seconds"), (math.nan, 8, "seconds"),
    (0.01, 0, "examples"), (0.01, math.inf, "examples"), (True, 8, "seconds")])
def test_a_bad_measurement_is_named(seconds, examples, field):
    with pytest.raises(InvalidArgumentError, match=f"MeasuredCompute.{field} must be a "
                                                   "positive finite number. Received"):
        MeasuredCompute(seconds, examples)


def test_the_tuner_uses_and_explains_the_measured_compute():
    space = _space()
    measured = MeasuredCompute(0.004, 10, source="measured here")
    tuner = Tuner(space.graph_item, space.resource_spec, calibration=CAL, batch_size=20,
                  measured_compute=measured)
    assert tuner.simulator.compute_s == pytest.approx(0.004)
    result = tuner.tune(0)
    assert "compute: 4.000 ms per replica step at 10 examples, measured here" in \
        tuner.explain(tuner.space.encode(result.strategy))
