"""The search space: options, constraints, sampling, encode/decode."""
from __future__ import annotations

import numpy as np
import pytest

from autodist.ir.resource_spec import ResourceSpec
from autodist.proto import strategy_pb2
from autodist.search import builders
from autodist.search.space import Consistency, SearchSpace, SpaceOptions
from tests.search import workloads

AR = strategy_pb2.AllReduceSynchronizer


@pytest.fixture(name="gi")
def _gi():
    return workloads.graph_item([("emb", (1000, 64), True), ("kernel", (512, 256), False),
                                 ("bias", (256,), False)])


def _kinds(config):
    return {s.WhichOneof("kind") for s in config.shards}


def test_options_follow_the_knowledge_constraints(gi):
    spec = ResourceSpec.local(workers=2, ps=3)
    space = SearchSpace(gi, spec, SpaceOptions(min_shard_bytes=16 * 1024, max_groups=2,
                                               compressors=("none", "fp16",
                                                            "fp16_error_feedback")))
    emb, kernel, bias = space.options
    # Sparse: PS (whole on each of 3 PS; 2 shards x 3 rotations; 3 shards x 1) or all-gather
    # (none, fp16; error feedback keeps a dense residual so it is not offered).
    assert len(emb) == 3 + 3 + 1 + 2
    for config in emb:
        if "all_reduce" in _kinds(config):
            assert config.shards[0].all_reduce.spec == AR.ALL_GATHER
            assert config.shards[0].all_reduce.compressor != AR.FP16_ERROR_FEEDBACK
        if config.partitioner.num_shards > 1:
            assert config.partitioner.axis == 0
            devices = [s.ps.reduction_destination for s in config.shards]
            assert len(set(devices)) == len(devices)
    # Dense: 3 compressors x 2 fusion slots of all-reduce, never all-gather.
    ar = [c for c in kernel if _kinds(c) == {"all_reduce"}]
    assert len(ar) == 6 and all(c.shards[0].all_reduce.spec == AR.AUTO for c in ar)
    # Split between the kinds (512 KiB kernel, up to 3 + 2 = 5 even shards): n shards,
    # j = 1..min(3, n - 1) on consecutive PS (3 rotations while j < 3), the rest
    # all-reduced in one slot; x 3 compressors x 2 slots.
    hybrid = [c for c in kernel if _kinds(c) == {"ps", "all_reduce"}]
    layouts = sum(3 if j < 3 else 1 for n in range(2, 6) for j in range(1, min(3, n - 1) + 1))
    assert len(hybrid) == layouts * 3 * 2
    for config in hybrid:
        kinds = [s.WhichOneof("kind") for s in config.shards]
        j = kinds.count("ps")
        assert config.partitioner.num_shards == len(kinds) and 1 <= j < len(kinds)
        assert kinds == ["ps"] * j + ["all_reduce"] * (len(kinds) - j)
        assert len({s.ps.reduction_destination for s in config.shards[:j]}) == j
        assert len({(s.all_reduce.group, s.all_reduce.compressor)
                    for s in config.shards[j:]}) == 1
    # Embeddings are never split between the kinds.
    assert not any(_kinds(c) == {"ps", "all_reduce"} for c in emb)
    # The bias (1 KiB) is below min_shard_bytes: never partitioned.
    assert all(c.partitioner.num_shards <= 1 for c in bias)
    # One replica per node: local replication cannot help and is not offered.
    assert not any(s.ps.local_replication for opts in space.options for c in opts
                   for s in c.shards if s.WhichOneof("kind") == "ps")


def test_ten_thousand_samples_never_violate_a_constraint(gi):
    spec = ResourceSpec.local(workers=3, ps=2)
    space = SearchSpace(gi, spec, SpaceOptions(min_shard_bytes=1024, max_shards=2,
                                               compressors=("none", "fp16"),
                                               consistency=("sync", "ssp:2", "async")))
    samples = space.sample(10_000, np.random.default_rng(0))
    assert samples.shape == (10_000, 4)
    assert (samples >= 0).all() and (samples < space.option_counts).all()
    for v, var in enumerate(space.variables):
        for index in np.unique(samples[:, v]):
            config = space.options[v][index]
            assert config.partitioner.num_shards <= 2
            for shard in config.shards:
                if var.sparse_gradient and shard.WhichOneof("kind") == "all_reduce":
                    assert shard.all_reduce.spec == AR.ALL_GATHER
    # Every distinct sampled candidate among the first 300 decodes to a valid strategy.
    for candidate in np.unique(samples[:300], axis=0):
        space.decode(candidate).validate(gi, spec)
    # Each variable's options are hit roughly uniformly.
    counts = np.bincount(samples[:, 1], minlength=space.option_counts[1])
    assert counts.min() > 0.7 * counts.mean()


def test_size_is_the_product_of_option_counts(gi):
    space = SearchSpace(gi, ResourceSpec.local(workers=2, ps=2))
    assert space.size == int(np.prod(space.option_counts))
    assert "size 10^" in space.describe()


def test_decode_sets_consistency_and_groups(gi):
    spec = ResourceSpec.local(workers=2, ps=1)
    space = SearchSpace(gi, spec, SpaceOptions(consistency=("sync", "ssp:3", "async")))
    ps_whole = 0  # the first option of every variable: whole on the only PS
    for index, (sync, staleness) in enumerate([(True, 0), (True, 3), (False, 0)]):
        s = space.decode([ps_whole, ps_whole, ps_whole, index])
        for config in s.variables:
            assert (config.shards[0].ps.sync, config.shards[0].ps.staleness) == (sync, staleness)
    # Kernel and bias in the same fusion slot share one group; the embedding gets its own.
    kernel_ar = next(i for i, c in enumerate(space.options[1]) if "all_reduce" in _kinds(c))
    bias_ar = next(i for i, c in enumerate(space.options[2]) if "all_reduce" in _kinds(c))
    emb_ag = next(i for i, c in enumerate(space.options[0]) if "all_reduce" in _kinds(c))
    s = space.decode([emb_ag, kernel_ar, bias_ar, 0])
    groups = [c.shards[0].all_reduce.group for c in s.variables]
    assert groups[1] == groups[2] != groups[0]


def test_densified_all_reduce_only_where_lookups_outweigh_the_table():
    # "tags": 100 rows, 20 lookups per example: 10 examples x 20 x 2 replicas = 400
    # rows per step >= 100: densifying can help. "emb": 1000 rows > 400.
    gi = workloads.graph_item([("tags", (100, 64), True), ("emb", (1000, 64), True),
                               ("kernel", (64, 32), False)], lookups_per_example=20)
    spec = ResourceSpec.local(workers=2, ps=1)
    space = SearchSpace(gi, spec, SpaceOptions(max_groups=2))
    tags, emb, kernel = space.options
    densified = [c for c in tags if _kinds(c) == {"all_reduce"}
                 and c.shards[0].all_reduce.spec == AR.RING]
    assert len(densified) == 2  # one per fusion slot
    assert all(c.partitioner.num_shards <= 1 for c in densified)
    assert not any(c.shards[0].all_reduce.spec == AR.RING for c in emb
                   if _kinds(c) == {"all_reduce"})
    # A densified table shares a fusion slot (one group) with dense gradients.
    kernel_ar = next(i for i, c in enumerate(kernel) if _kinds(c) == {"all_reduce"})
    emb_ag = next(i for i, c in enumerate(emb) if _kinds(c) == {"all_reduce"})
    s = space.decode([tags.index(densified[0]), emb_ag, kernel_ar, 0])
    groups = [c.shards[0].all_reduce.group for c in s.variables]
    assert groups[0] == groups[2] != groups[1]
    s.validate(gi, spec)


def test_encode_round_trips_builders(gi):
    spec = ResourceSpec.local(workers=2, ps=2)
    space = SearchSpace(gi, spec, SpaceOptions(min_shard_bytes=1024))
    for name, cls in builders.STRATEGY_BUILDERS.items():
        strategy = cls().build(gi, spec)
        candidate = space.encode(strategy)
        decoded = space.decode(candidate)
        for a, b in zip(strategy.variables, decoded.variables):
            assert a.partitioner == b.partitioner, name
            assert [s.WhichOneof("kind") for s in a.shards] == \
                [s.WhichOneof("kind") for s in b.shards], name
            for sa, sb in zip(a.shards, b.shards):
                if sa.WhichOneof("kind") == "ps":
                    assert sa.ps == sb.ps, name
                else:
                    assert (sa.all_reduce.spec, sa.all_reduce.compressor) == \
                        (sb.all_reduce.spec, sb.all_reduce.compressor), name
        assert (space.encode(strategy) == candidate).all()  # no new option the second time


def test_bad_options_are_clear_errors(gi):
    with pytest.raises(ValueError, match="unknown compressor 'zip'"):
        SpaceOptions(compressors=("zip",))
    with pytest.raises(ValueError, match="unknown consistency 'ssp:0'"):
        SpaceOptions(consistency=("ssp:0",))
    with pytest.raises(ValueError, match="cannot both be False"):
        SpaceOptions(allow_ps=False, allow_all_reduce=False)
    space = SearchSpace(gi, ResourceSpec.local(workers=2, ps=1))
    with pytest.raises(ValueError, match="4 entries"):
        space.decode([0, 0])
    assert str(Consistency.parse("ssp:2")) == "ssp:2"


def test_without_ps_devices_only_all_reduce(gi):
    spec = ResourceSpec.local(workers=2, ps=1)
    space = SearchSpace(gi, spec, SpaceOptions(allow_ps=False))
    assert all("ps" not in _kinds(c) for opts in space.options for c in opts)


def test_split_options_can_be_turned_off_and_decode_to_valid_strategies(gi):
    spec = ResourceSpec.local(workers=4, ps=2)
    off = SearchSpace(gi, spec, SpaceOptions(allow_hybrid=False))
    assert not any(_kinds(c) == {"ps", "all_reduce"} for opts in off.options for c in opts)
    assert not any(_kinds(c) == {"ps", "all_reduce"} for opts in
                   SearchSpace(gi, spec, SpaceOptions(max_shards=1)).options for c in opts)
    space = SearchSpace(gi, spec)
    kernel = space.options[1]
    for index, config in enumerate(kernel):
        if _kinds(config) == {"ps", "all_reduce"}:
            strategy = space.decode([0, index, 0, 0])
            strategy.validate(gi, spec)
            shards = strategy.proto.variables[1].shards
            # The all-reduced shards of the kernel share one fused group.
            assert len({s.all_reduce.group for s in shards
                        if s.WhichOneof("kind") == "all_reduce"}) == 1


def test_knowledge_prior_prefers_ps_for_sparse_and_all_reduce_for_dense(gi):
    space = SearchSpace(gi, ResourceSpec.local(workers=2, ps=2))
    samples = space.sample(4000, np.random.default_rng(1), prior="knowledge")
    emb_ps = np.mean([_kinds(space.options[0][i]) == {"ps"} for i in samples[:, 0]])
    kernel_ar = np.mean([_kinds(space.options[1][i]) == {"all_reduce"} for i in samples[:, 1]])
    assert 0.62 < emb_ps < 0.71 and 0.62 < kernel_ar < 0.71
    with pytest.raises(ValueError, match="unknown prior"):
        space.sample(1, np.random.default_rng(0), prior="flat")
