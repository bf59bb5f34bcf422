"""Fitting the simulator's fixed costs, and the constants a calibration adds."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from autodist.ir.errors import InvalidArgumentError
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.proto import graph_item_pb2
from autodist.search import builders
from autodist.search.calibration_fit import all_reduce_in_groups, fit_fixed_costs, probe_step
from autodist.search.simulator import Calibration, Simulator
from autodist.search.space import SearchSpace
from tests.search import workloads

TRUE = Calibration(flops_per_s=1e9, memory_bytes_per_s=2e9, latency_s=3.4e-4,
                   collective_latency_s=7.5e-4, run_overhead_s=5.3e-3, task_overhead_s=2.2e-3,
                   byte_cost_s=4e-9, op_overhead_s=9e-6)
BASE = Calibration(flops_per_s=1e9, memory_bytes_per_s=2e9)  # default fixed costs


def _workload(wide: int = 0, op_blocks: int = 0):
    return workloads.graph_item(
        [("embedding", (64, 8), True)] + [(f"dense_{i}", (8, 8), False) for i in range(6)]
        + [(f"wide_{i}", (wide, wide), False) for i in range(2 if wide else 0)],
        flops=2e6, estimate_batch_size=16, ops=[("Tanh", "forward", 4096)] * 10 * op_blocks)


def _probes(spec, calibration):
    """The probes of `calibrate_cluster`, "measured" by the simulator under `calibration`."""
    small = {"one group": lambda gi: all_reduce_in_groups(gi, spec, 1),
             "two groups": lambda gi: all_reduce_in_groups(gi, spec, 2),
             "three groups": lambda gi: all_reduce_in_groups(gi, spec, 3),
             "ps": lambda gi: builders.PS().build(gi, spec),
             "parallax": lambda gi: builders.Parallax().build(gi, spec)}
    one_and_ps = {"one group": lambda gi: all_reduce_in_groups(gi, spec, 1),
                  "ps": lambda gi: builders.PS().build(gi, spec)}
    out = []
    for prefix, gi, strategies in (("", _workload(), small),
                                   ("wide ", _workload(512, op_blocks=100), one_and_ps)):
        truth = Simulator(SearchSpace(gi, spec), calibration, batch_size=16)
        base = Simulator(SearchSpace(gi, spec), BASE, batch_size=16)
        for name, build in strategies.items():
            strategy = build(gi)
            measured = float(truth.predict_strategy(strategy).step_time_s[0])
            out.append(probe_step(base, strategy, prefix + name, measured))
    return out


def test_the_fixed_costs_behind_probe_steps_are_recovered():
    spec = ResourceSpec.local(workers=2, ps=1)
    probes = _probes(spec, TRUE)
    assert len({p.counts for p in probes}) == 7   # each probe counts other events
    fitted, report = fit_fixed_costs(BASE, probes, source="test")
    for name in ("task_overhead_s", "collective_latency_s", "latency_s", "run_overhead_s",
                 "byte_cost_s", "op_overhead_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=1e-9), name
    assert fitted.flops_per_s == BASE.flops_per_s and fitted.source == "test"
    assert report["median_abs_log_error"] < 1e-9
    assert report["base_median_abs_log_error"] > 0.5


def test_costs_are_never_negative_and_unseparable_ones_keep_their_base_value():
    spec = ResourceSpec.local(workers=2, ps=1)
    probes = _probes(spec, TRUE)
    # Measured faster than the rates alone allow: every cost fits to 0, none below,
    # but a message is never free: the costs of a hop and of a PS message the fit
    # cannot tell from zero keep their base values (the rest fitted around them).
    fast = [dataclasses.replace(p, measured_s=p.rate_s * 0.9) for p in probes]
    fitted, _ = fit_fixed_costs(BASE, fast)
    assert (fitted.task_overhead_s, fitted.run_overhead_s, fitted.byte_cost_s,
            fitted.op_overhead_s) == (0.0,) * 4
    assert (fitted.hop_latency_s, fitted.latency_s) == (BASE.hop_latency_s, BASE.latency_s)
    # Only the small model's all-reduce probes: PS messages, extra runs, the
    # cost per byte and per op are not measured.
    only_ar = [p for p in probes if p.name in ("one group", "two groups", "three groups")]
    fitted, _ = fit_fixed_costs(BASE, only_ar)
    assert fitted.latency_s == BASE.latency_s and fitted.run_overhead_s == BASE.run_overhead_s
    assert fitted.byte_cost_s == BASE.byte_cost_s
    assert fitted.op_overhead_s == BASE.op_overhead_s
    assert fitted.collective_latency_s == pytest.approx(TRUE.collective_latency_s, rel=1e-6)
    with pytest.raises(InvalidArgumentError, match="at least 1 probe"):
        fit_fixed_costs(BASE, [])
    with pytest.raises(InvalidArgumentError, match="positive"):
        probe_step(Simulator(SearchSpace(_workload(), spec), BASE, batch_size=16),
                   builders.PS().build(_workload(), spec), "bad", math.nan)


def test_a_message_cost_the_probes_cannot_separate_keeps_its_base_value():
    """With 4 workers and 2 PS sharing a host, the cost per task can absorb the PS
    messages (the fit set them to 0, and PS-held tables were predicted cheaper than
    measured): a message cost fitted to zero keeps its base value, the others are
    fitted again around it."""
    spec = ResourceSpec.local(workers=4, ps=2)
    no_ps_messages = dataclasses.replace(TRUE, latency_s=0.0)
    probes = _probes(spec, no_ps_messages)
    fitted, report = fit_fixed_costs(BASE, probes)
    assert fitted.latency_s == BASE.latency_s
    assert fitted.task_overhead_s > 0 and fitted.collective_latency_s > 0
    assert report["median_abs_log_error"] < 0.1   # the others fitted around it
    # Where the probes do see the PS messages, their fitted cost stands.
    fitted, _ = fit_fixed_costs(BASE, _probes(spec, TRUE))
    assert fitted.latency_s == pytest.approx(TRUE.latency_s, rel=1e-6)


def test_probe_all_reduce_fuses_the_dense_gradients_into_the_groups_asked_for():
    spec = ResourceSpec.local(workers=3, ps=1)
    gi = _workload()
    sim = Simulator(SearchSpace(gi, spec), BASE, batch_size=16)
    hops = []
    for groups in (1, 2, 3):
        strategy = all_reduce_in_groups(gi, spec, groups)
        dense = {c.var_name: c.shards[0].all_reduce.group for c in strategy.proto.variables
                 if c.var_name != "embedding"}
        assert sorted(set(dense.values())) == list(range(groups))
        # Consecutive layers in a group, in gradient order.
        assert list(dense.values()) == sorted(dense.values())
        sparse = [c for c in strategy.proto.variables if c.var_name == "embedding"][0]
        assert sparse.shards[0].all_reduce.group == groups
        hops.append(sim.predict_strategy(strategy).parts["collective_hops"][0])
    # The workload's groups are small: each gathered and added in W - 1 hops (a ring
    # would take 2(W - 1)), plus the embedding's all-gather's W - 1.
    assert hops == [2 + 2, 4 + 2, 6 + 2]
    for bad in (0, 7):
        with pytest.raises(InvalidArgumentError, match="groups must be in \\[1, 6\\]"):
            all_reduce_in_groups(gi, spec, bad)


def test_the_op_cost_is_fitted_apart_from_the_rates():
    """A probe's rate excludes its ops' fixed cost; the op count follows the cores' sharing."""
    spec = ResourceSpec.local(workers=6, ps=3)
    gi = _workload(op_blocks=10)
    strategy = all_reduce_in_groups(gi, spec, 1)
    cal = dataclasses.replace(BASE, op_overhead_s=1e-3, host_cores=2)
    sim = Simulator(SearchSpace(gi, spec), cal, batch_size=16)
    assert sim.op_runs == len(gi.ops) * 3                      # 6 replicas on 2 cores
    step = probe_step(sim, strategy, "x", 1.0)
    plain = probe_step(Simulator(SearchSpace(gi, spec), dataclasses.replace(cal, op_overhead_s=0.0),
                                 batch_size=16), strategy, "x", 1.0)
    assert step.rate_s == pytest.approx(plain.rate_s) and step.counts[5] == sim.op_runs
    assert Simulator(SearchSpace(gi, spec), BASE, batch_size=16).op_runs == len(gi.ops)


def test_cpu_replicas_beyond_a_hosts_cores_share_them():
    gi = workloads.graph_item([("w", (64, 64), False)], flops=1e9, estimate_batch_size=64)

    def compute(spec, cores):
        cal = Calibration(flops_per_s=1e9, op_overhead_s=0.0, host_cores=cores)
        return Simulator(SearchSpace(gi, spec), cal, batch_size=64).compute_s

    six = ResourceSpec.local(workers=6, ps=3)
    two = ResourceSpec.local(workers=2)
    assert compute(six, 0) == pytest.approx(1 / 6)             # no cores known: no sharing
    assert compute(six, 2) == pytest.approx(1 / 6 * 3)         # 6 replicas on 2 cores
    assert compute(two, 2) == pytest.approx(1 / 2)
    hosts = ResourceSpec.from_dict({"nodes": [
        {"address": f"10.0.0.{i}", "cpus": 4, "roles": ["worker"] + (["ps"] if i == 0 else [])}
        for i in range(2)]})
    assert compute(hosts, 2) == pytest.approx(1 / 8 * 2)       # 4 CPU replicas per host
    gpus = ResourceSpec.from_dict({"nodes": [{"address": "10.0.0.1", "gpus": 8,
                                              "roles": ["worker", "ps"]}]})
    assert compute(gpus, 1) == pytest.approx(1 / 8)            # GPUs do not share cores


def test_a_calibration_reads_back_and_bad_values_are_named():
    assert Calibration.from_dict(TRUE.to_dict()) == TRUE
    assert Calibration().hop_latency_s == Calibration().latency_s
    with pytest.raises(InvalidArgumentError, match="unknown Calibration fields \\['bogus'\\]"):
        Calibration.from_dict({**TRUE.to_dict(), "bogus": 1}, source="f.json")
    with pytest.raises(InvalidArgumentError, match="f.json: Calibration.latency_s must be"):
        Calibration.from_dict({**TRUE.to_dict(), "latency_s": -1.0}, source="f.json")
    for bad in (math.nan, math.inf, 0.0, "fast"):
        with pytest.raises(InvalidArgumentError, match="flops_per_s must be a positive"):
            Calibration(flops_per_s=bad)
    with pytest.raises(InvalidArgumentError, match="host_cores"):
        Calibration(host_cores=-1)
    with pytest.raises(InvalidArgumentError, match="mapping"):
        Calibration.from_dict([1, 2])


def test_default_constants_predict_as_before():
    """No calibration: the collective hop's α is the message α and nothing is added per task."""
    spec = ResourceSpec.local(workers=2, ps=1)
    gi = _workload()
    sim = Simulator(SearchSpace(gi, spec), Calibration(), batch_size=16)
    parts = sim.predict_strategy(builders.AllReduce(group_bytes=1).build(gi, spec)).parts
    assert parts["latency_s"][0] == pytest.approx(
        Calibration().latency_s * (parts["ps_messages_max"][0] + parts["collective_hops"][0]))
    assert "byte_cost_s" in Calibration().to_dict() and Calibration().byte_cost_s == 0
    total = sum(parts[k][0] for k in ("compute_s", "bandwidth_s", "latency_s", "update_s",
                                      "sync_s", "phase_s"))
    assert np.isclose(sim.predict_strategy(
        builders.AllReduce(group_bytes=1).build(gi, spec)).step_time_s[0], total)


def test_convolutions_run_at_their_rate_and_shared_cores_slow_the_ops_too():
    base = workloads.graph_item([("w", (64, 64), False)], flops=1e9, estimate_batch_size=64,
                                ops=[("Relu", "forward", 4)] * 9)
    proto = graph_item_pb2.GraphItem()
    proto.CopyFrom(base.proto)
    proto.ops.add(name="conv", type="Conv2DBackpropFilter", phase="backward", flops=3e9)
    gi = GraphItem(proto)

    def compute(spec, **fields):
        cal = Calibration(flops_per_s=1e9, op_overhead_s=1e-3, **fields)
        return Simulator(SearchSpace(gi, spec), cal, batch_size=64).compute_s

    two, six = ResourceSpec.local(workers=2), ResourceSpec.local(workers=6, ps=3)
    ops_s = 11 * 1e-3
    assert compute(two) == pytest.approx(4 / 2 + ops_s)                 # one rate for all FLOPs
    assert compute(two, conv_flops_per_s=0.5e9) == pytest.approx(1 / 2 + 3 / 2 / 0.5 + ops_s)
    # Uncalibrated cores: the ops' fixed costs are not shared (the default's scores).
    assert compute(six) == pytest.approx(4 / 6 + ops_s)
    # 6 CPU replicas on 2 cores: FLOPs and ops' fixed costs both at a third of a core.
    assert compute(six, host_cores=2) == pytest.approx((4 / 6 + ops_s) * 3)
    with pytest.raises(InvalidArgumentError, match="conv_flops_per_s must be a positive"):
        Calibration(conv_flops_per_s=0.0)
    assert Calibration.from_dict(Calibration(conv_flops_per_s=2e10).to_dict()).conv_flops_per_s \
        == 2e10
