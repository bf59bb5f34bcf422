"""ResourceSpec: constructors, devices, roles, and errors naming field and value."""
from __future__ import annotations

import json
import time

import pytest

from autodist.ir.errors import ResourceSpecError
from autodist.ir.resource_spec import DEFAULT_BANDWIDTH_GBPS, ResourceSpec, TaskDevices


def test_local_workers_and_ps():
    spec = ResourceSpec.local(workers=2, ps=1, bandwidth_gbps=1.0)
    assert spec.replica_devices == ["/job:worker/task:0/device:CPU:0",
                                    "/job:worker/task:1/device:CPU:0"]
    assert spec.ps_devices == ["/job:ps/task:0/device:CPU:0"]
    assert spec.chief_index == 0
    assert spec.bandwidth_gbps("/job:ps/task:0/device:CPU:0") == 1.0
    assert spec.cluster_def(ports=[5000, 5001, 5002]) == {
        "worker": ["localhost:5000", "localhost:5001"], "ps": ["localhost:5002"]}


def test_local_without_ps_puts_variables_on_workers():
    spec = ResourceSpec.local(workers=3)
    assert spec.ps_devices == spec.replica_devices
    assert spec.bandwidth_gbps(0) == DEFAULT_BANDWIDTH_GBPS


@pytest.mark.parametrize("kwargs,match", [
    ({"workers": 0}, "workers must be an integer >= 1. Received: 0"),
    ({"workers": 1, "ps": -1}, "ps must be an integer >= 0. Received: -1"),
])
def test_local_errors(kwargs, match):
    with pytest.raises(ResourceSpecError, match=match):
        ResourceSpec.local(**kwargs)


def test_from_yaml(tmp_path):
    path = tmp_path / "cluster.yml"
    path.write_text("""
nodes:
  - address: 10.0.0.2
    gpus: [0, 1]
    network_bandwidth: 25
  - address: 10.0.0.1:2222
    gpus: [0, 1]
    chief: true
    network_bandwidth: 100
  - address: 10.0.0.3
    roles: [ps]
""")
    spec = ResourceSpec.from_yaml(path)
    # The chief is worker task 0 whatever its place in the file.
    assert spec.task_of(1) == ("worker", 0) and spec.task_of(0) == ("worker", 1)
    assert spec.task_of(2) == ("ps", 0)
    assert spec.nodes[1].port == 2222 and spec.nodes[1].address == "10.0.0.1"
    assert spec.replica_devices == [
        "/job:worker/task:1/device:GPU:0", "/job:worker/task:1/device:GPU:1",
        "/job:worker/task:0/device:GPU:0", "/job:worker/task:0/device:GPU:1"]
    assert spec.ps_devices == ["/job:worker/task:1/device:CPU:0",
                               "/job:worker/task:0/device:CPU:0",
                               "/job:ps/task:0/device:CPU:0"]
    assert spec.bandwidth_gbps("/job:worker/task:0/device:GPU:1") == 100
    assert ResourceSpec.from_text(spec.to_text()) == spec
    assert ResourceSpec.deserialize(spec.serialize()).fingerprint == spec.fingerprint


@pytest.mark.parametrize("text,match", [
    ("nodes: []", "'nodes' must be a non-empty list. Received: \\[\\]"),
    ("hosts: [a]", "expected a mapping with a 'nodes' list"),
    ("nodes:\n  - address: a\n    chief: true\n  - address: b\n    chief: true",
     "exactly one node must be the chief. Received: chief on nodes \\[0, 1\\]"),
    ("nodes:\n  - address: a\n    gpus: [0, 0]", "gpus must be distinct indices >= 0. "
                                               "Received: \\[0, 0\\]"),
    ("nodes:\n  - address: a\n    network_bandwidth: -3",
     "network_bandwidth must be a positive number of Gbit/s \\(finite\\). Received: -3"),
    ("nodes:\n  - address: a\n    roles: [trainer]", "unknown role 'trainer'"),
    ("nodes:\n  - address: a\n    cpu: [0]", "unknown fields \\['cpu'\\]"),
    ("nodes:\n  - address: a:notaport", "malformed port. Received: 'a:notaport'"),
    ("nodes:\n  - address: a:99999", "port must be in 0..65535. Received: 99999"),
    ("nodes:\n  - address: a:1\n  - address: a:1", "repeats a:1 of nodes\\[0\\]"),
    ("nodes:\n  - address: ''", "address must be a non-empty string. Received: ''"),
    ("nodes:\n  - address: a\n    roles: [ps]\n    chief: true\n  - address: b",
     "the chief \\(node 0, a\\) must have the 'worker' role"),
    ("nodes:\n  - address: a\n    roles: [ps]", "no node has the 'worker' role"),
    ("nodes:\n  - address: a\n    gpus: [-1]", "gpus must be distinct indices >= 0"),
    ("nodes: [", "not valid YAML"),
])
def test_yaml_errors_name_field_and_value(tmp_path, text, match):
    path = tmp_path / "bad.yml"
    path.write_text(text)
    with pytest.raises(ResourceSpecError, match=match):
        ResourceSpec.from_yaml(path)


def test_missing_yaml_file(tmp_path):
    with pytest.raises(ResourceSpecError, match="cannot read resource spec"):
        ResourceSpec.from_yaml(tmp_path / "absent.yml")


def test_from_tf_config(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", "")  # no nvidia-smi: no GPU
    config = {"cluster": {"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "ps": ["p:1"]},
              "task": {"type": "worker", "index": 0}}
    spec = ResourceSpec.from_tf_config(json.dumps(config), gpus_per_worker=2)
    assert spec.cluster_def() == {"worker": ["c:1", "w0:1", "w1:1"], "ps": ["p:1"]}
    assert len(spec.replica_devices) == 6
    assert spec.ps_devices == ["/job:ps/task:0/device:CPU:0"]
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["a:1", "b:2"]}}))
    spec = ResourceSpec.from_tf_config()
    assert spec.chief_index == 0 and len(spec.ps_devices) == 2


@pytest.mark.parametrize("config,match", [
    ("{not json", "TF_CONFIG is not valid JSON"),
    ({"task": {}}, "must have a non-empty 'cluster' mapping"),
    ({"cluster": {"trainer": ["a:1"]}}, "unknown jobs \\['trainer'\\]"),
    ({"cluster": {"worker": "a:1"}}, "cluster.worker must be a list"),
])
def test_tf_config_errors(config, match):
    with pytest.raises(ResourceSpecError, match=match):
        ResourceSpec.from_tf_config(config)


def test_tf_config_unset(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ResourceSpecError, match="TF_CONFIG is not set"):
        ResourceSpec.from_tf_config()


def test_cluster_def_needs_ports():
    with pytest.raises(ResourceSpecError, match="has no port"):
        ResourceSpec.local(workers=1).cluster_def()


# ------------------------------------------------------ replicas per task
def test_cpu_replicas_per_worker():
    spec = ResourceSpec.local(workers=2, ps=1, cpu_replicas_per_worker=2)
    assert spec.replica_devices == [
        "/job:worker/task:0/device:CPU:0", "/job:worker/task:0/device:CPU:1",
        "/job:worker/task:1/device:CPU:0", "/job:worker/task:1/device:CPU:1"]
    # Parameter-server variables stay on the first CPU.
    assert spec.ps_devices == ["/job:ps/task:0/device:CPU:0"]
    assert spec.task_devices(0) == TaskDevices(cpus=2, gpus=())
    assert spec.task_devices(2) == TaskDevices(cpus=1, gpus=())
    assert spec.node_of_task("worker", 1) == 1 and spec.node_of_task("ps", 0) == 2


def test_gpus_per_worker_gives_each_task_its_own_gpus():
    spec = ResourceSpec.local(workers=2, gpus_per_worker=2)
    assert [list(n.gpus) for n in spec.nodes] == [[0, 1], [2, 3]]
    # A task sees its GPUs as 0..n-1 (its CUDA_VISIBLE_DEVICES holds only them).
    assert spec.replica_devices == [
        "/job:worker/task:0/device:GPU:0", "/job:worker/task:0/device:GPU:1",
        "/job:worker/task:1/device:GPU:0", "/job:worker/task:1/device:GPU:1"]
    assert spec.task_devices(1) == TaskDevices(cpus=1, gpus=(2, 3))
    assert spec.ps_devices == ["/job:worker/task:0/device:CPU:0",
                               "/job:worker/task:1/device:CPU:0"]


def test_yaml_cpu_count_is_replicas(tmp_path):
    path = tmp_path / "cluster.yml"
    path.write_text("nodes:\n  - address: a:1\n    cpus: 3\n  - address: b:1\n    gpus: [4, 6]\n"
                    "    cpus: [0, 1]\n")
    spec = ResourceSpec.from_yaml(path)
    assert spec.replica_devices == [
        "/job:worker/task:0/device:CPU:0", "/job:worker/task:0/device:CPU:1",
        "/job:worker/task:0/device:CPU:2",
        # A node with GPUs runs its replicas there, whatever its CPUs.
        "/job:worker/task:1/device:GPU:0", "/job:worker/task:1/device:GPU:1"]
    assert spec.task_devices(1) == TaskDevices(cpus=2, gpus=(4, 6))


@pytest.mark.parametrize("kwargs,match", [
    ({"cpu_replicas_per_worker": 0}, "cpu_replicas_per_worker must be an integer >= 1. "
                                     "Received: 0"),
    ({"cpu_replicas_per_worker": 2.0}, "cpu_replicas_per_worker must be an integer >= 1. "
                                       "Received: 2.0"),
    ({"gpus_per_worker": -1}, "gpus_per_worker must be an integer >= 0. Received: -1"),
    ({"gpus_per_worker": True}, "gpus_per_worker must be an integer >= 0. Received: True"),
    ({"gpus_per_worker": 2, "cpu_replicas_per_worker": 2},
     "on its GPUs or on its CPU devices, not both. Received: gpus_per_worker=2, "
     "cpu_replicas_per_worker=2"),
])
def test_local_device_errors(kwargs, match):
    with pytest.raises(ResourceSpecError, match=match):
        ResourceSpec.local(workers=2, **kwargs)


def test_node_of_task_names_the_tasks():
    with pytest.raises(ResourceSpecError, match=r"no node is task ps:0; tasks: "
                                                r"\['worker:0', 'worker:1'\]"):
        ResourceSpec.local(workers=2).node_of_task("ps", 0)


_CLUSTER = {"cluster": {"worker": ["a:1", "b:1"], "ps": ["p:1"]},
            "task": {"type": "worker", "index": 0}}


def test_tf_config_counts_visible_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    spec = ResourceSpec.from_tf_config(_CLUSTER)
    assert [list(n.gpus) for n in spec.nodes] == [[0, 1], [0, 1], []]
    assert len(spec.replica_devices) == 4
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert ResourceSpec.from_tf_config(_CLUSTER).replica_devices == [
        "/job:worker/task:0/device:CPU:0", "/job:worker/task:1/device:CPU:0"]


def test_tf_config_cpu_replicas(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # ignored: GPUs given
    spec = ResourceSpec.from_tf_config(_CLUSTER, gpus_per_worker=0, cpu_replicas_per_worker=2)
    assert len(spec.replica_devices) == 4
    assert spec.task_devices(2) == TaskDevices(cpus=1, gpus=())  # the PS
    with pytest.raises(ResourceSpecError, match="cpu_replicas_per_worker must be an integer "
                                                ">= 1. Received: 0"):
        ResourceSpec.from_tf_config(_CLUSTER, gpus_per_worker=0, cpu_replicas_per_worker=0)
    with pytest.raises(ResourceSpecError, match="gpus_per_worker must be an integer >= 0. "
                                                "Received: -2"):
        ResourceSpec.from_tf_config(_CLUSTER, gpus_per_worker=-2)


def test_cluster_def_when_the_chief_is_not_the_first_worker():
    spec = ResourceSpec.from_dict({"nodes": [
        {"address": "w1:1", "roles": ["worker"]}, {"address": "p:1", "roles": ["ps"]},
        {"address": "c:1", "chief": True, "roles": ["worker"]}]})
    assert spec.cluster_def() == {"worker": ["c:1", "w1:1"], "ps": ["p:1"]}


def test_yaml_alias_bomb_is_refused_quickly_with_a_short_message(tmp_path):
    lines = ["a0: &a0 [0, 0, 0, 0, 0, 0, 0, 0, 0]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines + ["nodes: [{address: h, gpus: *a8}]"]) + "\n")
    assert path.stat().st_size < 600        # 9^9 = 387 million numbers when expanded
    start = time.monotonic()
    with pytest.raises(ResourceSpecError, match="expands to more than 200000 YAML nodes") as e:
        ResourceSpec.from_yaml(path)
    assert time.monotonic() - start < 2 and len(str(e.value)) < 300


@pytest.mark.parametrize("text, match", [
    ("nodes:\n  - address: a\n    gpus: 1000000000",
     r"gpus as a count must be in \[0, 4096\]. Received: 1000000000"),
    ("nodes:\n  - address: a\n    network_bandwidth: .nan",
     r"network_bandwidth must be a positive number of Gbit/s \(finite\). Received: nan"),
    ("nodes:\n  - address: a\n    network_bandwidth: .inf", r"\(finite\). Received: inf"),
    ("nodes:\n  - address: a\n    gpus: [2147483648]", "has an index of 2\\^31 or more"),
    ("nodes: " + "[" * 5000 + "]" * 5000, "nested|not valid YAML"),
    ("a: &a [*a]\nnodes: *a", "refers to itself|not valid YAML"),
    ("nodes:\n  - address: " + "h" * 5000, "address is longer than 1024 characters"),
])
def test_absurd_yaml_values_are_named_errors(tmp_path, text, match):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(ResourceSpecError, match=match) as e:
        ResourceSpec.from_yaml(path)
    assert len(str(e.value)) < 700


def test_huge_values_are_echoed_in_short(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text("nodes:\n  - address: a\n    gpus: [" + ", ".join(["x"] * 100_000) + "]\n")
    with pytest.raises(ResourceSpecError, match=r"gpus must be a list of device indices. "
                                                r"Received: \['x', 'x', 'x', 'x', 'x', 'x', "
                                                r"\.\.\.\]$"):
        ResourceSpec.from_yaml(path)


def test_deserialize_and_tf_config_damage_are_named_errors():
    with pytest.raises(ResourceSpecError, match="not a ResourceSpec protobuf"):
        ResourceSpec.deserialize(b"\xff\xff\xff")
    with pytest.raises(ResourceSpecError, match="TF_CONFIG is not valid JSON: nested too deeply"):
        ResourceSpec.from_tf_config("[" * 100_000)
    with pytest.raises(ResourceSpecError, match="address must be a non-empty string. "
                                                r"Received: '\\udc80:1'"):   # a lone surrogate
        ResourceSpec.from_tf_config('{"cluster": {"worker": ["\\udc80:1"]}}')


@pytest.mark.parametrize("address, port, want", [
    ("[::1]:2222", None, ("[::1]", 2222)), ("::1", 2223, ("[::1]", 2223)),
    ("[fe80::1]", 7, ("[fe80::1]", 7)), ("host:12", None, ("host", 12)),
    ("10.0.0.1", 9, ("10.0.0.1", 9))])
def test_ipv6_addresses_keep_their_brackets_and_ports(address, port, want):
    node = {"address": address} | ({} if port is None else {"port": port})
    spec = ResourceSpec.from_dict({"nodes": [node]})
    assert (spec.nodes[0].address, spec.nodes[0].port) == want
    assert spec.cluster_def()["worker"] == [f"{want[0]}:{want[1]}"]


@pytest.mark.parametrize("address, match", [
    ("[::1", "malformed IPv6 address"), ("[]:1", "malformed IPv6 address"),
    ("[::1]x", "malformed IPv6 address"), ("host:", "malformed port"), (":80", "malformed port")])
def test_malformed_addresses_are_named(address, match):
    with pytest.raises(ResourceSpecError, match=match):
        ResourceSpec.from_dict({"nodes": [{"address": address}]})


def test_a_spec_of_too_many_devices_in_all_is_refused_before_it_is_built():
    """Each node within its bound, the whole far beyond: refused while reading."""
    nodes = [{"address": f"h{i}", "port": 1, "cpus": list(range(4000))} for i in range(20)]
    with pytest.raises(ResourceSpecError, match="more than 65536 devices in all"):
        ResourceSpec.from_dict({"nodes": nodes})
