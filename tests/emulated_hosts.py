"""Emulated hosts for multi-host tests: network namespaces on a bridge, inside the test's own.

The test process already runs in a private network namespace (`.ci/run` and
the suite's command run pytest under ``unshare -n`` as root). There this
module makes N further namespaces, the "hosts", each held by a process
(`autodist.launch.private_network.PrivateNetwork`: ``unshare --net``, then
``nsenter`` to run something inside) and joined to a Linux bridge in the
test's namespace by a veth pair. Every host gets its own address on a
private subnet (``10.77.<n>.0/24``, host i at ``.<11 + i>``); the bridge gets
``.1``, so a chief's side in the test process reaches the hosts and they
reach it. Nothing is routed anywhere else: traffic stays between namespaces
the test made.

A host can have a bandwidth cap: an ``htb`` class on both ends of its veth
pair (its uploads on its own end, its downloads on the bridge's end). This
kernel has no ``netem``, so there is no latency emulation.

    hosts = emulated_hosts.start(request, count=2, mbit={1: 100})
    process = hosts[0].popen([sys.executable, "-m", "autodist.cli", "serve", ...])
    hosts.chief_address          # "10.77.1.1": the test process's end of the bridge
    hosts[1].address             # "10.77.1.12"

`start` skips the test, with the reason, where hosts cannot be made (not
root, no ``ip``/``tc``/``nsenter``/``unshare``, not inside a private
namespace, the kernel refuses a bridge or veth). One set of hosts at a time:
while its bridge is up, the test's namespace is no longer loopback-only, so
a second `start` skips (and a local cluster started meanwhile makes its own
private namespace, as it would on a real host). Every wait is bounded, and
`EmulatedHosts.close` (a finalizer of the test) ends every process inside
the hosts and removes every link.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Mapping, Sequence

import pytest

from autodist.launch import private_network

SUBNET_PREFIX = "10.77"
_COMMAND_TIMEOUT_S = 10.0
_TOOLS = ("ip", "tc", "nsenter", "unshare")
# One subnet and one set of link names per EmulatedHosts of this test process.
_SERIAL = itertools.count(1)


class HostsUnavailable(RuntimeError):
    """Emulated hosts cannot be made here (the message says why)."""


def unavailable_reason() -> str | None:
    """Why emulated hosts cannot be made in this process, or None if they can be tried."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "emulated hosts need root (a bridge and veth pairs)"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return f"emulated hosts need {', '.join(missing)} (iproute2, util-linux)"
    if not private_network.is_private():
        return ("emulated hosts are made only inside a private network namespace (run the "
                "suite under `unshare -n`), never on this machine's own network")
    return None


def _run(argv: Sequence[str]) -> str:
    """Runs a command to its end (bounded); its stdout.

    Raises:
        HostsUnavailable: it failed or timed out (with its stderr).
    """
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True,
                              timeout=_COMMAND_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise HostsUnavailable(f"`{' '.join(argv)}` took over {_COMMAND_TIMEOUT_S:g}s") from e
    if done.returncode:
        raise HostsUnavailable(f"`{' '.join(argv)}` failed: {done.stderr.strip()[-300:]}")
    return done.stdout


@dataclasses.dataclass
class EmulatedHost:
    """One emulated host: a network namespace with loopback and one interface, eth0.

    Attributes:
        name: "host<i>", for messages.
        address: Its IPv4 address on the test subnet.
        network: The namespace (its holder process names it).
        bridge_port: Its veth end on the bridge, in the test's namespace.
        mbit: Its bandwidth cap in Mbit/s each way (None: uncapped).
        processes: What `popen` started in it.
    """

    name: str
    address: str
    network: private_network.PrivateNetwork
    bridge_port: str
    mbit: float | None = None
    processes: list[subprocess.Popen] = dataclasses.field(default_factory=list)

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` as a command that runs inside this host's namespace."""
        return self.network.command(argv)

    def run(self, argv: Sequence[str]) -> str:
        """Runs `argv` inside this host to its end (bounded); its stdout."""
        return _run(self.command(argv))

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Starts `argv` inside this host, in a session of its own; ended by `close` if alive.

        Args:
            argv: The command.
            **kwargs: More `subprocess.Popen` arguments (env, cwd, stdout, ...).
        """
        process = subprocess.Popen(self.command(argv), start_new_session=True, **kwargs)
        self.processes.append(process)
        return process

    def namespace_id(self) -> str:
        """The namespace's identity (``net:[inode]``), as /proc/<pid>/ns/net reads."""
        return os.readlink(f"/proc/{self.network.holder.pid}/ns/net")

    def shaped_bytes(self) -> tuple[int, int]:
        """Bytes that went through the cap: (uploaded by this host, downloaded to it)."""
        def sent(text: str) -> int:
            found = re.search(r"class htb 1:10 .*?Sent (\d+) bytes", text, re.S)
            return int(found.group(1)) if found else 0

        return (sent(self.run(["tc", "-s", "class", "show", "dev", "eth0"])),
                sent(_run(["tc", "-s", "class", "show", "dev", self.bridge_port])))


class EmulatedHosts:
    """N emulated hosts on a bridge whose end in the test's namespace is `chief_address`.

    Use `start` in a test (it skips where hosts cannot be made and closes them
    when the test ends), or `create` and `close` by hand.

    Attributes:
        hosts: The hosts, host0 first.
        bridge: The bridge's name.
        chief_address: The bridge's address: the test process's address for the hosts.
    """

    def __init__(self, serial: int) -> None:
        self.serial = serial
        self.bridge = f"adhbr{serial}"
        self.chief_address = f"{SUBNET_PREFIX}.{serial}.1"
        self.hosts: list[EmulatedHost] = []
        self.closed = False

    def __getitem__(self, index: int) -> EmulatedHost:
        return self.hosts[index]

    def __len__(self) -> int:
        return len(self.hosts)

    @classmethod
    def create(cls, count: int, mbit: Mapping[int, float] | None = None) -> EmulatedHosts:
        """Makes the bridge and `count` hosts on it.

        Args:
            count: How many hosts.
            mbit: Host index -> its bandwidth cap in Mbit/s, each way.

        Raises:
            HostsUnavailable: they cannot be made here (nothing is left behind).
        """
        reason = unavailable_reason()
        if reason:
            raise HostsUnavailable(reason)
        hosts = cls(next(_SERIAL))
        try:
            _run(["ip", "link", "add", hosts.bridge, "type", "bridge"])
            _run(["ip", "addr", "add", f"{hosts.chief_address}/24", "dev", hosts.bridge])
            _run(["ip", "link", "set", hosts.bridge, "up"])
            for i in range(count):
                hosts.hosts.append(hosts._add_host(i, (mbit or {}).get(i)))
        except BaseException:
            hosts.close()
            raise
        return hosts

    def _add_host(self, index: int, mbit: float | None) -> EmulatedHost:
        try:
            network = private_network.PrivateNetwork.create()
        except private_network.NamespaceUnavailable as e:
            raise HostsUnavailable(f"no network namespace for a host: {e}") from e
        port, inner = f"adh{self.serial}p{index}", f"adh{self.serial}i{index}"
        host = EmulatedHost(f"host{index}", f"{SUBNET_PREFIX}.{self.serial}.{11 + index}",
                            network, port, mbit)
        try:
            _run(["ip", "link", "add", port, "type", "veth", "peer", "name", inner])
            _run(["ip", "link", "set", inner, "netns", str(network.holder.pid)])
            _run(["ip", "link", "set", port, "master", self.bridge])
            _run(["ip", "link", "set", port, "up"])
            host.run(["ip", "link", "set", inner, "name", "eth0"])
            host.run(["ip", "addr", "add", f"{host.address}/24", "dev", "eth0"])
            host.run(["ip", "link", "set", "eth0", "up"])
            if mbit is not None:
                _cap(host.run, "eth0", mbit)
                _cap(_run, port, mbit)
        except BaseException:
            self.hosts.append(host)  # closed with the others
            raise
        return host

    def close(self, timeout_s: float = 10.0) -> None:
        """Ends every process inside the hosts, the holders, the links and the bridge.

        Idempotent; each wait bounded by `timeout_s`.
        """
        if self.closed:
            return
        self.closed = True
        for host in self.hosts:
            _end_processes(host, timeout_s)
            host.network.close(timeout_s)
            subprocess.run(["ip", "link", "del", host.bridge_port], capture_output=True,
                           timeout=_COMMAND_TIMEOUT_S, check=False)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True,
                       timeout=_COMMAND_TIMEOUT_S, check=False)

    def links(self) -> list[str]:
        """The links of this EmulatedHosts still in the test's namespace (none after `close`)."""
        names = re.findall(r"^\d+: ([^:@]+)", _run(["ip", "-o", "link", "show"]), re.M)
        return [n for n in names if n == self.bridge or n.startswith(f"adh{self.serial}p")]


def _cap(run, device: str, mbit: float) -> None:
    """Caps what leaves `device` at `mbit` Mbit/s: an htb class every packet falls in."""
    rate = f"{mbit:g}mbit"
    run(["tc", "qdisc", "add", "dev", device, "root", "handle", "1:", "htb", "default", "10"])
    run(["tc", "class", "add", "dev", device, "parent", "1:", "classid", "1:10", "htb", "rate",
         rate, "ceil", rate])


def _end_processes(host: EmulatedHost, timeout_s: float) -> None:
    """Ends what runs inside the host: the processes `popen` started (their sessions), then
    any other process still in its namespace (the holder aside), by pid."""
    for process in host.processes:
        if process.poll() is None:
            _signal_group(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s / 2
    for process in host.processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            _signal_group(process.pid, signal.SIGKILL)
            process.wait(timeout=timeout_s / 2)
    try:
        namespace = host.namespace_id()
    except OSError:  # the holder ended: processes still inside are not found this way
        return
    holder = host.network.holder.pid
    for pid in _pids_in(namespace):
        if pid != holder:
            _signal(pid, signal.SIGKILL)


def _pids_in(namespace: str) -> list[int]:
    """Processes whose network namespace is `namespace`."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/net") == namespace:
                    pids.append(int(entry))
            except OSError:  # ended meanwhile
                pass
    return pids


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        pass


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def start(request: pytest.FixtureRequest, count: int,
          mbit: Mapping[int, float] | None = None) -> EmulatedHosts:
    """`EmulatedHosts.create` for a test: skips it where hosts cannot be made, and closes
    them when the test ends (a finalizer)."""
    try:
        hosts = EmulatedHosts.create(count, mbit)
    except HostsUnavailable as e:
        pytest.skip(f"no emulated hosts here: {e}")
    request.addfinalizer(hosts.close)
    return hosts


# ------------------------------------------------------------- a cluster on the hosts
def tf_config(cluster: Mapping[str, list[str]], kind: str, index: int) -> str:
    """TF_CONFIG naming task kind:index of `cluster`."""
    return json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})


def cluster_on(hosts: EmulatedHosts, tasks: Sequence[tuple[str, int]]) -> dict[str, list[str]]:
    """TF_CONFIG's cluster: worker:0 (the test process) at the bridge, task i of `tasks`
    on host i, each at a free port."""
    from autodist.launch.local import free_ports

    ports = free_ports(len(tasks) + 1)
    cluster: dict[str, list[str]] = {"worker": [f"{hosts.chief_address}:{ports[0]}"]}
    for (kind, _), host, port in zip(tasks, hosts.hosts, ports[1:]):
        cluster.setdefault(kind, []).append(f"{host.address}:{port}")
    return cluster


def serve(host: EmulatedHost, tmp_path: pathlib.Path, cluster: Mapping[str, list[str]],
          kind: str, index: int, max_jobs: int | None = 1, *extra: str
          ) -> tuple[subprocess.Popen, pathlib.Path]:
    """`autodist serve --tf-config [--max-jobs N]` for task kind:index on `host`, in its
    own empty directory (its job arrives over TensorFlow); (process, its log's path).

    Args:
        max_jobs: Jobs it serves before it ends; None: any number.
        extra: More `autodist serve` options.
    """
    home = tmp_path / f"{host.name}-{kind}{index}"
    home.mkdir()
    log_path = home / "serve.log"
    jobs = [] if max_jobs is None else ["--max-jobs", str(max_jobs)]
    with open(log_path, "wb") as log:
        process = host.popen(
            [sys.executable, "-m", "autodist.cli", "serve", "--tf-config", *jobs,
             "--job-timeout", "120", *extra, "--work-dir", str(home / "jobs")],
            cwd=home, env=dict(os.environ, TF_CONFIG=tf_config(cluster, kind, index)),
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return process, log_path


def late_slot_cluster(request: pytest.FixtureRequest, tmp_path: pathlib.Path
                      ) -> tuple[EmulatedHosts, dict[str, list[str]],
                                 tuple[subprocess.Popen, pathlib.Path]]:
    """Two hosts: worker:1 served on host0 from the start (one job), worker:2's slot on
    host1 declared but not served yet; (the hosts, the cluster, worker:1's serve)."""
    hosts = start(request, count=2)
    cluster = cluster_on(hosts, [("worker", 1), ("worker", 2)])
    return hosts, cluster, serve(hosts[0], tmp_path, cluster, "worker", 1)


def after_steps(job_dir: str | os.PathLike, steps: int, action: Callable[[], object],
                timeout_s: float = 120.0) -> threading.Thread:
    """Runs `action` (in a daemon thread) once the chief of the job in `job_dir` has
    recorded `steps` steps in its progress file; gives up after `timeout_s`."""
    def wait() -> None:
        progress = pathlib.Path(job_dir) / "progress.jsonl"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if progress.exists() and len(progress.read_text().splitlines()) >= steps:
                action()
                return
            time.sleep(0.01)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread
