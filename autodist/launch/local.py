"""Local launcher: a cluster of real task processes on this machine.

Ports are chosen free (a task that finds its port taken exits with a known
code and the cluster is restarted on new ports, a bounded number of times);
every wait is bounded; every process started is stopped on exit, error or
Ctrl-C; each task keeps its log in the job directory. The tasks of a whole
local cluster run in a private network namespace (`autodist.launch.private_network`):
other hosts cannot reach their ports.
Each task's
environment gives it only its node's GPUs, with memory growth
(`autodist.launch.devices`).
"""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, Sequence

from autodist.ir.errors import AutodistError
from autodist.ir.resource_spec import ResourceSpec
from autodist.launch import heartbeats, private_network
from autodist.launch.devices import task_environments
from autodist.launch.errors import EXIT_PORT_IN_USE, TaskFailedError
from autodist.launch.job import JobDir
from autodist.launch.private_files import DIR_MODE, open_private_append

_LOG_TAIL_LINES = 30
# How long a peer error waits for the task that caused it (see _raise_if_failed).
_ROOT_CAUSE_GRACE_S = 0.5


def free_ports(count: int) -> list[int]:
    """`count` distinct ports that were free a moment ago (loopback)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclasses.dataclass
class _Task:
    job: str
    index: int
    process: subprocess.Popen
    log_path: str

    @property
    def name(self) -> str:
        return f"{self.job}:{self.index}"


class LocalCluster:
    """Starts one process per node of a local ResourceSpec.

    Use as a context manager so the processes are always stopped:

        with LocalCluster(job, spec, task_module="autodist.runtime.entry") as cluster:
            cluster.wait_ready(timeout_s=60)
            cluster.wait_workers(timeout_s=600)

    Args:
        job: The job directory the tasks read.
        spec: The cluster.
        task_module: The module each task process runs (``python -m
            MODULE``): a command line of `autodist.launch.task` that gives
            it the work of a worker (`autodist.runtime.entry`).
        nodes: Indices of the nodes to start here (default: every node, which
            must then all be local, and which run in a private network
            namespace). A multi-host run starts only its chief, in this
            process's namespace (it must reach the other hosts).
        port_retries: Restarts on new ports when a task finds its port taken
            (only ports the spec leaves open are chosen anew).
        allow_exposed: When no private network namespace can be made, run
            the tasks in this one (reachable from other hosts, with a
            warning naming their ports) instead of raising
            `private_network.ExposedNetworkError`. Also `AUTODIST_ALLOW_EXPOSED=1`.
        hang_timeout_s: A running task whose heartbeat is older than this is
            hung (stopped or stuck): `wait_workers` kills it and raises
            naming it (`autodist.launch.heartbeats`). None: not watched.
    """

    def __init__(self, job: JobDir, spec: ResourceSpec, *, task_module: str,
                 nodes: Sequence[int] | None = None, port_retries: int = 3,
                 allow_exposed: bool = False, hang_timeout_s: float | None = None) -> None:
        if nodes is None:
            check_local(spec)
        self.job = job
        self.task_module = task_module
        self.spec = spec
        self.private = nodes is None
        self.nodes = list(range(len(spec.nodes))) if nodes is None else list(nodes)
        self.port_retries = port_retries
        self.allow_exposed = allow_exposed
        self.hang_timeout_s = hang_timeout_s
        self.tasks: list[_Task] = []
        self.network: private_network.PrivateNetwork | None = None

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Starts the tasks (in a new private network namespace, for a whole cluster).

        Raises:
            private_network.ExposedNetworkError: no private namespace can be made and
                exposure is not allowed (nothing was started).
        """
        ports = [n.port or p for n, p in zip(self.spec.nodes, free_ports(len(self.spec.nodes)))]
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
                   PYTHONUNBUFFERED="1")
        devices = task_environments(self.spec, self.nodes, env)  # raises before any start
        if self.private:
            tasks = [(":".join(map(str, self.spec.task_of(i))), ports[i]) for i in self.nodes]
            self.network = private_network.local_network(tasks, self.allow_exposed)
        self.job.write_ports(ports)
        for flag in (self.job.path / "ready").glob("*"):
            flag.unlink()
        for i in self.nodes:
            job, index = self.spec.task_of(i)
            log_path = self.job.log(job, index)
            log_path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
            command = [sys.executable, "-m", self.task_module, "--job-dir", str(self.job.path),
                       "--job", job, "--task", str(index), "--parent-pid", str(os.getpid())]
            if self.network is not None:
                command = self.network.command(command)
            with open_private_append(log_path) as log:
                process = subprocess.Popen(
                    command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=dict(env, **devices[i]), start_new_session=True)
            self.tasks.append(_Task(job, index, process, str(log_path)))

    def wait_ready(self, timeout_s: float) -> None:
        """Waits until every task's server is up; restarts on a taken port."""
        for attempt in range(self.port_retries + 1):
            deadline = time.monotonic() + timeout_s
            while True:
                busy = [t for t in self.tasks if t.process.poll() == EXIT_PORT_IN_USE]
                if busy:
                    break
                self._raise_if_failed()
                if all(self.job.ready_flag(t.job, t.index).exists() for t in self.tasks):
                    return
                if time.monotonic() > deadline:
                    slow = [t for t in self.tasks
                            if not self.job.ready_flag(t.job, t.index).exists()]
                    raise TaskFailedError(
                        f"task {slow[0].name} did not start within {timeout_s:.0f}s; "
                        f"log {slow[0].log_path}:\n{_tail(slow[0].log_path)}",
                        slow[0].name, slow[0].log_path)
                time.sleep(0.05)
            self.stop()
            if attempt == self.port_retries:
                raise TaskFailedError(f"task {busy[0].name} found its port taken "
                                      f"{self.port_retries + 1} times", busy[0].name,
                                      busy[0].log_path)
            self.start()

    def wait_workers(self, timeout_s: float,
                     on_poll: Callable[[], None] | None = None) -> None:
        """Waits until every worker exits 0; raises naming the first task that failed.

        A parameter server that exits, or a worker exiting non-zero, is a
        failure; so is a task that stops sending heartbeats (it is killed
        first), and not finishing within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            self._raise_if_failed()
            self._raise_if_hung()
            workers = [t for t in self.tasks if t.job == "worker"]
            if all(t.process.poll() == 0 for t in workers):
                return
            if on_poll is not None:
                on_poll()
            if time.monotonic() > deadline:
                running = [t.name for t in workers if t.process.poll() is None]
                raise TaskFailedError(f"workers {running} did not finish within {timeout_s:.0f}s",
                                      running[0], self.job.log("worker", 0).as_posix())
            time.sleep(0.1)

    def wait_exit(self, job: str, index: int, timeout_s: float) -> int | None:
        """Waits until task job:index exits (up to `timeout_s`); its exit code, or None."""
        for t in self.tasks:
            if (t.job, t.index) == (job, index):
                try:
                    return t.process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    return None
        return None

    def _raise_if_failed(self) -> None:
        """Raises naming the failed task, preferring the root cause.

        A task killed by a signal makes its peers fail moments later with
        connection errors; when only such errors are seen, a short grace lets
        a killed task show up, and a killed task is named before the others.
        """
        failed = self._failed_tasks()
        if not failed:
            return
        if not any(code < 0 for _, code in failed):
            time.sleep(_ROOT_CAUSE_GRACE_S)
            failed = self._failed_tasks()
        t, code = min(failed, key=lambda item: item[1] >= 0)  # stable: task order
        raise TaskFailedError(f"task {t.name} exited with code {code}; log {t.log_path}:\n"
                              f"{_tail(t.log_path)}", t.name, t.log_path)

    def _raise_if_hung(self) -> None:
        """Kills and names a running task whose heartbeat is older than the hang timeout.

        Killed, so that its peers fail at once (their connections to it
        break) and a recovering run goes on without it, as without a dead task.
        """
        if self.hang_timeout_s is None:
            return
        for t in self.tasks:
            silence = heartbeats.silence_s(self.job.heartbeat(t.job, t.index))
            if silence is None or silence <= self.hang_timeout_s or t.process.poll() is not None:
                continue
            _kill_group(t.process)
            raise TaskFailedError(
                f"task {t.name} stopped responding: no heartbeat for {silence:.0f}s (more than "
                f"{self.hang_timeout_s:g}s; the process was stopped or hung), so it was killed; "
                f"log {t.log_path}:\n{_tail(t.log_path)}", t.name, t.log_path)

    def _failed_tasks(self) -> list[tuple[_Task, int]]:
        failed = []
        for t in self.tasks:
            code = t.process.poll()
            if code is None or code == EXIT_PORT_IN_USE:
                continue
            if code != 0 or t.job == "ps":
                failed.append((t, code))
        return failed

    def stop(self, grace_s: float = 5.0) -> None:
        """Terminates every task (then kills what is left after `grace_s`), then the
        private network namespace."""
        try:
            for t in self.tasks:
                if t.process.poll() is None:
                    t.process.terminate()
            deadline = time.monotonic() + grace_s
            for t in self.tasks:
                remaining = max(0.0, deadline - time.monotonic())
                try:
                    t.process.wait(timeout=remaining)
                except subprocess.TimeoutExpired:
                    t.process.kill()
                    t.process.wait(timeout=grace_s)
            self.tasks = []
        finally:
            if self.network is not None:
                self.network.close(grace_s)
                self.network = None


def check_local(spec: ResourceSpec) -> None:
    """Raises unless every node of `spec` is on this machine."""
    for i, node in enumerate(spec.nodes):
        if not is_loopback(node.address):
            raise AutodistError(
                f"LocalCluster runs tasks on this machine only; node {i} has address "
                f"{node.address!r} (for a multi-host cluster use launch='remote' and "
                "`autodist serve` on the other hosts)")


def is_loopback(address: str) -> bool:
    """Whether a node address means this machine."""
    return address in ("localhost", "::1", "[::1]") or address.startswith("127.")


def _tail(path: str, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


def _kill_group(process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGKILLs a task's process group (it was started in a session of its own), also
    when it is stopped; waits for it, bounded."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        process.kill()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
