"""Tests of the strategy builders in autodist.search.builders.

Each builder's rule is checked against an independent computation in the test
(load balancing, water-filling, fusion groups), not against the builder's own
helpers.
"""
from __future__ import annotations

import pytest

from autodist.ir.errors import StrategyError
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.proto import strategy_pb2
from autodist.search import builders
from autodist.search.builders import (PS, STRATEGY_BUILDERS, AllReduce, Parallax,
                                      PartitionedAR, PartitionedPS, PSLoadBalancing,
                                      RandomAxisPartitionAR, UnevenPartitionedPS)

AR = strategy_pb2.AllReduceSynchronizer
ITEM = "item_embedding/embeddings"   # [20011, 64] (prime rows), sparse gradient
USER = "user_embedding/embeddings"   # [1000, 64], sparse gradient
MODELS = ["mlp_item", "cnn_item", "ncf_item", "transformer_item"]
SPECS = ["local_spec", "hetero_spec"]


# ------------------------------------------------------------------ helpers
def config_of(strategy: Strategy, name: str) -> strategy_pb2.VariableConfig:
    return strategy.variable(name)


def is_partitioned(config: strategy_pb2.VariableConfig) -> bool:
    return config.HasField("partitioner") and config.partitioner.num_shards > 1


def shard_rows(config: strategy_pb2.VariableConfig, dim: int) -> list[int]:
    """Rows per shard along the partition axis (the even split when no sizes are recorded)."""
    p = config.partitioner
    if p.shard_sizes:
        return list(p.shard_sizes)
    base, extra = divmod(dim, p.num_shards)
    return [base + (i < extra) for i in range(p.num_shards)]


def destinations(config: strategy_pb2.VariableConfig) -> list[str]:
    return [s.ps.reduction_destination for s in config.shards]


def without_id(strategy: Strategy) -> strategy_pb2.Strategy:
    proto = strategy_pb2.Strategy()
    proto.CopyFrom(strategy.proto)
    proto.ClearField("id")
    return proto


def fastest_ps(spec: ResourceSpec) -> str:
    return max(spec.ps_devices, key=spec.bandwidth_gbps)


def expected_lpt(graph_item, spec: ResourceSpec) -> dict[str, str]:
    """Longest-processing-time placement: largest first, onto min (load + size) / bandwidth."""
    devices = spec.ps_devices
    load = dict.fromkeys(devices, 0.0)
    order = sorted(range(len(graph_item.variables)),
                   key=lambda i: (-graph_item.variables[i].byte_size, i))
    placed = {}
    for i in order:
        v = graph_item.variables[i]
        best = min(devices,  # min() keeps the first of equal keys: ties go to the earlier PS
                   key=lambda d: (load[d] + v.byte_size) / spec.bandwidth_gbps(d))
        load[best] += v.byte_size
        placed[v.name] = best
    return placed


def max_time(graph_item, spec: ResourceSpec, placement: dict[str, str]) -> float:
    load = dict.fromkeys(spec.ps_devices, 0.0)
    for v in graph_item.variables:
        load[placement[v.name]] += v.byte_size
    return max(load[d] / spec.bandwidth_gbps(d) for d in load)


@pytest.fixture
def worker_only_spec():
    """Two workers and no node with the 'ps' role."""
    return ResourceSpec.from_dict({"nodes": [
        {"address": "w0", "chief": True, "roles": ["worker"]},
        {"address": "w1", "roles": ["worker"]}]})


@pytest.fixture
def two_ps_spec():
    return ResourceSpec.local(workers=2, ps=2)


# ------------------------------------------------------- every builder, every model
@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("builder_name", sorted(STRATEGY_BUILDERS))
def test_builder_output_is_valid_and_complete(request, builder_name, model, spec_name):
    graph_item = request.getfixturevalue(model)
    spec = request.getfixturevalue(spec_name)
    strategy = STRATEGY_BUILDERS[builder_name]().build(graph_item, spec)
    assert isinstance(strategy, Strategy)
    strategy.validate(graph_item, spec, check_fingerprints=True)
    assert [c.var_name for c in strategy] == graph_item.variable_names
    assert strategy.origin == builder_name
    assert strategy.replicas == spec.replica_devices
    assert strategy.proto.graph_item_fingerprint == graph_item.fingerprint
    assert strategy.proto.resource_spec_fingerprint == spec.fingerprint
    assert not strategy.proto.graph_config.HasField("virtual_nodes")


def test_builders_registry_names_match_classes():
    assert sorted(STRATEGY_BUILDERS) == sorted(["PS", "PSLoadBalancing", "PartitionedPS",
                                       "UnevenPartitionedPS", "AllReduce", "PartitionedAR",
                                       "RandomAxisPartitionAR", "Parallax"])
    for name, cls in STRATEGY_BUILDERS.items():
        assert cls.name == name
        assert builders.get(name) is cls


def test_get_unknown_builder_lists_known_names():
    with pytest.raises(ValueError, match="unknown builder 'Nope'") as info:
        builders.get("Nope")
    for name in STRATEGY_BUILDERS:
        assert repr(name) in str(info.value)


def test_each_build_gets_a_fresh_id(mlp_item, local_spec):
    a, b = AllReduce().build(mlp_item, local_spec), AllReduce().build(mlp_item, local_spec)
    assert a.id != b.id
    assert without_id(a) == without_id(b)


# ------------------------------------------------------------ no 'ps' role
@pytest.mark.parametrize("builder", [PS, PSLoadBalancing, PartitionedPS, UnevenPartitionedPS,
                                     Parallax])
def test_ps_builders_need_a_ps_role(builder, ncf_item, worker_only_spec):
    assert worker_only_spec.ps_devices == []
    with pytest.raises(StrategyError, match="no node with the 'ps' role"):
        builder().build(ncf_item, worker_only_spec)


@pytest.mark.parametrize("builder", [AllReduce, PartitionedAR, RandomAxisPartitionAR])
def test_all_reduce_builders_need_no_ps(builder, ncf_item, worker_only_spec):
    builder().build(ncf_item, worker_only_spec).validate(ncf_item, worker_only_spec)


def test_parallax_without_sparse_variables_needs_no_ps(mlp_item, worker_only_spec):
    """Dense-only models go entirely to all-reduce, so no PS is required."""
    s = Parallax().build(mlp_item, worker_only_spec)
    assert all(c.shards[0].WhichOneof("kind") == "all_reduce" for c in s)


# ---------------------------------------------------------------------- PS
@pytest.mark.parametrize("spec_name", SPECS)
def test_ps_puts_everything_on_the_first_ps(request, ncf_item, spec_name):
    spec = request.getfixturevalue(spec_name)
    s = PS().build(ncf_item, spec)
    for config in s:
        assert not config.HasField("partitioner")
        assert len(config.shards) == 1
        ps = config.shards[0].ps
        assert ps.reduction_destination == spec.ps_devices[0]
        assert ps.sync is True
        assert ps.staleness == 0
        assert ps.local_replication is False


@pytest.mark.parametrize("kwargs, expected", [
    (dict(sync=False), dict(sync=False, staleness=0, local_replication=False)),
    (dict(staleness=2), dict(sync=True, staleness=2, local_replication=False)),
    (dict(local_replication=True), dict(sync=True, staleness=0, local_replication=True)),
])
@pytest.mark.parametrize("builder", [PS, PSLoadBalancing, PartitionedPS, UnevenPartitionedPS])
def test_ps_options_pass_through(builder, kwargs, expected, ncf_item, hetero_spec):
    s = builder(**kwargs).build(ncf_item, hetero_spec)
    for config in s:
        for shard in config.shards:
            ps = shard.ps
            assert (ps.sync, ps.staleness, ps.local_replication) == (
                expected["sync"], expected["staleness"], expected["local_replication"])


def test_parallax_ps_options_apply_to_sparse_variables_only(ncf_item, hetero_spec):
    s = Parallax(sync=True, staleness=3, local_replication=True).build(ncf_item, hetero_spec)
    for config in s:
        for shard in config.shards:
            if shard.WhichOneof("kind") == "ps":
                assert (shard.ps.sync, shard.ps.staleness, shard.ps.local_replication) == (
                    True, 3, True)


@pytest.mark.parametrize("builder", [PS, PSLoadBalancing, PartitionedPS, UnevenPartitionedPS,
                                     Parallax])
@pytest.mark.parametrize("kwargs, match", [
    (dict(sync=False, staleness=1), "staleness=1 needs sync=True"),
    (dict(staleness=-1), "staleness must be an integer >= 0. Received: -1"),
    (dict(staleness=1.5), "staleness must be an integer >= 0. Received: 1.5"),
])
def test_ps_invalid_options(builder, kwargs, match):
    with pytest.raises(ValueError, match=match):
        builder(**kwargs)


# --------------------------------------------------------- PSLoadBalancing
@pytest.mark.parametrize("spec_name", SPECS + ["two_ps_spec"])
@pytest.mark.parametrize("model", MODELS)
def test_ps_load_balancing_is_bandwidth_weighted_lpt(request, model, spec_name):
    graph_item = request.getfixturevalue(model)
    spec = request.getfixturevalue(spec_name)
    s = PSLoadBalancing().build(graph_item, spec)
    placed = {c.var_name: destinations(c)[0] for c in s}
    assert all(len(c.shards) == 1 and not c.HasField("partitioner") for c in s)
    assert placed == expected_lpt(graph_item, spec)
    # No worse than placing in graph order round-robin.
    ps = spec.ps_devices
    round_robin = {v.name: ps[i % len(ps)] for i, v in enumerate(graph_item.variables)}
    assert max_time(graph_item, spec, placed) <= max_time(graph_item, spec, round_robin)


@pytest.mark.parametrize("model", MODELS)
def test_ps_load_balancing_gives_largest_variable_to_fastest_ps(request, model, hetero_spec):
    graph_item = request.getfixturevalue(model)
    largest = max(graph_item.variables, key=lambda v: v.byte_size)
    s = PSLoadBalancing().build(graph_item, hetero_spec)
    assert fastest_ps(hetero_spec) == "/job:ps/task:1/device:CPU:0"
    assert destinations(config_of(s, largest.name)) == [fastest_ps(hetero_spec)]


def test_ps_load_balancing_uses_every_ps_on_mlp(mlp_item, two_ps_spec):
    """The two big kernels go to different servers, unlike PS which uses one."""
    s = PSLoadBalancing().build(mlp_item, two_ps_spec)
    assert destinations(config_of(s, "dense_0/kernel")) != destinations(
        config_of(s, "dense_1/kernel"))
    assert {d for c in s for d in destinations(c)} == set(two_ps_spec.ps_devices)


# ----------------------------------------------------------- PartitionedPS
def test_partitioned_ps_splits_prime_table_evenly_over_all_ps(ncf_item, hetero_spec):
    s = PartitionedPS().build(ncf_item, hetero_spec)
    config = config_of(s, ITEM)
    p = config.partitioner
    assert (p.axis, p.num_shards) == (0, len(hetero_spec.ps_devices)) == (0, 3)
    rows = shard_rows(config, 20011)
    assert sum(rows) == 20011 and max(rows) - min(rows) <= 1
    assert list(p.shard_sizes) in ([], rows)
    assert sorted(destinations(config)) == sorted(hetero_spec.ps_devices)  # distinct servers
    # The first (largest) shard is placed while every server is empty: the fastest wins.
    assert destinations(config)[0] == fastest_ps(hetero_spec)


def test_partitioned_ps_keeps_small_variables_whole(ncf_item, hetero_spec):
    s = PartitionedPS().build(ncf_item, hetero_spec)
    for name in ("mlp_hidden/bias", "logit/kernel", "logit/bias", USER):
        config = config_of(s, name)
        assert not is_partitioned(config), name
        assert len(config.shards) == 1


@pytest.mark.parametrize("model", MODELS)
def test_partitioned_ps_shard_count_rule(request, model, hetero_spec):
    """shards = min(#ps, axis size, bytes // min_shard_bytes), at least 1, on axis 0 of allowed."""
    graph_item = request.getfixturevalue(model)
    min_bytes = 4096
    s = PartitionedPS(min_shard_bytes=min_bytes).build(graph_item, hetero_spec)
    for v in graph_item.variables:
        config = config_of(s, v.name)
        if not v.partitionable_axes:
            assert not is_partitioned(config)
            continue
        axis = v.partitionable_axes[0]
        n = max(1, min(3, v.shape[axis], v.byte_size // min_bytes))
        assert len(config.shards) == n, v.name
        if n > 1:
            assert (config.partitioner.axis, config.partitioner.num_shards) == (axis, n)
            assert not config.partitioner.shard_sizes  # even split, nothing recorded
            assert len(set(destinations(config))) == n
        else:
            assert not is_partitioned(config)


def test_partitioned_ps_huge_min_shard_bytes_disables_partitioning(ncf_item, hetero_spec):
    s = PartitionedPS(min_shard_bytes=1 << 40).build(ncf_item, hetero_spec)
    assert not any(is_partitioned(c) for c in s)


def test_partitioned_ps_never_more_shards_than_rows(captured, hetero_spec):
    tiny = captured("ncf", num_users=2, num_items=3, dim=4)
    s = PartitionedPS(min_shard_bytes=1, max_shards=10).build(tiny, hetero_spec)
    s.validate(tiny, hetero_spec)
    assert config_of(s, USER).partitioner.num_shards == 2   # [2, 4] table
    assert config_of(s, ITEM).partitioner.num_shards == 3   # [3, 4] table
    assert config_of(s, "mlp_hidden/kernel").partitioner.num_shards == 10  # [12, 32]
    assert not is_partitioned(config_of(s, "logit/bias"))   # [1]: no partitionable axis
    for v in tiny.variables:
        config = config_of(s, v.name)
        if is_partitioned(config):
            assert config.partitioner.num_shards <= v.shape[config.partitioner.axis]


def test_partitioned_ps_max_shards(ncf_item, hetero_spec):
    s = PartitionedPS(max_shards=2).build(ncf_item, hetero_spec)
    assert config_of(s, ITEM).partitioner.num_shards == 2


@pytest.mark.parametrize("kwargs, match", [
    (dict(min_shard_bytes=0), "min_shard_bytes must be >= 1. Received: 0"),
    (dict(max_shards=0), "max_shards must be >= 1. Received: 0"),
])
@pytest.mark.parametrize("builder", [PartitionedPS, UnevenPartitionedPS])
def test_partitioned_ps_invalid_options(builder, kwargs, match):
    with pytest.raises(ValueError, match=match):
        builder(**kwargs)


def test_partitioned_ps_single_ps_means_no_partitioning(ncf_item, local_spec):
    s = PartitionedPS().build(ncf_item, local_spec)
    assert not any(is_partitioned(c) for c in s)


# ----------------------------------------------------- UnevenPartitionedPS
def test_uneven_partitioned_ps_water_fills_by_bandwidth(ncf_item, hetero_spec):
    s = UnevenPartitionedPS().build(ncf_item, hetero_spec)
    config = config_of(s, ITEM)
    p = config.partitioner
    assert (p.axis, p.num_shards) == (0, 3)
    sizes = list(p.shard_sizes)
    assert sum(sizes) == 20011
    # The table is placed first (largest), onto empty servers: with equal prior
    # loads, water-filling gives each server rows in proportion to bandwidth.
    devices = destinations(config)
    assert devices == hetero_spec.ps_devices
    bandwidth = [hetero_spec.bandwidth_gbps(d) for d in devices]
    for rows, bw in zip(sizes, bandwidth):
        assert abs(rows - 20011 * bw / sum(bandwidth)) <= 1
    # 20011 * 40/60 = 13340.67 and 20011 * 10/60 = 3335.17: the fast shard is 4x, +1 row.
    fast = devices.index(fastest_ps(hetero_spec))
    assert fast == 1
    assert sizes == [3335, 13341, 3335]
    assert sizes[fast] - 4 * sizes[0] == 1


def test_uneven_partitioned_ps_equal_servers_give_even_split(ncf_item, two_ps_spec):
    s = UnevenPartitionedPS().build(ncf_item, two_ps_spec)
    config = config_of(s, ITEM)
    assert config.partitioner.num_shards == 2
    assert not config.partitioner.shard_sizes  # the even split is not recorded
    assert shard_rows(config, 20011) == [10006, 10005]


def test_uneven_partitioned_ps_single_ps_means_no_partitioning(ncf_item, local_spec):
    s = UnevenPartitionedPS().build(ncf_item, local_spec)
    assert not any(is_partitioned(c) for c in s)
    assert {d for c in s for d in destinations(c)} == set(local_spec.ps_devices)


def test_uneven_partitioned_ps_second_table_water_fills_the_earliest_servers(captured,
                                                                             hetero_spec):
    """After the item table every server finishes at the same time, so the user table
    (2 shards by min_shard_bytes) goes to the first two servers, sized by bandwidth, and
    the small whole variables go to the server left out."""
    gi = captured("ncf", num_users=3001, num_items=20011, dim=64)
    s = UnevenPartitionedPS().build(gi, hetero_spec)
    p0, p1, p2 = hetero_spec.ps_devices
    assert list(config_of(s, ITEM).partitioner.shard_sizes) == [3335, 13341, 3335]
    user = config_of(s, USER)
    assert user.partitioner.num_shards == 2 == 768256 // (256 * 1024)
    assert destinations(user) == [p0, p1]
    bandwidth = [hetero_spec.bandwidth_gbps(d) for d in (p0, p1)]
    expected = [3001 * bw / sum(bandwidth) for bw in bandwidth]   # 600.2, 2400.8
    sizes = list(user.partitioner.shard_sizes)
    assert sum(sizes) == 3001
    assert all(abs(a - b) < 1 for a, b in zip(sizes, expected))
    assert sizes == [600, 2401]
    for name in ("mlp_hidden/kernel", "mlp_hidden/bias", "logit/kernel", "logit/bias"):
        assert destinations(config_of(s, name)) == [p2]


# --------------------------------------------------------------- AllReduce
def _group_of(config: strategy_pb2.VariableConfig, shard: int = 0) -> int:
    return config.shards[shard].all_reduce.group


def test_all_reduce_specs(ncf_item, local_spec):
    s = AllReduce().build(ncf_item, local_spec)
    for v in ncf_item.variables:
        config = config_of(s, v.name)
        assert not is_partitioned(config)
        (shard,) = config.shards
        assert shard.WhichOneof("kind") == "all_reduce"
        assert shard.all_reduce.spec == (AR.ALL_GATHER if v.sparse_gradient else AR.AUTO)
        assert shard.all_reduce.compressor == AR.NONE


@pytest.mark.parametrize("model", MODELS)
def test_all_reduce_default_fuses_all_dense_into_one_group(request, model, local_spec):
    graph_item = request.getfixturevalue(model)
    s = AllReduce().build(graph_item, local_spec)
    dense = {_group_of(config_of(s, v.name)) for v in graph_item.variables
             if not v.sparse_gradient}
    assert len(dense) == 1


def test_all_reduce_sparse_variables_get_their_own_groups(ncf_item, transformer_item,
                                                          local_spec):
    for gi in (ncf_item, transformer_item):
        s = AllReduce().build(gi, local_spec)
        groups = [_group_of(c) for c in s]
        for v, group in zip(gi.variables, groups):
            if v.sparse_gradient:
                assert groups.count(group) == 1, v.name


@pytest.mark.parametrize("group_bytes", [1, 100_000, 300_000, 1 << 20])
@pytest.mark.parametrize("model", ["mlp_item", "transformer_item", "ncf_item"])
def test_all_reduce_groups_bounded_by_group_bytes(request, model, group_bytes, local_spec):
    graph_item = request.getfixturevalue(model)
    s = AllReduce(group_bytes=group_bytes).build(graph_item, local_spec)
    dense = sorted((v for v in graph_item.variables if not v.sparse_gradient),
                   key=lambda v: v.gradient_order)
    group = {v.name: _group_of(config_of(s, v.name)) for v in dense}
    members: dict[int, list] = {}
    for v in dense:
        members.setdefault(group[v.name], []).append(v)
    for vs in members.values():
        assert sum(v.byte_size for v in vs) <= group_bytes or len(vs) == 1
    # Groups follow the backward order (contiguous runs) and are filled greedily.
    runs = [group[v.name] for v in dense]
    assert runs == sorted(runs)
    ordered = [members[g] for g in sorted(members)]
    for a, b in zip(ordered, ordered[1:]):
        assert sum(v.byte_size for v in a) + b[0].byte_size > group_bytes


def test_all_reduce_small_group_bytes_on_mlp(mlp_item, local_spec):
    """Backward order: logits/bias, logits/kernel, dense_1/bias, dense_1/kernel, dense_0/..."""
    s = AllReduce(group_bytes=100_000).build(mlp_item, local_spec)
    group = {c.var_name: _group_of(c) for c in s}
    assert group["logits/bias"] == group["logits/kernel"] == group["dense_1/bias"]
    assert len({group["logits/bias"], group["dense_1/kernel"], group["dense_0/bias"],
                group["dense_0/kernel"]}) == 4
    assert len(set(group.values())) == 4


def test_all_reduce_groups_are_deterministic(ncf_item, transformer_item, local_spec):
    for gi in (ncf_item, transformer_item):
        a = AllReduce(group_bytes=4096).build(gi, local_spec)
        b = AllReduce(group_bytes=4096).build(gi, local_spec)
        assert without_id(a) == without_id(b)


def test_all_reduce_fp16_compressor(ncf_item, local_spec):
    s = AllReduce(compressor="fp16").build(ncf_item, local_spec)
    assert all(c.shards[0].all_reduce.compressor == AR.FP16 for c in s)


def test_all_reduce_error_feedback_becomes_fp16_on_sparse(ncf_item, local_spec):
    s = AllReduce(compressor="fp16_error_feedback").build(ncf_item, local_spec)
    for v in ncf_item.variables:
        expected = AR.FP16 if v.sparse_gradient else AR.FP16_ERROR_FEEDBACK
        assert config_of(s, v.name).shards[0].all_reduce.compressor == expected, v.name


@pytest.mark.parametrize("builder", [AllReduce, PartitionedAR, RandomAxisPartitionAR, Parallax])
def test_unknown_compressor(builder):
    with pytest.raises(ValueError, match="unknown compressor 'zip'"):
        builder(compressor="zip")


@pytest.mark.parametrize("builder", [AllReduce, PartitionedAR, RandomAxisPartitionAR, Parallax])
def test_invalid_group_bytes(builder):
    with pytest.raises(ValueError, match="group_bytes must be >= 1. Received: 0"):
        builder(group_bytes=0)


# ----------------------------------------------------------- PartitionedAR
@pytest.mark.parametrize("min_bytes, max_shards", [(100_000, 4), (1_000, 8), (1, 3)])
@pytest.mark.parametrize("model", MODELS)
def test_partitioned_ar_shard_rule(request, model, min_bytes, max_shards, local_spec):
    graph_item = request.getfixturevalue(model)
    s = PartitionedAR(min_shard_bytes=min_bytes, max_shards=max_shards).build(
        graph_item, local_spec)
    for v in graph_item.variables:
        config = config_of(s, v.name)
        axes = list(v.partitionable_axes)
        n = max(1, min(max_shards, v.shape[axes[0]], v.byte_size // min_bytes)) if axes else 1
        assert len(config.shards) == n, v.name
        for shard in config.shards:
            assert shard.WhichOneof("kind") == "all_reduce"
            assert shard.all_reduce.spec == (AR.ALL_GATHER if v.sparse_gradient else AR.AUTO)
        if n == 1:
            assert not config.HasField("partitioner")
            continue
        p = config.partitioner
        assert (p.axis, p.num_shards) == (axes[0], n)
        assert not p.shard_sizes  # even shards
        if v.sparse_gradient:  # sparse shards are all-gathered, one group each
            assert len({_group_of(config, k) for k in range(n)}) == n


def test_partitioned_ar_on_mlp(mlp_item, local_spec):
    s = PartitionedAR(min_shard_bytes=100_000, max_shards=4).build(mlp_item, local_spec)
    k0, k1 = config_of(s, "dense_0/kernel"), config_of(s, "dense_1/kernel")
    assert (k0.partitioner.axis, k0.partitioner.num_shards) == (0, 4)   # 802816 B, 784 rows
    assert (k1.partitioner.axis, k1.partitioner.num_shards) == (0, 2)   # 262144 B
    assert not is_partitioned(config_of(s, "logits/kernel"))


def test_partitioned_ar_defaults_leave_small_models_whole(transformer_item, local_spec):
    s = PartitionedAR().build(transformer_item, local_spec)
    assert not any(is_partitioned(c) for c in s)


def test_partitioned_ar_shards_are_grouped_by_bytes(mlp_item, local_spec):
    """Each shard is a separate tensor for fusion: 4 shards of 200704 B need 4 groups."""
    s = PartitionedAR(group_bytes=250_000, min_shard_bytes=100_000, max_shards=4).build(
        mlp_item, local_spec)
    k0 = config_of(s, "dense_0/kernel")
    assert len({_group_of(k0, k) for k in range(4)}) == 4


@pytest.mark.parametrize("kwargs, match", [
    (dict(min_shard_bytes=0), "min_shard_bytes must be >= 1. Received: 0"),
    (dict(max_shards=0), "max_shards must be >= 1. Received: 0"),
])
@pytest.mark.parametrize("builder", [PartitionedAR, RandomAxisPartitionAR])
def test_partitioned_ar_invalid_options(builder, kwargs, match):
    with pytest.raises(ValueError, match=match):
        builder(**kwargs)


# --------------------------------------------------- RandomAxisPartitionAR
def _axes(strategy: Strategy) -> dict[str, int]:
    return {c.var_name: c.partitioner.axis for c in strategy if is_partitioned(c)}


def test_random_axis_same_seed_same_strategy(transformer_item, local_spec):
    builder = RandomAxisPartitionAR(seed=7, min_shard_bytes=64)
    a = builder.build(transformer_item, local_spec)
    b = builder.build(transformer_item, local_spec)   # the same builder, built again
    c = RandomAxisPartitionAR(seed=7, min_shard_bytes=64).build(transformer_item, local_spec)
    assert a.id != b.id
    assert without_id(a) == without_id(b) == without_id(c)


def test_random_axis_different_seed_changes_an_axis(transformer_item, local_spec):
    a = RandomAxisPartitionAR(seed=0, min_shard_bytes=64).build(transformer_item, local_spec)
    b = RandomAxisPartitionAR(seed=1, min_shard_bytes=64).build(transformer_item, local_spec)
    axes_a, axes_b = _axes(a), _axes(b)
    assert len(axes_a) > 10
    assert axes_a != axes_b
    assert any(axis != 0 for axis in axes_a.values())


@pytest.mark.parametrize("model", ["transformer_item", "ncf_item"])
def test_random_axis_sparse_only_on_axis_0(request, model, local_spec):
    graph_item = request.getfixturevalue(model)
    sparse = [v.name for v in graph_item.variables if v.sparse_gradient]
    assert sparse
    for seed in range(8):
        s = RandomAxisPartitionAR(seed=seed, min_shard_bytes=64).build(graph_item, local_spec)
        axes = _axes(s)
        for name in sparse:
            assert axes[name] == 0, (seed, name)


def test_random_axis_partitions_within_bounds(transformer_item, local_spec):
    s = RandomAxisPartitionAR(seed=3, min_shard_bytes=64, max_shards=4).build(
        transformer_item, local_spec)
    for v in transformer_item.variables:
        config = config_of(s, v.name)
        if is_partitioned(config):
            p = config.partitioner
            assert p.axis in v.partitionable_axes
            assert p.num_shards == max(1, min(4, v.shape[p.axis], v.byte_size // 64))
            assert len(config.shards) == p.num_shards


# ---------------------------------------------------------------- Parallax
def test_parallax_sparse_to_ps_dense_to_all_reduce(ncf_item, hetero_spec):
    s = Parallax().build(ncf_item, hetero_spec)
    for v in ncf_item.variables:
        config = config_of(s, v.name)
        kinds = {shard.WhichOneof("kind") for shard in config.shards}
        assert kinds == ({"ps"} if v.sparse_gradient else {"all_reduce"}), v.name
    item = config_of(s, ITEM)                     # 5 MB: partitioned over the 3 servers
    assert item.partitioner.num_shards == 3
    assert sorted(destinations(item)) == sorted(hetero_spec.ps_devices)
    assert not is_partitioned(config_of(s, USER))  # 250 KB < min_shard_bytes
    dense_groups = {_group_of(config_of(s, v.name)) for v in ncf_item.variables
                    if not v.sparse_gradient}
    assert dense_groups == {0}


def test_parallax_min_shard_bytes_partitions_sparse_tables(ncf_item, hetero_spec):
    s = Parallax(min_shard_bytes=1000).build(ncf_item, hetero_spec)
    for name in (USER, ITEM):
        config = config_of(s, name)
        assert (config.partitioner.axis, config.partitioner.num_shards) == (0, 3)
        assert sorted(destinations(config)) == sorted(hetero_spec.ps_devices)
    assert not any(is_partitioned(config_of(s, v.name)) for v in ncf_item.variables
                   if not v.sparse_gradient)


def test_parallax_dense_compressor(ncf_item, hetero_spec):
    s = Parallax(compressor="fp16").build(ncf_item, hetero_spec)
    for v in ncf_item.variables:
        if not v.sparse_gradient:
            assert config_of(s, v.name).shards[0].all_reduce.compressor == AR.FP16
