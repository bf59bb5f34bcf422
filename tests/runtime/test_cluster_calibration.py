"""The simulator calibrated on the cluster: the probes, the fit, the cache."""
from __future__ import annotations

import json
import math
import os
import pathlib

import pytest

import autodist
from autodist.runtime import cluster_calibration as cc
from autodist.search.simulator import Calibration

CAL = Calibration(flops_per_s=3e9, latency_s=3e-4, collective_latency_s=8e-4,
                  task_overhead_s=2e-3, host_cores=2, source="test")


@pytest.fixture(name="cache")
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv(cc.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_calibration_is_cached_per_cluster(cache):
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    other = autodist.ResourceSpec.local(workers=3)
    assert cc.cached_calibration(spec) is None
    path = cc.save_calibration(spec, CAL, {"probes_s": {"x": 0.01}})
    assert path == cache / "calibration" / f"{spec.fingerprint}.json" and not os.listdir(
        path.parent) == []
    assert cc.cached_calibration(spec) == CAL
    assert cc.cached_calibration(other) is None
    with pytest.raises(cc.CalibrationError, match="measured on cluster .* not on this one"):
        cc.load_calibration(path, other)


@pytest.mark.parametrize("content,message", [
    (b"{not json", "not readable JSON"),
    (b"[1]", "has no version"),
    (json.dumps({"version": 99}).encode(), "version 99, newer than 1"),
    (json.dumps({"version": 1, "calibration": {"latency_s": -1}}).encode(),
     "latency_s must be seconds"),
    (json.dumps({"version": 1, "calibration": {"warp": 9}}).encode(), "unknown Calibration"),
    (b"[" * 100_000, "not readable JSON"),
])
def test_a_damaged_calibration_file_is_named_and_the_cache_ignores_it(cache, content, message):
    spec = autodist.ResourceSpec.local(workers=2)
    path = cc.cache_path(spec)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with pytest.raises(cc.CalibrationError, match=message):
        cc.load_calibration(path)
    with pytest.warns(UserWarning, match="ignoring the cached calibration"):
        assert cc.cached_calibration(spec) is None


def test_a_fifo_or_huge_file_is_not_read(cache, tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(cc.CalibrationError, match="not a regular file"):
        cc.load_calibration(fifo)
    huge = tmp_path / "huge.json"
    huge.write_bytes(b" " * (2 << 20))
    with pytest.raises(cc.CalibrationError, match="larger than"):
        cc.load_calibration(huge)


def test_only_local_clusters_are_calibrated(cache):
    spec = autodist.ResourceSpec.from_dict({"nodes": [
        {"address": "10.0.0.1", "roles": ["worker", "ps"], "chief": True},
        {"address": "10.0.0.2", "roles": ["worker"]}]})
    with pytest.raises(cc.CalibrationError, match="local clusters only.*10.0.0.1"):
        cc.calibrate_cluster(spec)


def test_the_calibrate_command_refuses_a_remote_cluster(cache, tmp_path, capsys):
    from autodist import cli

    cluster = tmp_path / "c.yml"
    cluster.write_text("nodes:\n  - address: 10.0.0.1\n    chief: true\n    roles: [worker, ps]\n")
    assert cli.main(["calibrate", "--cluster", str(cluster)]) == 2
    assert "local clusters only" in capsys.readouterr().err


def test_the_probes_count_the_events_each_fixed_cost_is_fitted_to():
    """Probes differ in one count at a time, with as few variables as the trial workloads."""
    import keras

    from autodist.ir.capture import capture
    from autodist.search.calibration_fit import probe_step
    from autodist.search.simulator import Simulator
    from autodist.search.space import SearchSpace

    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    counts = {}
    op_counts, variables = [], []
    for prefix, wide_units, op_blocks in cc.PROBE_LAUNCHES:
        keras.backend.clear_session()
        graph_item = capture(cc.probe_model(wide_units, op_blocks))
        op_counts.append(len(graph_item.ops))
        variables.append(len(graph_item.variables))
        simulator = Simulator(SearchSpace(graph_item, spec), CAL, batch_size=16)
        for name, strategy in cc.probe_strategies(graph_item, spec, prefix).items():
            counts[name] = probe_step(simulator, strategy, name, 0.01).counts
    assert variables == [7, 11] and op_counts[1] - op_counts[0] >= 1000
    one, two, three = (counts[f"all-reduce, {n} group{'s' * (n != 'one')}"]
                       for n in ("one", "two", "three"))
    # The probe's groups are small: each gathered and summed, 1 hop at 2 replicas.
    assert two[1] - one[1] == three[1] - two[1] == 1
    assert one[2:] == two[2:] == three[2:]
    assert counts["parameter server"][1] == 0 and counts["parameter server"][2] > 0
    assert counts["parallax (PS and all-reduce)"][3] == 1
    assert counts["wide: parameter server"][4] > counts["wide: all-reduce, one group"][4] > 1e6
    # One replica: no collectives to tell apart, no mixed step.
    alone = autodist.ResourceSpec.local(workers=1, ps=1)
    keras.backend.clear_session()
    graph_item = capture(cc.probe_model())
    assert sorted(cc.probe_strategies(graph_item, alone)) == ["all-reduce, one group",
                                                              "parameter server"]


@pytest.mark.cluster
def test_calibrating_a_cluster_fits_its_probe_steps_and_optimize_uses_it(cache, capfd):
    """`autodist calibrate --json` on 2 workers + 1 PS: constants, cache, and optimize's use."""
    from autodist import cli, models

    assert cli.main(["calibrate", "--workers", "2", "--ps", "1", "--steps", "8", "--json"]) == 0
    data = json.loads(capfd.readouterr().out)
    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    assert not [key for key in [*data, *data["calibration"]] if f"`{key}`" not in doc]
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    calibration = cc.cached_calibration(spec)
    assert data["resource_spec_fingerprint"] == spec.fingerprint
    assert data["cache"] == str(cc.cache_path(spec))
    assert Calibration.from_dict(data["calibration"]) == calibration
    assert calibration.source.startswith("measured ") and calibration.host_cores == os.cpu_count()
    for name in ("task_overhead_s", "latency_s", "run_overhead_s", "hop_latency_s",
                 "byte_cost_s", "op_overhead_s"):
        value = getattr(calibration, name)
        assert math.isfinite(value) and 0 <= value < 1, (name, value)
    record = json.loads(cc.cache_path(spec).read_text())
    report = record["report"]
    assert sorted(report["probes_s"]) == [
        "all-reduce, one group", "all-reduce, three groups", "all-reduce, two groups",
        "parallax (PS and all-reduce)", "parameter server", "wide: all-reduce, one group",
        "wide: parameter server"]
    # The fitted costs explain the probe steps better than the defaults do.
    assert report["median_abs_log_error"] < report["base_median_abs_log_error"]
    model = models.mlp(input_dim=8, hidden=(8,))
    plan = autodist.optimize(model, spec, calibration="cached")
    assert f"simulator constants: {calibration.source}" in plan.explain()
    assert "simulator constants: default" in autodist.optimize(model, spec).explain()


def test_optimize_names_a_missing_cached_calibration(cache):
    from autodist.api import resolve_calibration

    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    with pytest.raises(autodist.AutodistError, match="no cached calibration.*autodist calibrate"):
        resolve_calibration("cached", spec)
    with pytest.raises(autodist.AutodistError, match="'cached', 'cluster', 'measure' or None"):
        resolve_calibration("fast", spec)
    assert resolve_calibration(None, spec) is None
    cc.save_calibration(spec, CAL)
    assert resolve_calibration("cached", spec) == CAL


def test_a_models_compute_is_measured_on_the_cluster_and_optimize_plans_with_it(
        cache, monkeypatch):
    """`measure_compute` on 2 workers (one launch), and optimize(calibration="cluster") passes
    it to the simulator (the cluster calibration itself stubbed: the test above runs it)."""
    from autodist import models
    from autodist.search.measured_compute import MeasuredCompute

    spec = autodist.ResourceSpec.local(workers=2)
    model = models.mlp(input_dim=8, hidden=(8,))
    measured = cc.measure_compute(model, spec, batch_size=16, steps=3)
    assert measured.examples == 8 and 0 < measured.seconds < 1.0
    assert measured.source.startswith("measured ") and "on 2 tasks" in measured.source
    with pytest.raises(cc.CalibrationError, match="one example per replica.*batch_size=1"):
        cc.measure_compute(model, spec, batch_size=1)
    given = MeasuredCompute(0.002, 16, source="measured in the test")
    monkeypatch.setattr(cc, "measure_compute", lambda *a, **k: given)
    monkeypatch.setattr(cc, "calibrate_cluster", lambda *a, **k: CAL)
    plan = autodist.optimize(model, spec, calibration="cluster")
    assert "compute: 2.000 ms per replica step at 16 examples, measured in the test" in \
        plan.explain()
    assert "compute:" not in autodist.optimize(model, spec).explain()
