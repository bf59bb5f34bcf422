"""Task providers: which worker slots an elastic run's grows acquire and shrinks release."""
from __future__ import annotations

import socket

import pytest

from autodist.adapt.task_providers import LocalProcesses, ServedHosts, TaskProviderError
from autodist.ir.addresses import accepts
from autodist.ir.resource_spec import ResourceSpec


def test_local_processes_grow_onto_the_lowest_idle_tasks_and_shrink_off_the_highest():
    provider = LocalProcesses(4)
    assert provider.resize((0, 2), 4) == (0, 1, 2, 3)
    assert provider.resize((0, 2), 3) == (0, 1, 2)
    assert provider.resize((0, 1, 2, 3), 2) == (0, 1)
    assert provider.resize((0, 3), 1) == (0,)


def test_served_hosts_grow_only_onto_served_slots_and_release_the_last_joined_first():
    served = {"h0:1", "h2:3"}
    provider = ServedHosts(["c:0", "h0:1", "h1:2", "h2:3"], is_served=served.__contains__)
    assert provider.available((0,)) == [1, 3]
    assert provider.resize((0,), 2) == (0, 1)
    with pytest.raises(TaskProviderError, match=r"1 worker tasks available \(\[3\]\).*2 were"):
        provider.resize((0, 1), 4)
    served.add("h1:2")   # a host served after launch: the next grow may land on it
    assert provider.resize((0, 1), 3) == (0, 1, 2)
    assert provider.resize((0, 1, 2), 2) == (0, 1)   # worker 2 joined last: it leaves first
    assert provider.resize((0, 1), 1) == (0,)


def test_providers_never_release_the_chief_and_check_their_arguments():
    provider = LocalProcesses(3)
    with pytest.raises(TaskProviderError, match="chief"):
        provider.release((0, 1), 2)
    with pytest.raises(TaskProviderError, match=r"1\.\.3"):
        provider.resize((0,), 4)
    with pytest.raises(TaskProviderError, match="with the chief"):
        provider.resize((1, 2), 1)
    with pytest.raises(TaskProviderError, match="max_workers"):
        LocalProcesses(0)


def test_served_hosts_from_a_spec_and_the_default_check_connects():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        spec = ResourceSpec.from_dict({"nodes": [
            {"address": "127.0.0.1", "port": 1, "cpus": [0], "chief": True},
            {"address": "127.0.0.1", "port": port, "cpus": [0]}]})
        provider = ServedHosts.from_spec(spec)
        assert provider.addresses == ["127.0.0.1:1", f"127.0.0.1:{port}"]
        assert accepts(f"127.0.0.1:{port}") and not accepts("127.0.0.1:1")
        assert not accepts("no port") and not accepts("127.0.0.1:not-a-port")
        assert provider.available((0,)) == [1]
