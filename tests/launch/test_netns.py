"""Private network namespaces for local clusters, and the "only loopback" test.

No TensorFlow here: a plain socket server stands in for a task. The cluster
test (a fit whose tasks other hosts cannot reach) is in `test_isolation.py`.
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys

import pytest

from autodist.bench import capped_links
from autodist.launch import netns_holder, private_network

_LISTEN = """
import os, socket, sys
server = socket.socket()
server.bind(("0.0.0.0", 0))
server.listen()
client = socket.create_connection(("127.0.0.1", server.getsockname()[1]), timeout=5)
print(socket.if_nameindex(), os.readlink("/proc/self/ns/net"), server.getsockname()[1],
      flush=True)
sys.stdin.read()
"""


def _create_or_skip() -> private_network.PrivateNetwork:
    try:
        return private_network.PrivateNetwork.create()
    except private_network.NamespaceUnavailable as e:
        pytest.skip(f"no network namespace can be made here: {e}")


@pytest.mark.parametrize("unprivileged", [False, True], ids=["root", "user-namespace"])
def test_a_private_network_has_only_loopback_and_ends_with_its_holder(monkeypatch,
                                                                      unprivileged):
    """A listener inside answers on loopback there, and nothing outside reaches its port."""
    if unprivileged:  # as a user would: `unshare --net --map-root-user`, then nsenter --user
        monkeypatch.setattr(os, "geteuid", lambda: 1000)
    network = _create_or_skip()
    assert network.user_namespace == unprivileged
    inside = subprocess.Popen(network.command([sys.executable, "-I", "-c", _LISTEN]),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        interfaces, namespace, port = inside.stdout.readline().rsplit(" ", 2)
        assert interfaces == "[(1, 'lo')]"
        assert namespace != os.readlink("/proc/self/ns/net")
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", int(port)), timeout=5)
    finally:
        inside.stdin.close()
        inside.wait(timeout=10)
    network.close()
    assert network.holder.returncode == 0 and not os.path.exists(f"/proc/{network.holder.pid}")


def test_a_namespace_that_cannot_be_made_says_why(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(private_network.NamespaceUnavailable, match="unshare and nsenter not found"):
        private_network.PrivateNetwork.create()


def _unavailable(monkeypatch):
    def refuse(cls, timeout_s=10.0):
        raise private_network.NamespaceUnavailable(
            "`unshare --net`: unshare failed: Operation not permitted")
    monkeypatch.setattr(private_network, "is_private", lambda: False)
    monkeypatch.setattr(private_network.PrivateNetwork, "create", classmethod(refuse))
    monkeypatch.delenv(private_network.ALLOW_EXPOSED_ENV, raising=False)


TASKS = [("worker:0", 40001), ("worker:1", 40002), ("ps:0", 40003)]


def test_no_namespace_and_no_opt_in_is_refused(monkeypatch):
    _unavailable(monkeypatch)
    with pytest.raises(private_network.ExposedNetworkError,
                       match=r"none could be made here \(`unshare --net`: unshare failed: "
                             r"Operation not permitted\).*allow_exposed=True or "
                             r"AUTODIST_ALLOW_EXPOSED=1.*worker:0 on port 40001, worker:1 on "
                             r"port 40002, ps:0 on port 40003"):
        private_network.local_network(TASKS)


@pytest.mark.parametrize("by", ["argument", "environment"])
def test_an_opt_in_runs_exposed_with_a_warning_naming_every_port(monkeypatch, caplog, capsys,
                                                                 by):
    _unavailable(monkeypatch)
    if by == "environment":
        monkeypatch.setenv(private_network.ALLOW_EXPOSED_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="autodist.launch.private_network"):
        assert private_network.local_network(TASKS, allow_exposed=by == "argument") is None
    ports = "worker:0 on port 40001, worker:1 on port 40002, ps:0 on port 40003"
    assert ports in caplog.text and ports in capsys.readouterr().err
    assert "reachable from other hosts" in caplog.text


def test_an_already_private_namespace_needs_nothing(monkeypatch):
    def fail(cls, timeout_s=10.0):
        raise AssertionError("no namespace should be made")
    monkeypatch.setattr(private_network, "is_private", lambda: True)
    monkeypatch.setattr(private_network.PrivateNetwork, "create", classmethod(fail))
    assert private_network.local_network(TASKS) is None


def test_only_loopback_up_is_private(monkeypatch):
    """Interfaces that are up count, loopback aside; one whose flags cannot be read is up."""
    monkeypatch.setattr(socket, "if_nameindex", lambda: [(1, "lo")])
    assert netns_holder.exposed_interfaces() == [] and private_network.is_private()
    monkeypatch.setattr(socket, "if_nameindex", lambda: [(1, "lo"), (7, "no-such-if0")])
    assert netns_holder.exposed_interfaces() == ["no-such-if0"] and not private_network.is_private()


def test_bench_check_does_not_need_proc_1(monkeypatch):
    """Where /proc/1/ns/net cannot be read (as on this machine), bench's check still works:
    it looks at this namespace's interfaces."""
    real_readlink = os.readlink

    def readlink(path, *args, **kwargs):
        if str(path).startswith("/proc/1/"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_readlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "readlink", readlink)
    monkeypatch.setattr(socket, "if_nameindex", lambda: [(1, "lo")])
    assert capped_links.in_private_netns()
    monkeypatch.setattr(socket, "if_nameindex", lambda: [(1, "lo"), (2, "no-such-if0")])
    assert not capped_links.in_private_netns() and not capped_links.can_shape()


_BENCH_CHECK = """
import os
real = os.readlink
def readlink(path, *args, **kwargs):
    if str(path).startswith("/proc/1/"):
        raise PermissionError(13, "Permission denied", str(path))
    return real(path, *args, **kwargs)
os.readlink = readlink
from autodist.bench import capped_links
print(capped_links.can_shape())
"""


def test_readme_bench_command_passes_the_check():
    """`unshare -n bash -c 'ip link set lo up && ...'`, as the README says, is private."""
    if os.geteuid() != 0 or subprocess.run(["unshare", "-n", "true"],
                                           capture_output=True).returncode:
        pytest.skip("needs root and `unshare -n`")
    result = subprocess.run(
        ["unshare", "-n", "bash", "-c", 'ip link set lo up && "$@"', "bash", sys.executable,
         "-c", _BENCH_CHECK], capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert result.stdout.strip() == "True", result.stderr[-2000:]
