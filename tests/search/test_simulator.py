"""The analytic simulator on hand-computed cases."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autodist.ir.resource_spec import ResourceSpec
from autodist.search.features import FEATURE_NAMES, featurize, featurize_strategy
from autodist.search.simulator import Calibration, Simulator
from autodist.search.space import SearchSpace, SpaceOptions
from tests.search import workloads

# Round numbers: 8 Gbit/s = 1e9 bytes/s, updates at 1e9 bytes/s. All traffic of a
# step overlapped (ps_overlap=1); test_phases_* cover the phased model.
CAL = Calibration(flops_per_s=1e9, op_overhead_s=0.0, latency_s=1e-4,
                  memory_bytes_per_s=1e9, run_overhead_s=1e-3, ps_overlap=1.0)


def _index(space, v, predicate):
    return next(i for i, c in enumerate(space.options[v]) if predicate(c))


def _is_ps(c):
    return c.shards[0].WhichOneof("kind") == "ps" and c.partitioner.num_shards <= 1


def _is_ar(compressor):
    return lambda c: (c.shards[0].WhichOneof("kind") == "all_reduce"
                      and c.shards[0].all_reduce.compressor == compressor)


def _dense_1mb():
    # 1000 x 250 float32 = 1,000,000 bytes; 1e6 FLOPs at batch 10.
    return workloads.graph_item([("w", (1000, 250), False)], flops=1e6)


def test_dense_variable_on_a_ps_node():
    spec = ResourceSpec.local(workers=2, ps=1, bandwidth_gbps=8)
    space = SearchSpace(_dense_1mb(), spec)
    sim = Simulator(space, CAL, batch_size=20)
    p = sim.predict([[_index(space, 0, _is_ps), 0]])
    # Compute: 1e6 FLOPs at batch 10 -> 1e6 at 10 per replica -> 1 ms.
    assert p.parts["compute_s"][0] == pytest.approx(1e-3)
    # The PS node receives 2 gradients and sends 2 copies: 2e6 B each way -> 2 ms.
    assert p.parts["bandwidth_s"][0] == pytest.approx(2e-3)
    # 2 replicas x (push + pull) messages at the PS: 4 latencies.
    assert p.parts["latency_s"][0] == pytest.approx(4e-4)
    assert p.parts["update_s"][0] == pytest.approx(1e-3)      # one update of 1e6 B
    assert p.parts["sync_s"][0] == pytest.approx(2e-4)        # the chief's token round
    assert p.parts["phase_s"][0] == 0.0
    assert p.step_time_s[0] == pytest.approx(1e-3 + 2e-3 + 4e-4 + 1e-3 + 2e-4)
    assert p.lower_bound_s[0] == pytest.approx(2e-3)


def test_a_batch_smaller_than_the_replicas_is_priced_at_one_example_on_the_busiest():
    """Keras takes batch_size=1 (keras-io's attention MIL); on 2 replicas one holds the
    example and the other none (the runtime trains it as Keras). It was refused."""
    spec = ResourceSpec.local(workers=2, ps=1, bandwidth_gbps=8)
    space = SearchSpace(_dense_1mb(), spec, batch_size=1)
    sim = Simulator(space, CAL, batch_size=1)
    p = sim.predict([[_index(space, 0, _is_ps), 0]])
    assert p.parts["compute_s"][0] == pytest.approx(1e-4)     # 1e6 FLOPs at 10, 1 example
    with pytest.raises(Exception, match="batch_size must be >= 1"):
        Simulator(space, CAL, batch_size=-1)


def test_dense_variable_all_reduced_and_compressed():
    spec = ResourceSpec.local(workers=2, ps=1, bandwidth_gbps=8)
    space = SearchSpace(_dense_1mb(), spec, SpaceOptions(compressors=("none", "fp16")))
    sim = Simulator(space, CAL, batch_size=20)
    p = sim.predict([[_index(space, 0, _is_ar(0)), 0], [_index(space, 0, _is_ar(1)), 0]])
    # Ring with W=2: 2(W-1)/W x 1e6 B in and out of each worker -> 1 ms; fp16 halves it.
    np.testing.assert_allclose(p.parts["bandwidth_s"], [1e-3, 5e-4])
    np.testing.assert_allclose(p.parts["latency_s"], [2e-4, 2e-4])   # 2(W-1) hops
    np.testing.assert_allclose(p.parts["update_s"], [1e-3, 1e-3])    # every replica applies
    np.testing.assert_allclose(p.step_time_s, [1e-3 + 1e-3 + 2e-4 + 1e-3,
                                               1e-3 + 5e-4 + 2e-4 + 1e-3])


def test_one_replica_all_reduce_is_free_and_ps_on_own_node_too():
    spec = ResourceSpec.local(workers=1, ps=0, bandwidth_gbps=8)
    space = SearchSpace(_dense_1mb(), spec)
    sim = Simulator(space, CAL, batch_size=10)
    p = sim.predict([[_index(space, 0, _is_ar(0)), 0], [_index(space, 0, _is_ps), 0]])
    np.testing.assert_allclose(p.parts["bandwidth_s"], [0.0, 0.0])
    np.testing.assert_allclose(p.parts["latency_s"], [0.0, 2e-4])   # gRPC-free local, 2 msgs


def test_sparse_variable_moves_only_touched_rows():
    # 1000 rows of 1000 B; 1 lookup per example, 10 examples per replica.
    gi = workloads.graph_item([("emb", (1000, 250), True)])
    spec = ResourceSpec.local(workers=2, ps=1, bandwidth_gbps=8)
    space = SearchSpace(gi, spec)
    sim = Simulator(space, CAL, batch_size=20)
    ag = _index(space, 0, _is_ar(0))
    p = sim.predict([[_index(space, 0, _is_ps), 0], [ag, 0]])
    # PS: each replica pushes 10 x (1000 + 8) B and 10 x 8 B of ids, pulls 10 x 1000 B.
    push, pull = 2 * (10 * 1008 + 80), 2 * 10_000
    assert p.parts["bandwidth_s"][0] == pytest.approx(max(push, pull) / 1e9)
    # All-gather: each worker sends and receives (W-1) x 10 x (1000 + 8) B.
    assert p.parts["bandwidth_s"][1] == pytest.approx(10 * 1008 / 1e9)
    assert p.parts["latency_s"][1] == pytest.approx(1e-4)


def _is_densified(c):
    from autodist.proto import strategy_pb2

    return (c.shards[0].WhichOneof("kind") == "all_reduce"
            and c.shards[0].all_reduce.spec == strategy_pb2.AllReduceSynchronizer.RING)


@pytest.mark.parametrize("optimizer,wire", [("sgd", 100_000), ("adam", 200_000)])
def test_small_table_looked_up_often_is_cheaper_densified(optimizer, wire):
    # 100 rows of 1000 B, 20 lookups per example, 10 examples per replica: 200 rows
    # (repeats included) per replica, twice the table.
    gi = workloads.graph_item([("emb", (100, 250), True)], lookups_per_example=20,
                              optimizer=optimizer)
    spec = ResourceSpec.local(workers=2, ps=1, bandwidth_gbps=8)
    space = SearchSpace(gi, spec)
    sim = Simulator(space, CAL, batch_size=20)
    p = sim.predict([[_index(space, 0, _is_ar(0)), 0], [_index(space, 0, _is_densified), 0]])
    # All-gather: each worker sends and receives 200 x (1000 + 8) B.
    assert p.parts["bandwidth_s"][0] == pytest.approx(200 * 1008 / 1e9)
    # Densified ring, W=2: the 1e5 B table in and out of each worker; Adam's
    # squared rows travel too.
    assert p.parts["bandwidth_s"][1] == pytest.approx(wire / 1e9)
    assert p.parts["update_s"][1] == pytest.approx(1e5 / 1e9)   # a dense update per replica
    assert p.step_time_s[1] < p.step_time_s[0]


@pytest.mark.parametrize("optimizer,momentum,update_bytes", [
    ("sgd", 0.0, 2 * 10 * 1000),   # plain SGD scatters the touched rows of both replicas
    ("sgd", 0.9, 3 * 1_000_000),   # momentum decays every row: densified, three passes
    ("adam", 0.0, 3 * 1_000_000)])
def test_sparse_update_cost_follows_the_optimizer(optimizer, momentum, update_bytes):
    gi = workloads.graph_item([("emb", (1000, 250), True)], optimizer=optimizer,
                              momentum=momentum)
    spec = ResourceSpec.local(workers=2, ps=1, bandwidth_gbps=8)
    space = SearchSpace(gi, spec)
    sim = Simulator(space, CAL, batch_size=20)
    p = sim.predict([[_index(space, 0, _is_ps), 0]])
    assert p.parts["update_s"][0] == pytest.approx(update_bytes / 1e9)


def test_partitioning_spreads_the_load_over_ps_nodes():
    spec = ResourceSpec.local(workers=2, ps=2, bandwidth_gbps=8)
    space = SearchSpace(_dense_1mb(), spec)
    sim = Simulator(space, CAL, batch_size=20)
    two = _index(space, 0, lambda c: c.partitioner.num_shards == 2)
    p = sim.predict([[_index(space, 0, _is_ps), 0], [two, 0]])
    # Whole: 2 ms at one PS; halves on two PS nodes: 1 ms each, and 4 messages per PS.
    np.testing.assert_allclose(p.parts["bandwidth_s"], [2e-3, 1e-3])
    np.testing.assert_allclose(p.parts["latency_s"], [4e-4, 4e-4])
    np.testing.assert_allclose(p.parts["ps_imbalance"], [2.0, 1.0])


def test_async_applies_every_replica_update_and_skips_the_token_round():
    spec = ResourceSpec.local(workers=2, ps=1, bandwidth_gbps=8)
    space = SearchSpace(_dense_1mb(), spec, SpaceOptions(consistency=("sync", "async")))
    sim = Simulator(space, CAL, batch_size=20)
    ps = _index(space, 0, _is_ps)
    p = sim.predict([[ps, 0], [ps, 1]])
    np.testing.assert_allclose(p.parts["update_s"], [1e-3, 2e-3])
    np.testing.assert_allclose(p.parts["sync_s"], [2e-4, 0.0])


def test_mixing_ps_and_all_reduce_costs_a_second_run():
    gi = workloads.graph_item([("emb", (1000, 250), True), ("w", (1000, 250), False)])
    spec = ResourceSpec.local(workers=2, ps=1, bandwidth_gbps=8)
    space = SearchSpace(gi, spec)
    sim = Simulator(space, CAL, batch_size=20)
    p = sim.predict([[_index(space, 0, _is_ps), _index(space, 1, _is_ar(0)), 0]])
    assert p.parts["phase_s"][0] == pytest.approx(1e-3)


def test_slower_node_bandwidth_dominates():
    spec = ResourceSpec.from_dict({"nodes": [
        {"address": "a", "chief": True, "cpus": [0], "roles": ["worker"],
         "network_bandwidth": 8},
        {"address": "b", "cpus": [0], "roles": ["worker"], "network_bandwidth": 0.8},
        {"address": "c", "cpus": [0], "roles": ["ps"], "network_bandwidth": 8}]})
    space = SearchSpace(_dense_1mb(), spec)
    sim = Simulator(space, CAL, batch_size=20)
    p = sim.predict([[_index(space, 0, _is_ps), 0], [_index(space, 0, _is_ar(0)), 0]])
    # Worker b moves 1e6 B each way at 1e8 B/s: 10 ms either way.
    np.testing.assert_allclose(p.parts["bandwidth_s"], [1e-2, 1e-2])


def test_features_have_fixed_names_and_match_parts():
    gi = workloads.many_variables(40)
    spec = ResourceSpec.local(workers=4, ps=2, bandwidth_gbps=1)
    space = SearchSpace(gi, spec)
    sim = Simulator(space, CAL)
    candidates = space.sample(50, np.random.default_rng(0))
    x = featurize(sim, candidates)
    assert x.shape == (50, len(FEATURE_NAMES)) and np.isfinite(x).all()
    p = sim.predict(candidates)
    np.testing.assert_allclose(x[:, FEATURE_NAMES.index("sim_step_time_s")], p.step_time_s)
    assert (x[:, FEATURE_NAMES.index("num_replicas")] == 4).all()
    from autodist.search import builders
    named = featurize_strategy(sim, builders.Parallax().build(gi, spec))
    assert set(named) == set(FEATURE_NAMES) and named["num_ps_devices"] == 2


def test_calibration_measures_positive_rates():
    cal = Calibration.measure(seconds=0.05)
    assert cal.flops_per_s > 1e7 and cal.memory_bytes_per_s > 1e7


def _two_dense_1mb():
    return workloads.graph_item([("a", (1000, 250), False), ("b", (1000, 250), False)],
                                flops=1e6)


@pytest.mark.parametrize("overlap", [0.0, 0.5, 1.0])
def test_phases_of_a_ps_step(overlap):
    spec = ResourceSpec.local(workers=2, ps=1, bandwidth_gbps=8)
    space = SearchSpace(_dense_1mb(), spec)
    sim = Simulator(space, dataclasses.replace(CAL, ps_overlap=overlap), batch_size=20)
    p = sim.predict([[_index(space, 0, _is_ps), 0]])
    # Phased: both replicas read 1e6 B from the PS (2e6 B out of it: 2 ms), then both
    # push 1e6 B (2e6 B into it: 2 ms) -> 4 ms; overlapped: max(in, out) -> 2 ms.
    assert p.parts["bandwidth_s"][0] == pytest.approx(overlap * 2e-3 + (1 - overlap) * 4e-3)
    assert p.lower_bound_s[0] == pytest.approx(2e-3)


@pytest.mark.parametrize("overlap", [0.0, 0.5])
def test_phases_of_a_mixed_step(overlap):
    spec = ResourceSpec.local(workers=2, ps=1, bandwidth_gbps=8)
    space = SearchSpace(_two_dense_1mb(), spec)
    sim = Simulator(space, dataclasses.replace(CAL, ps_overlap=overlap), batch_size=20)
    ps, ar = _index(space, 0, _is_ps), _index(space, 1, _is_ar(0))
    p = sim.predict([[ps, ar, 0], [ps, _index(space, 1, _is_ps), 0]])
    # Mixed (a on the PS, b all-reduced): reads 2 ms; then the ring of b (1e6 B per
    # worker: 1 ms); then, in the second run, the pushes of a (2e6 B into the PS: 2 ms).
    phased = 2e-3 + 1e-3 + 2e-3
    # Overlapped: the PS node moves 2e6 B each way; a worker 1e6 B of a and 1e6 B of b.
    assert p.parts["bandwidth_s"][0] == pytest.approx(overlap * 2e-3 + (1 - overlap) * phased)
    # Both on the PS: reads 4e6 B out of the PS (4 ms), then pushes 4e6 B in (4 ms).
    assert p.parts["bandwidth_s"][1] == pytest.approx(overlap * 4e-3 + (1 - overlap) * 8e-3)


def test_ps_overlap_is_checked():
    with pytest.raises(ValueError, match="ps_overlap must be in"):
        Calibration(ps_overlap=1.5)


def _whole_table_sums(sim, candidates):
    # What predict summed before it gathered only non-zero columns in cache-sized
    # pieces: each block's shared entries once, then every candidate's other rows.
    v = sim.space.num_variables
    chunk = max(1, (1 << 22) // (v * sim._table.shape[1]))
    sums = []
    for start in range(0, len(candidates), chunk):
        block = candidates[start:start + chunk, :v] + sim._offsets
        shared = (block == block[0]).all(axis=0)
        sums.append(sim._table[block[0, shared]].sum(axis=0)
                    + sim._table[block[:, ~shared]].sum(axis=1))
    return np.concatenate(sums)


@pytest.mark.parametrize("backward_overlap", [0.0, 1.0])
def test_scores_equal_sums_over_the_whole_table_to_the_bit(backward_overlap):
    spec = ResourceSpec.local(workers=4, ps=2, bandwidth_gbps=1)
    space = SearchSpace(workloads.many_variables(200), spec)
    sim = Simulator(space, Calibration(backward_overlap=backward_overlap))
    sampled = space.sample(700, np.random.default_rng(0))  # more than one block
    greedy = np.repeat(sampled[:1], space.option_counts[3], axis=0)
    greedy[:, 3] = np.arange(space.option_counts[3])  # one entry varied
    sim.predict(sampled[:1])
    assert len(sim._used_columns) < sim._table.shape[1]  # some columns are left out
    v = space.num_variables
    for candidates in (sampled, greedy):
        got = sim.predict(candidates)
        sync = np.array([c.sync for c in space.consistencies])[candidates[:, v]]
        staleness = np.array([c.staleness for c in space.consistencies])[candidates[:, v]]
        ready = sim._ready_table[candidates[:, :v] + sim._offsets].max(axis=1)
        if backward_overlap:
            assert got.parts["overlap_s"].any()
        want = sim._times(_whole_table_sums(sim, candidates), sync, staleness, ready)
        assert got.step_time_s.tobytes() == want.step_time_s.tobytes()
        assert got.lower_bound_s.tobytes() == want.lower_bound_s.tobytes()
        for name, values in want.parts.items():
            assert got.parts[name].tobytes() == values.tobytes(), name


@pytest.mark.parametrize("builder", ["PS", "AllReduce", "Parallax", "PartitionedPS"])
def test_node_traffic_per_variable_sums_to_the_predicted_node_bytes(builder):
    from autodist.search import builders

    gi = workloads.graph_item([("emb", (1000, 16), True), ("w", (64, 64), False),
                               ("b", (64,), False)], optimizer="sgd")
    spec = ResourceSpec.local(workers=3, ps=2)
    sim = Simulator(SearchSpace(gi, spec), batch_size=30)
    strategy = builders.get(builder)().build(gi, spec)
    candidate = sim.space.encode(strategy)
    prediction = sim.predict(candidate[None, :])
    node_in, node_out = sim.node_traffic(candidate)
    assert node_in.shape == node_out.shape == (3, len(spec.nodes))
    total_in, total_out = node_in.sum(axis=0), node_out.sum(axis=0)
    assert np.isclose((total_in + total_out).sum(), prediction.parts["sum_node_bytes"][0])
    assert np.isclose(np.maximum(total_in, total_out).max(), prediction.parts["max_node_bytes"][0])
