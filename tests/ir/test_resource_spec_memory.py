"""ResourceSpec memory: sizes in YAML, the local default, errors naming field and value."""
from __future__ import annotations

import pytest

from autodist.ir.errors import ResourceSpecError
from autodist.ir import resource_spec
from autodist.ir.resource_spec import ResourceSpec, parse_size


@pytest.mark.parametrize("text,expected", [
    (1024, 1024),
    ("1024", 1024),
    ("16GB", 16 * 10**9),
    ("16 GiB", 16 * 2**30),
    ("512Mi", 512 * 2**20),
    ("80gb", 80 * 10**9),
    ("1.5TB", 1.5e12),
    (".5G", 5 * 10**8),
    (0, 0),
])
def test_parse_size(text, expected):
    assert parse_size(text, "x") == expected


@pytest.mark.parametrize("value", ["16 gigs", "GB", "-1GB", -1, True, None, [16], "1e3GB"])
def test_parse_size_errors_name_the_field_and_value(value):
    with pytest.raises(ResourceSpecError,
                       match=r"nodes\[0\]\.gpu_memory must be a number of bytes or a size "
                             r"such as '16GB'.*Received: " + __import__("re").escape(repr(value))):
        parse_size(value, "nodes[0].gpu_memory")


def test_parse_size_error_message_is_bounded():
    with pytest.raises(ResourceSpecError) as info:
        parse_size("9" * 10_000, "cpu_memory")
    assert len(str(info.value)) < 400


def test_yaml_memory_per_device_kind(tmp_path):
    path = tmp_path / "cluster.yml"
    path.write_text("""
nodes:
  - address: 10.0.0.1
    gpus: 2
    chief: true
    gpu_memory: 16GB
    cpu_memory: 64GiB
  - address: 10.0.0.2
    gpus: [0, 1]
    gpu_memory: 17179869184
  - address: 10.0.0.3
    roles: [ps]
""")
    spec = ResourceSpec.from_yaml(path)
    assert spec.memory_bytes("/job:worker/task:0/device:GPU:1") == 16 * 10**9
    assert spec.memory_bytes("/job:worker/task:0/device:CPU:0") == 64 * 2**30
    assert spec.memory_bytes("/job:worker/task:1/device:GPU:0") == 2**34
    # Left out: unknown, i.e. 0.
    assert spec.memory_bytes("/job:worker/task:1/device:CPU:0") == 0
    assert spec.memory_bytes("/job:ps/task:0/device:CPU:0") == 0
    # Survives serialization (part of the spec, and of its fingerprint).
    assert ResourceSpec.deserialize(spec.serialize()) == spec
    with pytest.raises(KeyError):
        spec.memory_bytes("/job:worker/task:9/device:GPU:0")


def test_yaml_memory_errors(tmp_path):
    path = tmp_path / "cluster.yml"
    path.write_text("nodes:\n  - address: a\n    gpu_memory: 16 gigs\n")
    with pytest.raises(ResourceSpecError,
                       match=r"nodes\[0\]\.gpu_memory must be .*Received: '16 gigs'"):
        ResourceSpec.from_yaml(path)
    path.write_text("nodes:\n  - address: a\n    gpu_memory: 16GB\n")
    with pytest.raises(ResourceSpecError,
                       match=r"nodes\[0\] \(a\)\.gpu_memory is 16000000000 bytes but the node "
                             r"has no gpus"):
        ResourceSpec.from_yaml(path)


def test_local_detects_host_memory_split_between_tasks_and_driver():
    spec = ResourceSpec.local(workers=2, ps=1)
    # Three tasks and the driver share the host.
    share = resource_spec.host_memory_bytes() // 4
    assert share > 0 and [n.cpu_memory_bytes for n in spec.nodes] == [share] * 3
    assert spec.memory_bytes(spec.ps_devices[0]) == share


def test_local_memory_given_or_unknown():
    assert ResourceSpec.local(workers=1, cpu_memory="2GB").nodes[0].cpu_memory_bytes == 2 * 10**9
    assert ResourceSpec.local(workers=1, cpu_memory=0).nodes[0].cpu_memory_bytes == 0
    with pytest.raises(ResourceSpecError, match="ResourceSpec.local: cpu_memory must be .*"
                                                "Received: 'lots'"):
        ResourceSpec.local(workers=1, cpu_memory="lots")


def test_host_memory_is_positive_here():
    # sysconf answers on Linux; a cgroup limit can only lower it.
    assert resource_spec.host_memory_bytes() > 2**20
