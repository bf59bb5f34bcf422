"""Multi-host runs across emulated hosts: network namespaces on a bridge (`tests.emulated_hosts`).

Each other task is an `autodist serve --tf-config` process on a host of its
own, at that host's address, with the cluster's secret (AUTODIST_SECRET_FILE);
the chief's side runs in the test process, at the bridge's address
(`launch="remote"`, TF_CONFIG task worker:0). One host's link is capped with
`tc` htb. The first tests check the hosts themselves with plain sockets.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import autodist
from autodist import models
from autodist.adapt.policy_interface import Policy
from autodist.search import builders
from tests import emulated_hosts, small_mlp

pytestmark = pytest.mark.cluster

TOLERANCE = 2e-5
CAP_MBIT = 40

# Inside a host: listens on its address, prints the port, then reads to EOF and answers "k".
_SINK = """
import socket, sys
server = socket.socket()
server.bind((sys.argv[1], 0))
server.listen()
print(server.getsockname()[1], flush=True)
connection, _ = server.accept()
while connection.recv(1 << 16):
    pass
connection.sendall(b"k")
"""
# Inside a host: connects to argv[1]:argv[2]; prints "reached" or the error.
_CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()
    print("reached")
except OSError as e:
    print(type(e).__name__)
"""


def _python(host: emulated_hosts.EmulatedHost, script: str, *args: str) -> subprocess.Popen:
    return host.popen([sys.executable, "-I", "-c", script, *args], stdout=subprocess.PIPE,
                      stdin=subprocess.DEVNULL, text=True)


def _send_to_sink(host: emulated_hosts.EmulatedHost, size: int) -> float:
    """Seconds to send `size` bytes from the test process to a sink on `host`."""
    sink = _python(host, _SINK, host.address)
    try:
        port = int(sink.stdout.readline())
        start = time.monotonic()
        with socket.create_connection((host.address, port), timeout=10) as connection:
            connection.settimeout(30)
            connection.sendall(b"x" * size)
            connection.shutdown(socket.SHUT_WR)
            assert connection.recv(1) == b"k"
        return time.monotonic() - start
    finally:
        sink.wait(timeout=10)


def test_hosts_have_their_own_addresses_and_reach_each_other(request):
    """Each host: its own namespace, only loopback and eth0 up, its own address; the test
    process and the other host reach it there, and nothing in a host reaches the test's
    loopback."""
    hosts = emulated_hosts.start(request, count=2)
    own = os.readlink("/proc/self/ns/net")
    assert len({own, hosts[0].namespace_id(), hosts[1].namespace_id()}) == 3
    for host in hosts.hosts:
        interfaces = host.run(["ip", "-o", "-4", "addr", "show"])
        assert "lo " in interfaces and f"eth0    inet {host.address}/24" in interfaces
        up = host.run(["ip", "-o", "link", "show", "up"]).splitlines()
        assert [line.split(":")[1].strip().split("@")[0] for line in up] == ["lo", "eth0"]

    sink = _python(hosts[0], _SINK, hosts[0].address)
    port = sink.stdout.readline().strip()
    from_host1 = _python(hosts[1], _CONNECT, hosts[0].address, port)
    assert from_host1.stdout.read().strip() == "reached"
    from_host1.wait(timeout=10)
    sink.wait(timeout=10)
    assert _send_to_sink(hosts[0], 1000) < 5

    with socket.create_server(("127.0.0.1", 0)) as listener:  # the test's loopback only
        to_loopback = _python(hosts[0], _CONNECT, "127.0.0.1", str(listener.getsockname()[1]))
        assert to_loopback.stdout.read().strip() == "ConnectionRefusedError"
        to_loopback.wait(timeout=10)
    to_chief = _python(hosts[1], _CONNECT, hosts.chief_address, "9")  # nothing listens: refused
    assert to_chief.stdout.read().strip() == "ConnectionRefusedError"
    to_chief.wait(timeout=10)


def test_a_capped_host_receives_at_its_cap_and_close_removes_everything(request):
    """2 MB to a host capped at 40 Mbit/s take >= 0.4s at the cap (uncapped: far less);
    `close` ends a process left running inside and removes the bridge and veth pairs."""
    hosts = emulated_hosts.start(request, count=2, mbit={1: CAP_MBIT})
    size = 2_000_000
    capped = _send_to_sink(hosts[1], size)
    uncapped = _send_to_sink(hosts[0], size)
    assert capped >= 0.9 * size * 8 / (CAP_MBIT * 1e6), capped
    assert uncapped < capped / 2, (uncapped, capped)
    assert hosts[1].shaped_bytes()[1] >= size
    assert hosts[0].shaped_bytes() == (0, 0)

    left = hosts[0].popen(["sleep", "300"])
    holders = [host.network.holder for host in hosts.hosts]
    assert sorted(hosts.links()) == sorted([hosts.bridge, hosts[0].bridge_port,
                                            hosts[1].bridge_port])
    hosts.close()
    assert left.poll() is not None
    assert all(holder.poll() is not None for holder in holders)
    assert hosts.links() == []


# ------------------------------------------------------------ training across hosts
def _check_served(servers) -> None:
    for process, log in servers:  # each served its one job and ended cleanly
        assert process.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert "received a job" in log.read_text()


def test_remote_launch_across_hosts_trains_like_keras(request, tmp_path, monkeypatch,
                                                      secret_file):
    """worker:1 on host0, ps:0 on host1 (capped at 40 Mbit/s), the chief here; Parallax
    (PS and all-reduce) on an embedding model with Adam: weights and per-epoch losses
    equal single-device Keras."""
    hosts = emulated_hosts.start(request, count=2, mbit={1: CAP_MBIT})
    tasks = [("worker", 1), ("ps", 0)]
    cluster = emulated_hosts.cluster_on(hosts, tasks)
    servers = [emulated_hosts.serve(host, tmp_path, cluster, kind, index)
               for host, (kind, index) in zip(hosts.hosts, tasks)]

    model = models.embedding_model(num_users=50, num_items=71, dim=8, optimizer="adam")
    rng = np.random.default_rng(0)
    x = [rng.integers(0, 50, (90, 1)).astype("int32"),
         rng.integers(0, 71, (90, 1)).astype("int32")]
    y = rng.integers(0, 2, (90, 1)).astype("float32")
    reference = models.single_device_twin(model)
    expected = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)

    monkeypatch.setenv("TF_CONFIG", emulated_hosts.tf_config(cluster, "worker", 0))
    spec = autodist.ResourceSpec.from_tf_config()
    graph_item = autodist.capture(model)
    strategy = builders.Parallax(min_shard_bytes=64).build(graph_item, spec)
    run = autodist.distribute(model, strategy, spec, graph_item=graph_item, launch="remote",
                              job_dir=str(tmp_path / "chief"))
    history = run.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)

    assert len(history.step_losses) == 6
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=0,
                               atol=TOLERANCE)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    _check_served(servers)
    assert f"serving at {hosts[1].address}" in servers[1][1].read_text()
    assert all(sent > 0 for sent in hosts[1].shaped_bytes())  # the PS's traffic was capped


def _resizable_run(request, tmp_path, monkeypatch):
    """worker:1 on host0, worker:2 on host1 (capped), the chief here; all-reduce with 4
    virtual nodes (global batch 32) on a small MLP; (run, x, y, and a check that the run's
    model equals single-device Keras and each host served its one job)."""
    hosts = emulated_hosts.start(request, count=2, mbit={1: CAP_MBIT})
    tasks = [("worker", 1), ("worker", 2)]
    cluster = emulated_hosts.cluster_on(hosts, tasks)
    servers = [emulated_hosts.serve(host, tmp_path, cluster, kind, index)
               for host, (kind, index) in zip(hosts.hosts, tasks)]

    x, y = small_mlp.data(96)
    model = small_mlp.mlp()
    reference = models.single_device_twin(model)
    expected = reference.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)

    monkeypatch.setenv("TF_CONFIG", emulated_hosts.tf_config(cluster, "worker", 0))
    spec = autodist.ResourceSpec.from_tf_config()
    graph_item = autodist.capture(model)
    strategy = builders.AllReduce().build(graph_item, spec).with_virtual_nodes(32, 4)
    run = autodist.distribute(model, strategy, spec, graph_item=graph_item, launch="remote",
                              job_dir=str(tmp_path / "chief"))

    def check(history) -> None:
        np.testing.assert_allclose(history.history["loss"], expected.history["loss"],
                                   rtol=0, atol=TOLERANCE)
        for got, want in zip(model.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
        _check_served(servers)

    return run, x, y, check


def test_elastic_resizing_across_hosts_trains_like_keras(request, tmp_path, monkeypatch,
                                                         secret_file):
    """worker:1 on host0, worker:2 on host1 (capped), the chief here; all-reduce with 4
    virtual nodes resized 2 -> 3 -> 1 workers: weights and per-epoch losses equal
    single-device Keras with batch 32."""
    run, x, y, check = _resizable_run(request, tmp_path, monkeypatch)
    history = run.fit(x, y, epochs=3, verbose=0, shuffle=False, resize_at={0: 2, 3: 3, 6: 1})

    assert [(r.step, r.members) for r in history.resizes] == [(3, (0, 1, 2)), (6, (0,))]
    check(history)


class _ResizeAt(Policy):
    """A policy that asks for `workers` workers once step `step` has ended."""

    def __init__(self, step: int, workers: int) -> None:
        self.step, self.workers = step, workers

    def on_step_end(self, metrics, control) -> None:
        if metrics.step == self.step:
            control.resize(self.workers, reason="test")


def test_a_policy_resizes_across_hosts_and_trains_like_keras(request, tmp_path, monkeypatch,
                                                             secret_file):
    """The same cluster, grown 2 -> 3 workers by a policy the driver runs (a followed run:
    the chief waits for the driver's decisions), then shrunk to 2: equal to single-device
    Keras."""
    run, x, y, check = _resizable_run(request, tmp_path, monkeypatch)
    history = run.fit(x, y, epochs=3, verbose=0, shuffle=False, resize_at={0: 2},
                      policies=[_ResizeAt(2, 3), _ResizeAt(5, 2)])

    grown = [r for r in history.resizes if len(r.members) == 3]
    assert grown and [a.action for a in history.actions].count("resize") == 2, history.actions
    check(history)
