"""The cluster probe: devices, memory, latency and bandwidth of served tasks, on loopback.

Three tasks: worker:0 and worker:1 are plain TensorFlow servers started as a
task process starts its own (`autodist.launch.server.start_server`, worker:1
with two logical CPU devices), worker:2 is `autodist serve --tf-config`
waiting for a job. With root in the private namespace, worker:1's port is
capped by `tc` htb (`bench.capped_links.shape_lo`), and the probe must find
the cap on its links and on nothing else.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from autodist.ir.resource_spec import ResourceSpec, host_memory_bytes
from autodist.launch import cluster_probe
from autodist.launch.cluster_probe import (ClusterProbe, LinkMeasurement, ProbedDevice,
                                           ProbedTask, ProbeError, host_memory_from_files,
                                           measured_spec)

CAP_MBIT = 200.0
PAYLOAD = 2 << 20
# The measured bandwidth of a capped link, as a fraction of the cap. Above 1: htb lets a
# burst (about rate/HZ + an MTU, some tens of KB at this rate) through at line rate, a few
# percent of the 2 MiB payload. Below: HTTP/2 and TCP framing count against the cap, and on
# two shared cores the latency taken off the payload's time is noisy.
CAPPED_RANGE = (0.7, 1.15)

_SERVER = """
import sys
from autodist.ir.resource_spec import ResourceSpec
from autodist.launch.server import start_server
spec = ResourceSpec.from_text(sys.argv[2])
node = int(sys.argv[1])
server = start_server(spec.cluster_def(), *spec.task_of(node), spec.task_devices(node))
print("serving", flush=True)
sys.stdin.read()  # until the test closes stdin
"""


# ------------------------------------------------------------ without a cluster
def test_host_memory_is_memtotal_or_a_lower_cgroup_limit():
    meminfo = b"MemTotal:       16384 kB\nMemFree:        1024 kB\n"
    assert host_memory_from_files(meminfo, [None, None]) == 16384 * 1024
    assert host_memory_from_files(meminfo, [b"max\n", None]) == 16384 * 1024
    assert host_memory_from_files(meminfo, [b"4096\n", None]) == 4096
    assert host_memory_from_files(meminfo, [None, b"999999999999\n"]) == 16384 * 1024
    assert host_memory_from_files(None, [b"garbage", None]) == 0


def _probed(task: str, cpus: int = 1, gpus: int = 0, memory: int = 8 << 30) -> ProbedTask:
    devices = [ProbedDevice(f"/job:worker/replica:0/task:0/device:CPU:{c}", "CPU", 0)
               for c in range(cpus)]
    devices += [ProbedDevice(f"/job:worker/replica:0/task:0/device:GPU:{g}", "GPU",
                             (16 - g) << 30) for g in range(gpus)]
    return ProbedTask(task, "h:1", task, tuple(devices), memory, "test")


def test_the_measured_spec_takes_devices_memory_and_the_fastest_link_of_each_node():
    spec = ResourceSpec.from_tf_config(
        {"cluster": {"worker": ["a:1", "b:1", "b:2"], "ps": ["c:1"]}}, gpus_per_worker=0)
    tasks = [_probed("worker:0", gpus=2), _probed("worker:1", cpus=3),
             _probed("worker:2"), _probed("ps:0", cpus=2, memory=0)]
    links = [LinkMeasurement("worker:0", "worker:1", "server", 1e-4, 0.01, 1.5),
             LinkMeasurement("worker:1", "worker:0", "server", 1e-4, 0.01, 9.0),
             LinkMeasurement("worker:0", "worker:2", "server", 1e-4, 0.01, 9.0),
             LinkMeasurement("worker:2", "worker:0", "server", 1e-4, 0.01, 8.0),
             LinkMeasurement("worker:1", "worker:2", "server", 1e-4, 0.01, 0.0)]
    measured = measured_spec(spec, tasks, links)
    nodes = measured.nodes
    assert list(nodes[0].gpus) == [0, 1] and nodes[0].gpu_memory_bytes == 15 << 30
    assert list(nodes[1].cpus) == [0, 1, 2] and not nodes[1].gpus
    assert list(nodes[3].cpus) == [0]   # a PS-only node keeps one CPU
    # a: the chief's host, shared with this (the driver's) process; b: two tasks.
    assert nodes[0].cpu_memory_bytes == (8 << 30) // 2
    assert nodes[1].cpu_memory_bytes == nodes[2].cpu_memory_bytes == (8 << 30) // 2
    assert nodes[3].cpu_memory_bytes == 0   # unknown stays unknown
    # The slower of the fastest send and the fastest receive; the PS: nothing measured.
    assert [n.network_bandwidth_gbps for n in nodes] == [9.0, 1.5, 8.0, 0.0]
    assert measured.replica_devices[:3] == [
        "/job:worker/task:0/device:GPU:0", "/job:worker/task:0/device:GPU:1",
        "/job:worker/task:1/device:CPU:0"]
    probe = ClusterProbe(measured, tuple(tasks), tuple(links), PAYLOAD, 5,
                         "2030-01-01T00:00:00Z", 1.0)
    text = probe.describe()
    assert "2 MiB payload" in text and "medians of 5 runs" in text
    assert "link worker:1 -> worker:0 (server): latency 0.100 ms, 1.5 Gbit/s" in text
    assert "bandwidth unknown" in text
    assert json.loads(json.dumps(probe.to_dict()))["links"][2]["bandwidth_gbps"] == 9.0


def test_links_are_every_pair_or_only_the_chiefs():
    spec = ResourceSpec.from_tf_config({"cluster": {"worker": [f"h:{i + 1}" for i in range(3)]}},
                                       gpus_per_worker=0)
    assert cluster_probe._links_to_measure(spec, [0, 1, 2], None, True) == [
        (0, 1), (1, 0), (0, 2), (2, 0), (1, 2), (2, 1)]
    assert cluster_probe._links_to_measure(spec, [0, 1, 2], None, False) == [
        (0, 1), (1, 0), (0, 2), (2, 0)]


# ----------------------------------------------------------------- on a cluster
def _free_ports(count: int) -> list[int]:
    from autodist.launch.local import free_ports

    return free_ports(count)


@pytest.fixture(scope="module")
def served_cluster(tmp_path_factory):
    """Three serving tasks; yields (TF_CONFIG cluster, their ports)."""
    ports = _free_ports(3)
    addresses = [f"localhost:{p}" for p in ports]
    spec = ResourceSpec.from_dict({"nodes": [
        {"address": a, "cpus": [0, 1] if i == 1 else [0], "roles": ["worker", "ps"]}
        for i, a in enumerate(addresses)]})
    processes = []
    for node in (0, 1):
        processes.append(subprocess.Popen(
            [sys.executable, "-c", _SERVER, str(node), spec.to_text()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    home = tmp_path_factory.mktemp("served")
    cluster = {"worker": addresses}
    env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster,
                                                 "task": {"type": "worker", "index": 2}}))
    processes.append(subprocess.Popen(
        [sys.executable, "-m", "autodist.cli", "serve", "--tf-config", "--insecure",
         "--max-jobs", "1", "--job-timeout", "120", "--work-dir", str(home / "jobs")],
        cwd=home, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True))  # its task process: same group
    try:
        for process in processes[:2]:
            assert process.stdout.readline().strip() == "serving"
        yield cluster, ports
    finally:
        for process in processes[:2]:
            process.terminate()
        try:
            os.killpg(processes[2].pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


@pytest.mark.cluster
def test_the_probe_finds_devices_memory_and_a_capped_link(served_cluster):
    from autodist.bench import capped_links

    cluster, ports = served_cluster
    shaped = capped_links.can_shape()
    if shaped:
        capped_links.shape_lo([ports[1]], CAP_MBIT)
    try:
        probe = cluster_probe.probe_tf_config(
            {"cluster": cluster, "task": {"type": "worker", "index": 0}},
            timeout_s=60, payload_bytes=PAYLOAD, repeats=5)
    finally:
        if shaped:
            capped_links.clear_lo()
    print(probe.describe())
    spec = probe.spec
    assert [list(n.cpus) for n in spec.nodes] == [[0], [0, 1], [0]]
    assert not any(n.gpus for n in spec.nodes)
    assert [t.server_task for t in probe.tasks] == ["worker:0", "worker:1", "worker:2"]
    host = host_memory_bytes()
    assert [t.host_memory_bytes for t in probe.tasks] == [host] * 3
    # Three tasks on localhost, and this (the driver's) process on the chief's host.
    assert [n.cpu_memory_bytes for n in spec.nodes] == [host // 4] * 3
    links = {(link.sender, link.reader): link for link in probe.links}
    assert len(links) == 6   # every pair, both ways
    # A round trip within the noise of a loaded machine measures 0 even when timed longer.
    assert all(link.path == "server" and 0 <= link.latency_s < 0.5 for link in links.values())
    assert any(link.latency_s > 0 for link in links.values())
    if not shaped:
        pytest.skip("no cap: tc needs root in a private network namespace (devices, memory "
                    "and links were checked)")
    cap_gbps = CAP_MBIT / 1000
    low, high = CAPPED_RANGE
    # The htb filter matches worker:1's port: what its server sends (TensorFlow's receiver
    # pulls a tensor from the sender's server), not what it receives.
    for (sender, _), link in links.items():
        if sender == "worker:1":
            assert low * cap_gbps <= link.bandwidth_gbps <= high * cap_gbps, link
        else:
            assert link.bandwidth_gbps > 3 * cap_gbps, link
    assert low * cap_gbps <= spec.bandwidth_gbps(1) <= high * cap_gbps
    assert spec.bandwidth_gbps(0) > 3 * cap_gbps and spec.bandwidth_gbps(2) > 3 * cap_gbps


@pytest.mark.cluster
def test_this_process_stands_in_for_a_chief_that_does_not_serve(served_cluster):
    cluster, _ = served_cluster
    unserved = _free_ports(1)[0]
    tf_config = {"cluster": {"chief": [f"localhost:{unserved}"], "worker": cluster["worker"][1:]},
                 "task": {"type": "chief", "index": 0}}
    # 4 MiB: uncapped loopback moves it in a few ms, well above the timing noise.
    probe = cluster_probe.probe_tf_config(tf_config, timeout_s=30, payload_bytes=4 << 20,
                                          repeats=3)
    chief, *others = probe.tasks
    assert chief.server_task == "" and chief.host_memory_bytes == host_memory_bytes()
    assert [t.server_task for t in others] == ["worker:1", "worker:2"]
    assert [(link.sender, link.reader, link.path) for link in probe.links] == [
        ("worker:1", "worker:0", "client"), ("worker:0", "worker:1", "client"),
        ("worker:2", "worker:0", "client"), ("worker:0", "worker:2", "client"),
        ("worker:2", "worker:1", "server"), ("worker:1", "worker:2", "server")]
    assert all(link.bandwidth_gbps > 0 for link in probe.links), probe.describe()


@pytest.mark.cluster
def test_an_absent_task_is_named_within_the_timeout(served_cluster):
    cluster, _ = served_cluster
    absent = _free_ports(1)[0]
    tf_config = {"cluster": {"worker": [*cluster["worker"][:2], f"localhost:{absent}"]},
                 "task": {"type": "worker", "index": 0}}
    start = time.monotonic()
    with pytest.raises(ProbeError, match=f"worker:2 at localhost:{absent}") as caught:
        cluster_probe.probe_tf_config(tf_config, timeout_s=2)
    assert time.monotonic() - start < 5
    assert caught.value.tasks == ("worker:2",)


@pytest.mark.cluster
def test_a_server_at_another_tasks_address_is_refused(served_cluster):
    cluster, _ = served_cluster
    swapped = {"cluster": {"worker": [cluster["worker"][0], cluster["worker"][2],
                                      cluster["worker"][1]]}}
    with pytest.raises(ProbeError, match=r"is \['worker:2'\], not worker:1"):
        cluster_probe.probe_tf_config(swapped, timeout_s=10, payload_bytes=1024, repeats=1)


@pytest.mark.cluster
def test_autodist_probe_prints_the_measured_spec(served_cluster, monkeypatch, capsys):
    from autodist import cli

    cluster, _ = served_cluster
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster,
                                                "task": {"type": "worker", "index": 0}}))
    assert cli.main(["probe", "--tf-config", "--json", "--payload-mb", "1", "--repeats", "1",
                     "--chief-links-only"]) == 0
    data = json.loads(capsys.readouterr().out)
    spec = ResourceSpec.from_text(data["resource_spec"])
    assert [list(n.cpus) for n in spec.nodes] == [[0], [0, 1], [0]]
    assert len(data["links"]) == 4 and data["repeats"] == 1
