"""The simulator against the published α-β formulas, on clusters up to 256 replicas.

Where the simulator's assumptions are those of the formulas (equal full-duplex
links of B bytes/s, one dense variable of S bytes, the busiest link sets the
time), its communication parts equal them to floating-point precision
(relative tolerance 1e-9):

* ring all-reduce over W replicas (Patarasuk and Yuan, 2009; Thakur et al.,
  2005): every node's link carries 2(W-1)/W · S each way, in 2(W-1) steps of
  latency α: T = 2(W-1)/W · S/B + 2(W-1)·α. With several replicas per node
  the ring enters and leaves each node once, so the node link carries the
  same bytes;
* parameter servers, n workers and k servers, the variable split evenly
  (Li et al., OSDI 2014; the Parallax and BytePS analyses): a worker pushes S
  and pulls S, a server receives and sends n·S/k, so with pushes and pulls
  overlapped on full-duplex links T = max(S/B, n·S/(k·B)). The simulator's
  default `ps_overlap=0.5` sits between that and reads strictly before
  pushes (`ps_overlap=0`), which doubles it.
"""
from __future__ import annotations

import numpy as np
import pytest

from autodist.ir.resource_spec import ResourceSpec
from autodist.search import builders
from autodist.search.simulator import Calibration, Simulator
from autodist.search.space import SearchSpace
from tests.search import workloads

GBPS = 10.0
B = GBPS * 1e9 / 8          # bytes per second per link
ALPHA = 2e-5
S = 64 * 2**20              # a 64 MiB dense variable (4096 x 4096 float32)
REL = 1e-9


def _cal(ps_overlap: float = 1.0) -> Calibration:
    return Calibration(latency_s=ALPHA, ps_overlap=ps_overlap)


def _spec(workers: int, gpus: int = 0, ps: int = 0) -> ResourceSpec:
    nodes = [{"address": f"10.{i // 256}.{i % 256}.1", "gpus": gpus, "network_bandwidth": GBPS,
              "roles": ["worker"] if ps else ["worker", "ps"]} for i in range(workers)]
    nodes += [{"address": f"10.9.{i}.1", "roles": ["ps"], "network_bandwidth": GBPS}
              for i in range(ps)]
    return ResourceSpec.from_dict({"nodes": nodes})


def _predict(spec: ResourceSpec, strategy_for, ps_overlap: float = 1.0):
    gi = workloads.graph_item([("w", (4096, 4096), False)])
    space = SearchSpace(gi, spec)
    sim = Simulator(space, _cal(ps_overlap))
    return sim.predict_strategy(strategy_for(gi, spec))


@pytest.mark.parametrize("nodes,gpus", [(2, 0), (4, 0), (16, 0), (64, 0), (256, 0),
                                        (2, 8), (8, 8), (32, 8)])
def test_ring_all_reduce_is_2_w_minus_1_over_w_s_over_b(nodes, gpus):
    spec = _spec(nodes, gpus)
    w = nodes * max(1, gpus)
    p = _predict(spec, lambda gi, s: builders.AllReduce().build(gi, s))
    assert p.parts["bandwidth_s"][0] == pytest.approx(2 * (w - 1) / w * S / B, rel=REL)
    assert p.parts["latency_s"][0] == pytest.approx(2 * (w - 1) * ALPHA, rel=REL)
    assert p.parts["max_node_bytes"][0] == pytest.approx(2 * (w - 1) / w * S, rel=REL)


def test_ring_all_reduce_with_fp16_moves_half():
    spec = _spec(16)
    p = _predict(spec, lambda gi, s: builders.AllReduce(compressor="fp16").build(gi, s))
    assert p.parts["bandwidth_s"][0] == pytest.approx(2 * 15 / 16 * S / 2 / B, rel=REL)


def _partitioned_ps(k: int):
    # One even shard per server (shards of S/k bytes, none too small to split).
    return lambda gi, spec: builders.PartitionedPS(min_shard_bytes=1, max_shards=k).build(gi,
                                                                                         spec)


@pytest.mark.parametrize("n,k", [(2, 1), (4, 2), (16, 1), (16, 4), (16, 16), (16, 32),
                                 (64, 8), (256, 16), (256, 64)])
def test_ps_is_max_of_s_over_b_and_n_s_over_k_b(n, k):
    spec = _spec(n, ps=k)
    p = _predict(spec, _partitioned_ps(k))
    expected = max(S / B, n * S / (k * B))
    assert p.parts["bandwidth_s"][0] == pytest.approx(expected, rel=REL)
    assert p.parts["ps_imbalance"][0] == pytest.approx(1.0)          # even shards


@pytest.mark.parametrize("n,k", [(16, 4), (64, 64)])
def test_ps_with_reads_before_pushes_takes_twice_as_long(n, k):
    spec = _spec(n, ps=k)
    formula = max(S / B, n * S / (k * B))
    phased = _predict(spec, _partitioned_ps(k), ps_overlap=0.0)
    default = _predict(spec, _partitioned_ps(k), ps_overlap=0.5)
    assert phased.parts["bandwidth_s"][0] == pytest.approx(2 * formula, rel=REL)
    assert default.parts["bandwidth_s"][0] == pytest.approx(1.5 * formula, rel=REL)


def test_ps_message_latency_at_the_busiest_server():
    # Each of the n replicas pushes and pulls each of its server's shards: 2n messages.
    n, k = 64, 8
    p = _predict(_spec(n, ps=k), _partitioned_ps(k))
    assert p.parts["latency_s"][0] == pytest.approx(2 * n * ALPHA, rel=REL)
    assert p.parts["sync_s"][0] == pytest.approx(2 * ALPHA)           # the chief's tokens


def test_the_crossover_between_ps_and_all_reduce():
    # Ring: 2(W-1)/W S/B per link; PS with k = n servers: S/B. With as many servers
    # as workers PS moves about half the bytes per link; with one server, n/2 times more.
    n = 32
    ring = _predict(_spec(n, ps=n), lambda gi, s: builders.AllReduce().build(gi, s))
    many = _predict(_spec(n, ps=n), _partitioned_ps(n))
    one = _predict(_spec(n, ps=1), _partitioned_ps(1))
    ratios = np.array([many.parts["bandwidth_s"][0], one.parts["bandwidth_s"][0]]) / \
        ring.parts["bandwidth_s"][0]
    np.testing.assert_allclose(ratios, [n / (2 * (n - 1)), n * n / (2 * (n - 1))], rtol=REL)
