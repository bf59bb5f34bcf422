"""A local fit on a host that has a network: other hosts cannot reach its tasks.

The test process's namespace (the test's own private one, `scripts/test.sh`)
gets a veth pair to "another host": a namespace of its own, held by a
process, with the other end of the pair. Both ends have addresses, so the
test process is no longer "only loopback", as on a real machine. A local
`fit` then runs its tasks in a private namespace: they train (equal to
Keras), listen there on loopback, and a client on the other host cannot
connect to any task port at this host's address. Opting in to exposed
tasks (where no namespace can be made) makes the same connections succeed,
with a warning that names every port.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess

import numpy as np
import pytest

import keras
import autodist
from autodist import models
from autodist.launch import private_network
from autodist.search import builders

pytestmark = pytest.mark.cluster

TOLERANCE = 2e-5
HOST, PEER = "10.213.7.1", "10.213.7.2"


def _ip(*args: str, network: private_network.PrivateNetwork | None = None) -> None:
    command = ["ip", *args]
    subprocess.run(network.command(command) if network else command, check=True,
                   capture_output=True, timeout=30)


def _connects(command_prefix: list[str], address: str, port: int) -> bool:
    """Whether a TCP connection to address:port succeeds from where the prefix runs."""
    probe = ["timeout", "5", "bash", "-c", f"exec 3<>/dev/tcp/{address}/{port}"]
    return subprocess.run([*command_prefix, *probe], capture_output=True,
                          timeout=30).returncode == 0


@pytest.fixture
def another_host():
    """A peer namespace linked to this one by a veth pair; this namespace is then exposed."""
    if os.geteuid() != 0:
        pytest.skip("needs root to add a veth pair")
    if not private_network.is_private():
        pytest.skip("adds an interface to this process's namespace: run it in a private "
                    "one (scripts/test.sh)")
    try:
        peer = private_network.PrivateNetwork.create()
    except private_network.NamespaceUnavailable as e:
        pytest.skip(f"no namespace for the other host: {e}")
    link = f"adv{os.getpid() % 100000}"
    try:
        _ip("link", "add", link, "type", "veth", "peer", "name", "adpeer0", "netns",
            str(peer.holder.pid))
    except subprocess.CalledProcessError as e:
        peer.close()
        pytest.skip(f"cannot make a veth pair here: {e.stderr.decode().strip()}")
    try:
        _ip("addr", "add", f"{HOST}/24", "dev", link)
        _ip("link", "set", link, "up")
        _ip("addr", "add", f"{PEER}/24", "dev", "adpeer0", network=peer)
        _ip("link", "set", "adpeer0", "up", network=peer)
        assert not private_network.is_private()
        yield peer
    finally:
        subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30)
        peer.close()


class _Probe(keras.callbacks.Callback):
    """At the end of the first epoch (the cluster waits for the driver): who reaches the
    task ports, from the other host and from inside the tasks' own namespace."""

    def __init__(self, run, peer: private_network.PrivateNetwork) -> None:
        super().__init__()
        self.run, self.peer = run, peer
        self.from_peer: dict[int, bool] = {}
        self.from_inside: dict[int, bool] = {}
        self.task_namespace = ""

    def on_epoch_end(self, epoch, logs=None):
        if epoch:
            return
        job = self.run.last_job_dir
        ports = json.loads((job / "cluster.json").read_text())["ports"]
        pid = int((job / "ready" / "worker_0").read_text())
        self.task_namespace = os.readlink(f"/proc/{pid}/ns/net")
        prefix = self.peer.command([])[:-1]  # nsenter ... (without the "--")
        self.from_peer = {p: _connects(prefix, HOST, p) for p in ports}
        inside = ["nsenter", f"--net=/proc/{pid}/ns/net"]
        self.from_inside = {p: _connects(inside, "127.0.0.1", p) for p in ports}


def _train(tmp_path, peer, name: str, **options):
    model = models.mlp(input_dim=20, hidden=(16,),
                       optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(90, 20)).astype("float32")
    y = rng.integers(0, 10, 90).astype("int32")
    reference = models.single_device_twin(model)
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    graph_item = autodist.capture(model)
    run = autodist.distribute(model, builders.PS().build(graph_item, spec), spec,
                              graph_item=graph_item, job_dir=str(tmp_path / name), **options)
    probe = _Probe(run, peer)
    history = run.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[probe], shuffle=False)
    assert len(history.step_losses) == 6
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    return run, probe


def test_a_local_fit_is_out_of_other_hosts_reach(tmp_path, another_host):
    # The probe itself: a listener here at HOST is reached from the other host.
    import socket

    with socket.socket() as listener:
        listener.bind((HOST, 0))
        listener.listen()
        assert _connects(another_host.command([])[:-1], HOST, listener.getsockname()[1])

    run, probe = _train(tmp_path, another_host, "private")
    assert probe.from_inside and all(probe.from_inside.values()), probe.from_inside
    assert not any(probe.from_peer.values()), probe.from_peer
    assert probe.task_namespace != os.readlink("/proc/self/ns/net")
    # What the tasks and the driver wrote is this user's only.
    for path in [run.last_job_dir, *run.last_job_dir.rglob("*")]:
        mode = path.lstat().st_mode & 0o777
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))


def test_opting_in_where_no_namespace_can_be_made_exposes_the_ports(tmp_path, another_host,
                                                                     monkeypatch, caplog,
                                                                     capsys):
    def unavailable(cls, timeout_s=10.0):
        raise private_network.NamespaceUnavailable("test: user namespaces disabled")

    monkeypatch.setattr(private_network.PrivateNetwork, "create", classmethod(unavailable))
    monkeypatch.delenv(private_network.ALLOW_EXPOSED_ENV, raising=False)
    model = models.mlp(input_dim=20, hidden=(16,))
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    graph_item = autodist.capture(model)
    refused = autodist.distribute(model, builders.PS().build(graph_item, spec), spec,
                                  graph_item=graph_item, job_dir=str(tmp_path / "refused"))
    with pytest.raises(private_network.ExposedNetworkError,
                       match=r"none could be made here \(test: user namespaces disabled\)"):
        refused.fit(np.zeros((8, 20), "float32"), np.zeros(8, "int32"), batch_size=8,
                    verbose=0, shuffle=False)
    assert not list((tmp_path / "refused" / "logs").iterdir())  # no task was started

    with caplog.at_level(logging.WARNING, logger="autodist.launch.private_network"):
        run, probe = _train(tmp_path, another_host, "exposed", allow_exposed=True)
    assert probe.from_peer and all(probe.from_peer.values()), probe.from_peer
    assert probe.task_namespace == os.readlink("/proc/self/ns/net")
    err = capsys.readouterr().err
    for name, port in zip(("worker:0", "worker:1", "ps:0"), probe.from_peer):
        assert f"{name} on port {port}" in caplog.text and f"{name} on port {port}" in err
