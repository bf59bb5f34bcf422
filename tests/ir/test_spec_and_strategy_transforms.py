"""Transforms of Strategy and ResourceSpec: renumbering tasks, replacing devices,
subsets of members, asynchronous shards."""
from __future__ import annotations

import pytest

from autodist.ir.device_names import DeviceName, TaskName
from autodist.ir.errors import ResourceSpecError, StrategyError
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy, is_asynchronous
from autodist.proto import strategy_pb2


def _worker(task: int) -> str:
    return f"/job:worker/task:{task}/device:CPU:0"


def _strategy(workers: int = 3, *, destinations=("/job:ps/task:0/device:CPU:0",),
              sync: bool = True, staleness: int = 0) -> Strategy:
    proto = strategy_pb2.Strategy()
    proto.graph_config.replicas.extend(_worker(t) for t in range(workers))
    for i, destination in enumerate(destinations):
        config = proto.variables.add(var_name=f"v{i}")
        config.shards.add().ps.CopyFrom(strategy_pb2.PSSynchronizer(
            reduction_destination=destination, sync=sync, staleness=staleness))
    config = proto.variables.add(var_name="dense")
    config.shards.add().all_reduce.group = 0
    return Strategy(proto)


def test_is_asynchronous_per_shard_and_per_strategy():
    assert not _strategy().is_asynchronous and _strategy().asynchronous_shards() == []
    for s in (_strategy(sync=False), _strategy(staleness=2)):
        assert s.is_asynchronous
        assert s.asynchronous_shards() == [("v0", 0)]
    all_reduce = strategy_pb2.Synchronizer()
    all_reduce.all_reduce.group = 1
    assert not is_asynchronous(all_reduce)


def test_devices_lists_each_once_in_order():
    s = _strategy(2, destinations=(_worker(1), "/job:ps/task:0/device:CPU:0")) \
        .with_virtual_nodes(8, 4)
    assert [str(d) for d in s.devices()] == [_worker(0), _worker(1),
                                             "/job:ps/task:0/device:CPU:0"]


def test_with_devices_renames_replicas_virtual_nodes_and_ps_destinations():
    s = _strategy(2, destinations=(_worker(1),)).with_virtual_nodes(8, 4)
    gpu = s.with_devices(lambda d: DeviceName(d.task, "GPU", 0))
    assert gpu.replicas == ["/job:worker/task:0/device:GPU:0", "/job:worker/task:1/device:GPU:0"]
    assert gpu.virtual_node_devices[-1] == "/job:worker/task:1/device:GPU:0"
    assert gpu.variable("v0").shards[0].ps.reduction_destination == \
        "/job:worker/task:1/device:GPU:0"
    assert gpu.id == s.id and s.replicas == [_worker(0), _worker(1)]  # s unchanged


def test_with_devices_names_the_field_of_a_bad_device():
    s = _strategy(destinations=("/job:ps/device:CPU:0",))
    with pytest.raises(StrategyError, match=r"variables\['v0'\]\.shards\[0\]\.ps\."
                                            r"reduction_destination: a device name") as info:
        s.with_devices(lambda d: d)
    assert info.value.received == "/job:ps/device:CPU:0"


def test_with_worker_tasks_renumbered_moves_workers_only():
    s = _strategy(2, destinations=(_worker(1), "/job:ps/task:1/device:CPU:0"))
    out = s.with_worker_tasks_renumbered({0: 0, 1: 3})
    assert out.replicas == [_worker(0), _worker(3)]
    assert [c.shards[0].ps.reduction_destination for c in out.variables[:2]] == \
        [_worker(3), "/job:ps/task:1/device:CPU:0"]


def test_with_worker_tasks_renumbered_refuses_a_task_left_out():
    with pytest.raises(StrategyError, match=r"task:2/device:CPU:0 is on worker task 2, "
                                            r"which the renumbering \{0: 0, 1: 1\} does not name"):
        _strategy(3).with_worker_tasks_renumbered({0: 0, 1: 1})


def test_with_replicas_subsets_and_spreads_virtual_nodes():
    s = _strategy(3).with_virtual_nodes(12, 6)
    out = s.with_replicas([_worker(0), _worker(2)])
    assert out.replicas == [_worker(0), _worker(2)]
    assert (out.global_batch_size, out.num_virtual_nodes) == (12, 6)
    assert out.virtual_node_devices == [_worker(0)] * 3 + [_worker(2)] * 3
    other = s.with_replicas([_worker(0)], global_batch_size=8, num_virtual_nodes=2)
    assert (other.global_batch_size, other.virtual_node_devices) == (8, [_worker(0)] * 2)
    plain = _strategy(3).with_replicas([_worker(1)])
    assert plain.replicas == [_worker(1)] and plain.global_batch_size is None


@pytest.mark.parametrize("replicas", [[], [_worker(0), _worker(0)], ["gpu0"]])
def test_with_replicas_refuses_bad_lists(replicas):
    with pytest.raises(StrategyError, match="with_replicas|graph_config.replicas"):
        _strategy(2).with_replicas(replicas)


def test_distributes_like_ignores_ids_and_predictions():
    a = _strategy()
    b = Strategy.from_text(a.to_text())
    b.proto.id = "other"
    b.proto.performance.predicted_step_time_s = 1.0
    assert a.distributes_like(b)
    assert not a.distributes_like(_strategy(sync=False))


def test_resource_spec_with_worker_tasks_keeps_ps_nodes_and_order():
    spec = ResourceSpec.local(workers=4, ps=1, cpu_memory=0)
    sub = spec.with_worker_tasks((0, 2, 3))
    assert sub.num_worker_tasks == 3 and len(sub.ps_devices) == 1
    assert [n.address for n in sub.nodes] == [n.address for n in spec.nodes][:1] * 4
    assert spec.with_worker_tasks(range(4)) == spec


def test_resource_spec_with_worker_tasks_refuses_unknown_tasks_and_losing_the_chief():
    spec = ResourceSpec.local(workers=2, cpu_memory=0)
    with pytest.raises(ResourceSpecError, match=r"worker tasks 0\.\.1\. Received: \[0, 5\]"):
        spec.with_worker_tasks([0, 5])
    with pytest.raises(ResourceSpecError, match="exactly one node must be the chief"):
        spec.with_worker_tasks([1])


def test_resource_spec_with_bandwidth_scaled():
    spec = ResourceSpec.local(workers=2, bandwidth_gbps=10, cpu_memory=0)
    assert spec.with_bandwidth_scaled(0.5).bandwidth_gbps(0) == 5.0
    unknown = ResourceSpec.local(workers=1, cpu_memory=0)
    assert unknown.with_bandwidth_scaled(3).nodes[0].network_bandwidth_gbps == 0
    with pytest.raises(ResourceSpecError, match="network_bandwidth must be finite"):
        spec.with_bandwidth_scaled(float("inf"))


def test_task_name_prefix_matches_the_spec_devices():
    spec = ResourceSpec.local(workers=2, cpu_memory=0)
    assert [DeviceName.parse(d).task for d in spec.replica_devices] == \
        [TaskName("worker", 0), TaskName("worker", 1)]


def test_transforms_set_no_field_they_do_not_change():
    s = _strategy(2)
    out = s.with_worker_tasks_renumbered({0: 0, 1: 1}).with_devices(lambda d: d)
    assert out.proto == s.proto and not out.proto.graph_config.HasField("virtual_nodes")


def test_with_performance_replaces_measured_times_and_keeps_the_rest():
    strategy = _strategy()
    assert strategy.measured_step_times_s == () and strategy.predicted_step_time_s is None
    timed = strategy.with_performance(measured_step_times_s=[0.2, 0.1],
                                      predicted_step_time_s=0.05, predictor="simulator")
    assert timed.measured_step_times_s == (0.2, 0.1) and timed.predicted_step_time_s == 0.05
    again = timed.with_performance(measured_step_times_s=[0.3])
    assert again.measured_step_times_s == (0.3,) and again.predicted_step_time_s == 0.05
    assert strategy.measured_step_times_s == ()   # a copy: the original is unchanged


def test_a_graph_items_estimate_batch_is_at_least_one():
    from autodist.ir.graph_item import GraphItem
    from autodist.proto import graph_item_pb2

    assert GraphItem(graph_item_pb2.GraphItem(estimate_batch_size=0)).estimate_batch_size == 1
    assert GraphItem(graph_item_pb2.GraphItem(estimate_batch_size=8)).estimate_batch_size == 8
