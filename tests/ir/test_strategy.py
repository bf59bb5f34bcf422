"""Tests of autodist.ir.strategy: serialization round trips, loading and validation."""
from __future__ import annotations

import re

import pytest
from google.protobuf.descriptor import FieldDescriptor

from autodist.ir.errors import StrategyError
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import STRATEGY_SCHEMA_VERSION, Strategy
from autodist.proto import strategy_pb2
from autodist.search.builders import PS, AllReduce, PartitionedPS

AR = strategy_pb2.AllReduceSynchronizer
W0 = "/job:worker/task:0/device:CPU:0"
W1 = "/job:worker/task:1/device:CPU:0"
PS0 = "/job:ps/task:0/device:CPU:0"
ITEM = "item_embedding/embeddings"    # [20011, 64], sparse gradient
USER = "user_embedding/embeddings"    # [1000, 64], sparse gradient
HIDDEN = "mlp_hidden/kernel"          # [192, 32], dense
LOGIT_K = "logit/kernel"              # [32, 1], dense
LOGIT_B = "logit/bias"                # [1], dense, not partitionable


# ------------------------------------------------------------------ helpers
def full_strategy_proto() -> strategy_pb2.Strategy:
    """A Strategy proto with every field of strategy.proto set to a non-default value."""
    p = strategy_pb2.Strategy(schema_version=STRATEGY_SCHEMA_VERSION, id="0123456789abcdef",
                              graph_item_fingerprint="gi-fingerprint",
                              resource_spec_fingerprint="rs-fingerprint", origin="user")
    p.graph_config.replicas.extend([W0, W1])
    vn = p.graph_config.virtual_nodes
    vn.global_batch_size = 64
    vn.num_virtual_nodes = 4
    vn.device.extend([W0, W0, W1, W1])
    p.graph_config.hyperparameters["learning_rate"] = 0.25
    p.graph_config.batch_norm = strategy_pb2.GraphConfig.GHOST

    table = p.variables.add(var_name=ITEM)
    table.partitioner.axis = 0
    table.partitioner.num_shards = 3
    table.partitioner.shard_sizes.extend([3335, 13341, 3335])
    for task in range(3):
        table.shards.add().ps.CopyFrom(strategy_pb2.PSSynchronizer(
            reduction_destination=f"/job:ps/task:{task}/device:CPU:0", local_replication=True,
            sync=True, staleness=2))
    dense = p.variables.add(var_name=HIDDEN)
    dense.partitioner.axis = 1  # axis 0 is the default value: ListFields() would not show it
    dense.partitioner.num_shards = 2
    dense.partitioner.shard_sizes.extend([20, 12])
    for _ in range(2):
        dense.shards.add().all_reduce.CopyFrom(
            AR(spec=AR.RING, compressor=AR.FP16_ERROR_FEEDBACK, group=3))

    perf = p.performance
    perf.predicted_step_time_s = 0.1 + 0.2          # not exactly representable in text
    perf.lower_bound_step_time_s = 1 / 3
    perf.predictor = "lightgbm:model.txt"
    perf.measured_step_time_s.extend([0.0123, 5e-324, 1e300])
    return p


def _reachable_fields(descriptor, out=None) -> set[tuple[str, str]]:
    """(message full name, field name) for every field of every message type below."""
    out = set() if out is None else out
    for field in descriptor.fields:
        key = (descriptor.full_name, field.name)
        if key in out:
            continue
        out.add(key)
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            _reachable_fields(field.message_type, out)
    return out


def _set_fields(message, out=None) -> set[tuple[str, str]]:
    """(message full name, field name) for every field set somewhere in `message`."""
    out = set() if out is None else out
    for field, value in message.ListFields():
        out.add((message.DESCRIPTOR.full_name, field.name))
        if field.type == FieldDescriptor.TYPE_MESSAGE and \
                field.message_type.GetOptions().map_entry:
            if value:  # a non-empty map sets its entries' key and value
                out.update((field.message_type.full_name, f.name)
                           for f in field.message_type.fields)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            is_repeated = getattr(field, "is_repeated", None)
            if is_repeated is None:  # older protobuf
                is_repeated = field.label == FieldDescriptor.LABEL_REPEATED
            for sub in (value if is_repeated else [value]):
                _set_fields(sub, out)
    return out


def assert_invalid(strategy: Strategy, graph_item, spec, match: str, *, variable: str = "",
                   field: str, received, check_fingerprints: bool = False) -> StrategyError:
    with pytest.raises(StrategyError, match=match) as info:
        strategy.validate(graph_item, spec, check_fingerprints=check_fingerprints)
    err = info.value
    assert err.variable == variable
    assert err.field == field
    assert err.received == received
    return err


def _config(strategy: Strategy, name: str) -> strategy_pb2.VariableConfig:
    return next(c for c in strategy.proto.variables if c.var_name == name)


@pytest.fixture
def ps_ncf(ncf_item, local_spec) -> Strategy:
    """A valid strategy to mutate: every ncf variable on the one PS."""
    s = PS().build(ncf_item, local_spec)
    s.validate(ncf_item, local_spec, check_fingerprints=True)
    return s


@pytest.fixture
def ar_ncf(ncf_item, local_spec) -> Strategy:
    """A valid strategy to mutate: ncf all-reduced (sparse tables all-gathered)."""
    s = AllReduce().build(ncf_item, local_spec)
    s.validate(ncf_item, local_spec, check_fingerprints=True)
    return s


# -------------------------------------------------------------- round trips
def test_fixture_sets_every_field_of_every_message():
    """A field added to strategy.proto later must be added to the fixture (and round-tripped)."""
    expected = _reachable_fields(strategy_pb2.Strategy.DESCRIPTOR)
    assert _set_fields(full_strategy_proto()) == expected


def test_binary_round_trip_preserves_every_field():
    s = Strategy(full_strategy_proto())
    back = Strategy.deserialize(s.serialize())
    assert back == s
    assert back.proto == full_strategy_proto()


def test_text_round_trip_preserves_every_field():
    s = Strategy(full_strategy_proto())
    back = Strategy.from_text(s.to_text())
    assert back == s
    assert back.proto.performance.predicted_step_time_s == 0.1 + 0.2


def test_serialize_is_deterministic():
    first, second = Strategy(full_strategy_proto()), Strategy(full_strategy_proto())
    assert first.serialize() == second.serialize()


def test_save_load_binary(tmp_path):
    s = Strategy(full_strategy_proto())
    path = tmp_path / "s.pb"
    s.save(path)
    assert Strategy.load(path) == s
    assert Strategy.load(str(path)) == s
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.pb"]  # no temporary left


def test_load_text_file(tmp_path):
    s = Strategy(full_strategy_proto())
    path = tmp_path / "s.pbtxt"
    path.write_text(s.to_text())
    assert Strategy.load(path) == s


def test_save_to_text_suffix_round_trips(tmp_path):
    """save() to a .pbtxt path must write what load() reads back from it (text)."""
    s = Strategy(full_strategy_proto())
    path = tmp_path / "s.pbtxt"
    s.save(path)
    assert Strategy.from_text(path.read_text()) == s
    assert Strategy.load(path) == s


def test_new_strategy_gets_schema_version_and_unique_id():
    a, b = Strategy(), Strategy()
    assert a.proto.schema_version == STRATEGY_SCHEMA_VERSION
    assert re.fullmatch(r"[0-9a-f]{32}", a.id)
    assert a.id != b.id


def test_accessors(ps_ncf, ncf_item):
    assert ps_ncf.origin == "PS"
    assert [c.var_name for c in ps_ncf] == ncf_item.variable_names
    assert len(ps_ncf) == len(ncf_item)
    assert ps_ncf.variable(ITEM).var_name == ITEM
    with pytest.raises(KeyError, match="ghost"):
        ps_ncf.variable("ghost")


# -------------------------------------------------------------- load errors
def test_load_missing_file(tmp_path):
    path = tmp_path / "nope.pb"
    with pytest.raises(StrategyError, match="cannot read strategy file .*nope.pb"):
        Strategy.load(path)


@pytest.mark.parametrize("data", [b"\xff\xfe\x00garbage bytes", b"not a strategy at all"])
def test_load_garbage_bytes_names_the_file(tmp_path, data):
    path = tmp_path / "garbage.pb"
    path.write_bytes(data)
    with pytest.raises(StrategyError, match=re.escape(repr(str(path))) + ".*not a Strategy"):
        Strategy.load(path)


def test_deserialize_empty_bytes_is_not_a_strategy():
    """Empty input parses as an empty message; it has no schema_version or id."""
    with pytest.raises(StrategyError, match="no schema_version or id"):
        Strategy.deserialize(b"")


def test_from_text_malformed():
    with pytest.raises(StrategyError, match="malformed strategy text"):
        Strategy.from_text("schema_version: 1\nno_such_field: 3\n")
    with pytest.raises(StrategyError, match="malformed strategy text"):
        Strategy.from_text("variables { var_name: ")


def test_load_malformed_text_file_names_the_file(tmp_path):
    path = tmp_path / "bad.pbtxt"
    path.write_text("graph_config { replicas: 3 ")
    with pytest.raises(StrategyError, match="bad.pbtxt.*malformed strategy text"):
        Strategy.load(path)


def test_load_binary_bytes_as_text_file_is_a_strategy_error(tmp_path):
    """Non-UTF-8 bytes in a text-suffixed file raise StrategyError, not UnicodeDecodeError."""
    path = tmp_path / "binary.pbtxt"
    path.write_bytes(b"\xff\xfe\x80\x81")
    with pytest.raises(StrategyError, match="binary.pbtxt"):
        Strategy.load(path)


# ------------------------------------------------------------- validation ok
def test_builder_outputs_validate_with_fingerprints(ps_ncf, ar_ncf, ncf_item, local_spec):
    for s in (ps_ncf, ar_ncf):
        s.validate(ncf_item, local_spec, check_fingerprints=True)


def test_valid_virtual_nodes_pass(ps_ncf, ncf_item, local_spec):
    vn = ps_ncf.proto.graph_config.virtual_nodes
    vn.global_batch_size, vn.num_virtual_nodes = 96, 3
    vn.device.extend([W0, W1, W1])
    ps_ncf.validate(ncf_item, local_spec)


def test_nccl_on_gpu_replicas_passes(ncf_item):
    spec = ResourceSpec.from_dict({"nodes": [
        {"address": "g0", "chief": True, "gpus": [0, 1]},
        {"address": "g1", "gpus": [0, 1]}]})
    s = AllReduce().build(ncf_item, spec)
    for config in s.proto.variables:
        if not ncf_item.variable(config.var_name).sparse_gradient:
            config.shards[0].all_reduce.spec = AR.NCCL
    s.validate(ncf_item, spec)


# ------------------------------------------------------ validation: variables
def test_unknown_variable(ps_ncf, ncf_item, local_spec):
    extra = ps_ncf.proto.variables.add(var_name="ghost")
    extra.shards.add().CopyFrom(ps_ncf.proto.variables[0].shards[0])
    assert_invalid(ps_ncf, ncf_item, local_spec, "unknown variable 'ghost'",
                   variable="ghost", field="var_name", received="ghost")


def test_variable_configured_twice(ps_ncf, ncf_item, local_spec):
    ps_ncf.proto.variables.add().CopyFrom(_config(ps_ncf, HIDDEN))
    assert_invalid(ps_ncf, ncf_item, local_spec, f"variable '{HIDDEN}' is configured twice",
                   variable=HIDDEN, field="var_name", received=HIDDEN)


def test_variable_missing_from_strategy(ps_ncf, ncf_item, local_spec):
    del ps_ncf.proto.variables[-1]
    assert_invalid(ps_ncf, ncf_item, local_spec,
                   re.escape(f"no config for variables ['{LOGIT_B}']"),
                   variable=LOGIT_B, field="variables", received=None)


# ---------------------------------------------------- validation: partitioner
def _partition(strategy: Strategy, name: str, axis: int, num_shards: int,
               shard_sizes=(), synchronizers: int | None = None) -> None:
    config = _config(strategy, name)
    config.partitioner.axis = axis
    config.partitioner.num_shards = num_shards
    config.partitioner.shard_sizes[:] = list(shard_sizes)
    sync = strategy_pb2.Synchronizer()
    sync.CopyFrom(config.shards[0])
    del config.shards[:]
    for _ in range(num_shards if synchronizers is None else synchronizers):
        config.shards.add().CopyFrom(sync)


def test_valid_partition_passes(ps_ncf, ncf_item, local_spec):
    _partition(ps_ncf, ITEM, 0, 3, [10000, 10000, 11])
    _partition(ps_ncf, HIDDEN, 1, 32)
    ps_ncf.validate(ncf_item, local_spec)


def test_shard_count_larger_than_axis(ps_ncf, ncf_item, local_spec):
    _partition(ps_ncf, HIDDEN, 1, 33)  # mlp_hidden/kernel is [192, 32]
    assert_invalid(ps_ncf, ncf_item, local_spec,
                   r"num_shards 33 is larger than axis 1 \(size 32\)",
                   variable=HIDDEN, field="partitioner.num_shards", received=33)


@pytest.mark.parametrize("axis", [2, -1])
def test_partition_axis_out_of_range(ps_ncf, ncf_item, local_spec, axis):
    _partition(ps_ncf, ITEM, axis, 2)
    assert_invalid(ps_ncf, ncf_item, local_spec,
                   re.escape(f"partitioner.axis must be in [0, 2). Received: {axis}"),
                   variable=ITEM, field="partitioner.axis", received=axis)


def test_sparse_variable_not_partitionable_on_axis_1(ps_ncf, ncf_item, local_spec):
    _partition(ps_ncf, ITEM, 1, 2)
    assert_invalid(ps_ncf, ncf_item, local_spec,
                   r"cannot be partitioned along axis 1 \(its gradient is sparse: only axis 0\)",
                   variable=ITEM, field="partitioner.axis", received=1)


def test_unpartitionable_variable(ps_ncf, ncf_item, local_spec):
    _partition(ps_ncf, LOGIT_B, 0, 2)  # logit/bias has one element: no partitionable axis
    assert_invalid(ps_ncf, ncf_item, local_spec, "cannot be partitioned along axis 0",
                   variable=LOGIT_B, field="partitioner.axis", received=0)


@pytest.mark.parametrize("num_shards, sizes", [
    (2, [10000, 10000]),          # sum 20000 != 20011
    (3, [10000, 10011]),          # two sizes for three shards
    (2, [20012, -1]),             # sums to the dim but a size is negative
    (2, [20011, 0]),              # an empty shard
])
def test_bad_shard_sizes(ps_ncf, ncf_item, local_spec, num_shards, sizes):
    _partition(ps_ncf, ITEM, 0, num_shards, sizes)
    assert_invalid(ps_ncf, ncf_item, local_spec,
                   re.escape(f"must be {num_shards} positive sizes summing to 20011 (axis 0). "
                             f"Received: {sizes}"),
                   variable=ITEM, field="partitioner.shard_sizes", received=sizes)


def test_shard_sizes_without_partition(ps_ncf, ncf_item, local_spec):
    _partition(ps_ncf, ITEM, 0, 1, [20011])
    assert_invalid(ps_ncf, ncf_item, local_spec, r"shard_sizes given for 1 shard\(s\)",
                   variable=ITEM, field="partitioner.shard_sizes", received=[20011])


def test_negative_num_shards(ps_ncf, ncf_item, local_spec):
    _config(ps_ncf, ITEM).partitioner.num_shards = -2
    assert_invalid(ps_ncf, ncf_item, local_spec, "num_shards must be >= 1. Received: -2",
                   variable=ITEM, field="partitioner.num_shards", received=-2)


def test_one_shard_partitioner_means_unpartitioned(ps_ncf, ncf_item, local_spec):
    _config(ps_ncf, ITEM).partitioner.num_shards = 1
    ps_ncf.validate(ncf_item, local_spec)


@pytest.mark.parametrize("synchronizers", [1, 3])
def test_synchronizer_count_differs_from_num_shards(ps_ncf, ncf_item, local_spec,
                                                    synchronizers):
    _partition(ps_ncf, ITEM, 0, 2, synchronizers=synchronizers)
    assert_invalid(ps_ncf, ncf_item, local_spec,
                   rf"has 2 shard\(s\) but {synchronizers} synchronizers",
                   variable=ITEM, field="shards", received=synchronizers)


def test_unpartitioned_variable_without_synchronizer(ps_ncf, ncf_item, local_spec):
    del _config(ps_ncf, HIDDEN).shards[:]
    assert_invalid(ps_ncf, ncf_item, local_spec, r"has 1 shard\(s\) but 0 synchronizers",
                   variable=HIDDEN, field="shards", received=0)


def test_shard_with_no_synchronizer(ps_ncf, ncf_item, local_spec):
    _partition(ps_ncf, ITEM, 0, 2)
    _config(ps_ncf, ITEM).shards[1].ClearField("ps")
    assert_invalid(ps_ncf, ncf_item, local_spec,
                   re.escape("shards[1] has no synchronizer (ps or all_reduce)"),
                   variable=ITEM, field="shards[1]", received=None)


# ------------------------------------------------------ validation: PS shards
def test_ps_destination_not_in_spec(ps_ncf, ncf_item, local_spec):
    ghost = "/job:ps/task:7/device:CPU:0"
    _config(ps_ncf, USER).shards[0].ps.reduction_destination = ghost
    assert_invalid(ps_ncf, ncf_item, local_spec,
                   re.escape(f"reduction_destination '{ghost}' is not a device"),
                   variable=USER, field="shards[0].ps.reduction_destination", received=ghost)


def test_ps_destination_may_be_a_worker_device(ps_ncf, ncf_item, local_spec):
    _config(ps_ncf, USER).shards[0].ps.reduction_destination = W1
    ps_ncf.validate(ncf_item, local_spec)


def test_staleness_without_sync(ps_ncf, ncf_item, local_spec):
    ps = _config(ps_ncf, HIDDEN).shards[0].ps
    ps.sync, ps.staleness = False, 2
    assert_invalid(ps_ncf, ncf_item, local_spec, "staleness is 2 but sync is false",
                   variable=HIDDEN, field="shards[0].ps.staleness", received=2)


@pytest.mark.parametrize("sync", [True, False])
def test_negative_staleness(ps_ncf, ncf_item, local_spec, sync):
    ps = _config(ps_ncf, HIDDEN).shards[0].ps
    ps.sync, ps.staleness = sync, -1
    assert_invalid(ps_ncf, ncf_item, local_spec, "staleness must be >= 0. Received: -1",
                   variable=HIDDEN, field="shards[0].ps.staleness", received=-1)


def test_async_and_bounded_staleness_pass(ps_ncf, ncf_item, local_spec):
    _config(ps_ncf, HIDDEN).shards[0].ps.sync = False
    _config(ps_ncf, ITEM).shards[0].ps.staleness = 3
    ps_ncf.validate(ncf_item, local_spec)


# ------------------------------------------------------ validation: replicas
def test_replica_not_in_spec(ps_ncf, ncf_item, local_spec):
    ghost = "/job:worker/task:9/device:CPU:0"
    ps_ncf.proto.graph_config.replicas[1] = ghost
    assert_invalid(ps_ncf, ncf_item, local_spec, "which is not in the resource spec",
                   field="graph_config.replicas", received=ghost)


def test_replica_on_ps_only_device(ps_ncf, ncf_item, local_spec):
    ps_ncf.proto.graph_config.replicas.append(PS0)
    assert_invalid(ps_ncf, ncf_item, local_spec, "which is not a compute device",
                   field="graph_config.replicas", received=PS0)


def test_empty_replicas(ps_ncf, ncf_item, local_spec):
    del ps_ncf.proto.graph_config.replicas[:]
    assert_invalid(ps_ncf, ncf_item, local_spec, "graph_config.replicas is empty",
                   field="graph_config.replicas", received=[])


def test_duplicate_replica(ps_ncf, ncf_item, local_spec):
    ps_ncf.proto.graph_config.replicas.append(W0)
    assert_invalid(ps_ncf, ncf_item, local_spec, re.escape(f"replicas repeats '{W0}'"),
                   field="graph_config.replicas", received=W0)


def test_subset_of_replicas_passes(ps_ncf, ncf_item, local_spec):
    del ps_ncf.proto.graph_config.replicas[1]
    ps_ncf.validate(ncf_item, local_spec)


# ------------------------------------------------ validation: all-reduce shards
def test_sparse_variable_densified_by_ring_passes(ar_ncf, ncf_item, local_spec):
    _config(ar_ncf, ITEM).shards[0].all_reduce.spec = AR.RING
    ar_ncf.validate(ncf_item, local_spec)


def test_densified_sparse_variable_fuses_with_dense_ones(ar_ncf, ncf_item, local_spec):
    group = _config(ar_ncf, HIDDEN).shards[0].all_reduce.group
    item = _config(ar_ncf, ITEM).shards[0].all_reduce
    item.group, item.spec = group, AR.RING  # AUTO on the dense members is a ring too
    ar_ncf.validate(ncf_item, local_spec)


def test_densified_sparse_variable_may_use_error_feedback(ar_ncf, ncf_item, local_spec):
    sync = _config(ar_ncf, USER).shards[0].all_reduce
    sync.spec, sync.compressor = AR.RING, AR.FP16_ERROR_FEEDBACK
    ar_ncf.validate(ncf_item, local_spec)


@pytest.mark.parametrize("spec", ["AUTO", "ALL_GATHER"])
def test_sparse_variable_on_gather_specs_passes(ar_ncf, ncf_item, local_spec, spec):
    _config(ar_ncf, ITEM).shards[0].all_reduce.spec = AR.Spec.Value(spec)
    ar_ncf.validate(ncf_item, local_spec)


def test_sparse_variable_with_error_feedback(ar_ncf, ncf_item, local_spec):
    _config(ar_ncf, USER).shards[0].all_reduce.compressor = AR.FP16_ERROR_FEEDBACK
    assert_invalid(ar_ncf, ncf_item, local_spec,
                   "is all-gathered \\(spec ALL_GATHER\\); compressor FP16_ERROR_FEEDBACK keeps "
                   "a dense residual",
                   variable=USER, field="shards[0].all_reduce.compressor",
                   received="FP16_ERROR_FEEDBACK")


def test_nccl_on_cpu_replicas(ar_ncf, ncf_item, local_spec):
    _config(ar_ncf, HIDDEN).shards[0].all_reduce.spec = AR.NCCL
    assert_invalid(ar_ncf, ncf_item, local_spec, "NCCL needs GPU replicas",
                   variable=HIDDEN, field="shards[0].all_reduce.spec", received="NCCL")


def test_all_reduce_group_mixing_compressors(ar_ncf, ncf_item, local_spec):
    group = _config(ar_ncf, HIDDEN).shards[0].all_reduce.group
    assert _config(ar_ncf, LOGIT_B).shards[0].all_reduce.group == group  # fused together
    _config(ar_ncf, LOGIT_B).shards[0].all_reduce.compressor = AR.FP16
    assert_invalid(ar_ncf, ncf_item, local_spec,
                   f"all-reduce group {group} mixes .* of variable '{HIDDEN}'",
                   variable=LOGIT_B, field="shards[0].all_reduce.group", received=group)


def test_same_compressor_across_a_group_passes(ar_ncf, ncf_item, local_spec):
    for name in (HIDDEN, "mlp_hidden/bias", LOGIT_K, LOGIT_B):
        _config(ar_ncf, name).shards[0].all_reduce.compressor = AR.FP16
    ar_ncf.validate(ncf_item, local_spec)


def test_sparse_and_dense_in_one_group(ar_ncf, ncf_item, local_spec):
    group = _config(ar_ncf, HIDDEN).shards[0].all_reduce.group
    item = _config(ar_ncf, ITEM).shards[0].all_reduce
    item.group, item.spec = group, AR.AUTO
    # The item table comes first in the strategy, so the dense variable is the misfit.
    assert_invalid(ar_ncf, ncf_item, local_spec,
                   f"all-reduce group {group} mixes .* of variable '{ITEM}'",
                   variable=HIDDEN, field="shards[0].all_reduce.group", received=group)


def test_negative_all_reduce_group(ar_ncf, ncf_item, local_spec):
    _config(ar_ncf, HIDDEN).shards[0].all_reduce.group = -1
    assert_invalid(ar_ncf, ncf_item, local_spec, "group must be >= 0. Received: -1",
                   variable=HIDDEN, field="shards[0].all_reduce.group", received=-1)


# --------------------------------------------------- validation: virtual nodes
VN = "graph_config.virtual_nodes"


def _virtual_nodes(strategy: Strategy, batch: int, num: int, devices: list[str]) -> None:
    vn = strategy.proto.graph_config.virtual_nodes
    vn.global_batch_size, vn.num_virtual_nodes = batch, num
    vn.device[:] = devices


@pytest.mark.parametrize("batch", [10, 0, -8])
def test_virtual_nodes_batch_not_a_positive_multiple(ps_ncf, ncf_item, local_spec, batch):
    _virtual_nodes(ps_ncf, batch, 4, [W0, W0, W1, W1])
    assert_invalid(ps_ncf, ncf_item, local_spec,
                   re.escape(f"positive multiple of num_virtual_nodes (4). Received: {batch}"),
                   field=f"{VN}.global_batch_size", received=batch)


@pytest.mark.parametrize("devices", [[W0, W1, W1], [W0, W1, W0, W1, W0]])
def test_virtual_nodes_device_list_wrong_length(ps_ncf, ncf_item, local_spec, devices):
    _virtual_nodes(ps_ncf, 64, 4, devices)
    assert_invalid(ps_ncf, ncf_item, local_spec,
                   f"map each of the 4 virtual nodes to a replica. Received {len(devices)}",
                   field=f"{VN}.device", received=devices)


def test_virtual_node_device_not_a_replica(ps_ncf, ncf_item, local_spec):
    _virtual_nodes(ps_ncf, 64, 4, [W0, PS0, W1, W1])
    assert_invalid(ps_ncf, ncf_item, local_spec,
                   re.escape(f"{VN}.device[1] is '{PS0}', which is not one of the replicas"),
                   field=f"{VN}.device", received=PS0)


def test_replica_without_virtual_node(ps_ncf, ncf_item, local_spec):
    _virtual_nodes(ps_ncf, 64, 2, [W0, W0])
    assert_invalid(ps_ncf, ncf_item, local_spec,
                   re.escape(f"replicas ['{W1}'] run no virtual node"),
                   field=f"{VN}.device", received=[W0, W0])


def test_virtual_node_fields_without_num_virtual_nodes(ps_ncf, ncf_item, local_spec):
    _virtual_nodes(ps_ncf, 64, 0, [])
    assert_invalid(ps_ncf, ncf_item, local_spec, "num_virtual_nodes is 0",
                   field=f"{VN}.num_virtual_nodes", received=0)


def test_negative_num_virtual_nodes(ps_ncf, ncf_item, local_spec):
    _virtual_nodes(ps_ncf, 64, -2, [])
    assert_invalid(ps_ncf, ncf_item, local_spec, "num_virtual_nodes must be >= 1. Received: -2",
                   field=f"{VN}.num_virtual_nodes", received=-2)


def test_with_virtual_nodes_maps_contiguously(ps_ncf, ncf_item, local_spec):
    assert ps_ncf.num_virtual_nodes == 2 and ps_ncf.virtual_node_devices == [W0, W1]
    assert ps_ncf.global_batch_size is None
    five = ps_ncf.with_virtual_nodes(40, 5)
    five.validate(ncf_item, local_spec)
    assert five.num_virtual_nodes == 5 and five.global_batch_size == 40
    assert five.virtual_node_devices == [W0, W0, W0, W1, W1]
    assert five.id == ps_ncf.id and not ps_ncf.proto.graph_config.HasField("virtual_nodes")
    uneven = ps_ncf.with_virtual_nodes(64, 4, [W0, W1, W1, W1])
    uneven.validate(ncf_item, local_spec)
    assert Strategy.deserialize(uneven.serialize()).virtual_node_devices == [W0, W1, W1, W1]


@pytest.mark.parametrize("batch,num,match", [
    (64, 0, "num_virtual_nodes must be an integer >= 1. Received: 0"),
    (30, 4, re.escape("positive multiple of num_virtual_nodes (4). Received: 30")),
    (64, 1, "1 virtual nodes cannot cover the 2 replicas"),
])
def test_with_virtual_nodes_rejects(ps_ncf, batch, num, match):
    with pytest.raises(StrategyError, match=match):
        ps_ncf.with_virtual_nodes(batch, num)


# ------------------------------------------- validation: version, fingerprints
def test_schema_version_newer_than_supported(ps_ncf, ncf_item, local_spec):
    newer = STRATEGY_SCHEMA_VERSION + 1
    ps_ncf.proto.schema_version = newer
    assert_invalid(ps_ncf, ncf_item, local_spec,
                   f"schema version {newer} is newer than this autodist understands",
                   field="schema_version", received=newer)


@pytest.mark.parametrize("field", ["graph_item_fingerprint", "resource_spec_fingerprint"])
def test_fingerprint_mismatch_only_when_checked(ps_ncf, ncf_item, local_spec, field):
    setattr(ps_ncf.proto, field, "deadbeef")
    ps_ncf.validate(ncf_item, local_spec)  # unchecked by default
    assert_invalid(ps_ncf, ncf_item, local_spec, f"strategy {field} is 'deadbeef'",
                   field=field, received="deadbeef", check_fingerprints=True)


def test_empty_fingerprints_pass_the_check(ps_ncf, ncf_item, local_spec):
    ps_ncf.proto.ClearField("graph_item_fingerprint")
    ps_ncf.proto.ClearField("resource_spec_fingerprint")
    ps_ncf.validate(ncf_item, local_spec, check_fingerprints=True)


def test_strategy_for_another_cluster_fails_fingerprint_check(ps_ncf, ncf_item):
    other = ResourceSpec.local(workers=2, ps=1, bandwidth_gbps=25)
    ps_ncf.validate(ncf_item, other)  # fits: same devices
    assert_invalid(ps_ncf, ncf_item, other, "made for another cluster",
                   field="resource_spec_fingerprint",
                   received=ps_ncf.proto.resource_spec_fingerprint, check_fingerprints=True)


# ------------------------------------------------------------------- summary
def test_summary_mentions_every_variable(ncf_item, hetero_spec):
    s = PartitionedPS().build(ncf_item, hetero_spec)
    s.proto.performance.predicted_step_time_s = 0.0125
    s.proto.performance.predictor = "simulator"
    text = s.summary()
    for name in ncf_item.variable_names:
        assert name in text
    assert s.id in text
    assert "origin: PartitionedPS" in text
    assert f"{ITEM}  axis 0 x3" in text
    assert "12.500 ms (simulator)" in text


def test_summary_of_full_strategy():
    text = Strategy(full_strategy_proto()).summary()
    assert "axis 0 x3 (3335,13341,3335)" in text
    assert "axis 1 x2 (20,12)" in text
    assert "virtual nodes: 4 x 16 examples (global batch 64)" in text
    assert "stale<=2, local copy" in text
    assert "AllReduce(RING, FP16_ERROR_FEEDBACK, group 3)" in text


def test_hyperparameter_overrides_are_validated(ps_ncf, ncf_item, local_spec):
    lr = ps_ncf.with_hyperparameters(learning_rate=0.5)
    assert lr.hyperparameters == {"learning_rate": 0.5} and ps_ncf.hyperparameters == {}
    lr.validate(ncf_item, local_spec)
    with pytest.raises(StrategyError, match="overrides 'momentum', which is not a tunable"):
        ps_ncf.with_hyperparameters(momentum=0.9).validate(ncf_item, local_spec)
    with pytest.raises(StrategyError, match="overrides 'nope'"):
        ps_ncf.with_hyperparameters(nope=1.0).validate(ncf_item, local_spec)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.1])
def test_hyperparameter_values_must_be_finite_and_in_range(ps_ncf, ncf_item, local_spec, value):
    with pytest.raises(StrategyError, match=r"graph_config.hyperparameters\['learning_rate'\] "
                                            rf"must be finite and >= 0. Received: {value!r}"):
        ps_ncf.with_hyperparameters(learning_rate=value)
    ps_ncf.proto.graph_config.hyperparameters["learning_rate"] = value   # as a file may hold it
    with pytest.raises(StrategyError, match="must be finite and >= 0") as info:
        ps_ncf.validate(ncf_item, local_spec)
    assert info.value.field == "graph_config.hyperparameters['learning_rate']"
    assert repr(info.value.received) == repr(value)      # nan != nan


def test_unknown_enum_numbers_are_named(ar_ncf, ncf_item, local_spec):
    """A file from a newer autodist (or a damaged one) may hold enum numbers without names."""
    ar = _config(ar_ncf, HIDDEN).shards[0].all_reduce
    ar.compressor = 7
    assert "UNKNOWN(7), group" in ar_ncf.summary()
    loaded = Strategy.deserialize(ar_ncf.serialize())
    assert_invalid(loaded, ncf_item, local_spec, "all_reduce.compressor is 7, which is not a "
                   "known value", variable=HIDDEN, field="shards[0].all_reduce.compressor",
                   received=7)
    ar.compressor, ar.spec = 0, -1
    assert "UNKNOWN(-1)" in Strategy.from_text(ar_ncf.to_text()).summary()
    assert_invalid(ar_ncf, ncf_item, local_spec, "all_reduce.spec is -1", variable=HIDDEN,
                   field="shards[0].all_reduce.spec", received=-1)


def test_absurd_staleness_and_virtual_nodes_are_refused(ps_ncf, ncf_item, local_spec):
    ps = _config(ps_ncf, HIDDEN).shards[0].ps
    ps.sync, ps.staleness = True, 2 ** 31 - 1
    assert_invalid(ps_ncf, ncf_item, local_spec, "staleness must be at most 100000 steps",
                   variable=HIDDEN, field="shards[0].ps.staleness", received=2 ** 31 - 1)
    ps.staleness = 0
    _virtual_nodes(ps_ncf, 2 ** 31 - 1, 65_537, [])
    assert_invalid(ps_ncf, ncf_item, local_spec, "num_virtual_nodes must be at most 65536",
                   field=f"{VN}.num_virtual_nodes", received=65_537)
    _virtual_nodes(ps_ncf, 2 ** 40, 2, [W0, W1])
    assert_invalid(ps_ncf, ncf_item, local_spec, "global_batch_size must be at most 2147483647",
                   field=f"{VN}.global_batch_size", received=2 ** 40)


def test_a_huge_value_in_a_file_gives_a_short_message(ps_ncf, ncf_item, local_spec):
    ps_ncf.proto.graph_config.replicas[0] = "x" * 1_000_000
    err = assert_invalid(ps_ncf, ncf_item, local_spec, "names device .xxxx",
                         field="graph_config.replicas", received="x" * 1_000_000)
    assert len(str(err)) < 1000


def test_damaged_files_are_named_errors(ps_ncf, tmp_path):
    path = tmp_path / "s.pb"
    path.write_bytes(ps_ncf.serialize()[:-3] + b"\xff\xff\xff")
    with pytest.raises(StrategyError, match="is not a Strategy protobuf"):
        Strategy.load(path)
    text = tmp_path / "s.pbtxt"
    text.write_bytes(b"graph_config { replicas: \xff }")
    with pytest.raises(StrategyError, match="strategy file .*s.pbtxt"):
        Strategy.load(text)
