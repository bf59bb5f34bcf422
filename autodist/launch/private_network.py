"""A private network namespace for a local cluster, so no other host can reach its tasks.

TensorFlow servers bind every interface and authenticate nobody: whoever
reaches a task's port can run any TensorFlow op in that task, reading and
writing files as its user. A local cluster needs only loopback (the driver
talks to its tasks through the job directory, never through their ports),
so its tasks run together in one network namespace that has nothing but
loopback, where they reach each other and nobody else reaches them.

* Already private (this process's namespace has no interface up but
  loopback, e.g. inside ``unshare -n``): nothing to do.
* Else `PrivateNetwork.create` makes one: a holder process started by
  ``unshare --net`` (root) or ``unshare --net --map-root-user`` (an
  unprivileged user namespace) brings loopback up and lives until the
  cluster stops; every task starts inside it through ``nsenter``.
* If neither works, `local_network` refuses with `ExposedNetworkError`,
  unless the user opted in (``allow_exposed=True`` or
  ``AUTODIST_ALLOW_EXPOSED=1``): then the tasks run in this namespace, with
  a warning that names their ports.
"""
from __future__ import annotations

import logging
import os
import pathlib
import select
import shutil
import subprocess
import sys
import time
from typing import Sequence

from autodist.ir.errors import AutodistError
from autodist.launch import netns_holder

ALLOW_EXPOSED_ENV = "AUTODIST_ALLOW_EXPOSED"
_READY = b"ready\n"
_REASON_CHARS = 300

logger = logging.getLogger(__name__)


class ExposedNetworkError(AutodistError, PermissionError):
    """A local cluster would be reachable from other hosts, and the user did not allow it."""


class NamespaceUnavailable(AutodistError, OSError):
    """No private network namespace can be made here (the message says why)."""


def is_private() -> bool:
    """Whether this process's network namespace has no interface up but loopback."""
    return not netns_holder.exposed_interfaces()


def exposure_allowed(allow_exposed: bool = False) -> bool:
    """Whether the user opted in to exposed local clusters (argument or environment)."""
    return allow_exposed or os.environ.get(ALLOW_EXPOSED_ENV) == "1"


class PrivateNetwork:
    """A network namespace with only loopback, held by a process, for one local cluster.

    Use `create`, start each task with `command(argv)`, and `close` it after
    the tasks have stopped:

        network = PrivateNetwork.create()
        process = subprocess.Popen(network.command([sys.executable, "-m", ...]))
        ...
        network.close()

    The holder ends when `close` closes its standard input, or when this
    process dies (the pipe closes with it); the namespace goes when its last
    process does.

    Attributes:
        holder: The holder process (its pid names the namespace).
        user_namespace: Whether the namespace belongs to a user namespace of
            its own (made without root), which tasks enter too.
    """

    def __init__(self, holder: subprocess.Popen, user_namespace: bool) -> None:
        self.holder = holder
        self.user_namespace = user_namespace

    @classmethod
    def create(cls, timeout_s: float = 10.0) -> PrivateNetwork:
        """Makes a namespace: with ``unshare --net`` as root, else in a user namespace.

        Raises:
            NamespaceUnavailable: saying why for each way tried (no
                ``unshare`` or ``nsenter``, not permitted, ...).
        """
        missing = [tool for tool in ("unshare", "nsenter") if shutil.which(tool) is None]
        if missing:
            raise NamespaceUnavailable(f"{' and '.join(missing)} not found (util-linux)")
        ways = [["unshare", "--net"]] if os.geteuid() == 0 else []
        ways.append(["unshare", "--net", "--map-root-user"])
        reasons = []
        for way in ways:
            holder = subprocess.Popen(
                [*way, sys.executable, "-I", "-S", str(pathlib.Path(netns_holder.__file__))],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True)
            if _read_ready(holder, timeout_s):
                return cls(holder, user_namespace="--map-root-user" in way)
            reasons.append(f"`{' '.join(way)}`: {_stop(holder)}")
        raise NamespaceUnavailable("; ".join(reasons))

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` as a command that runs inside this namespace."""
        ns = f"/proc/{self.holder.pid}/ns"
        enter = ["nsenter", f"--net={ns}/net"]
        if self.user_namespace:
            enter += [f"--user={ns}/user", "--preserve-credentials"]
        return [*enter, "--", *argv]

    def close(self, timeout_s: float = 5.0) -> None:
        """Ends the holder (bounded wait, then kill)."""
        _stop(self.holder, timeout_s)


def local_network(tasks: Sequence[tuple[str, int]], allow_exposed: bool = False
                  ) -> PrivateNetwork | None:
    """The network a local cluster's tasks run in: a new private namespace, or this one.

    Args:
        tasks: (task name, port) of every task, for the warning and the error.
        allow_exposed: Run in this namespace, reachable from other hosts,
            when no private one can be made (also `AUTODIST_ALLOW_EXPOSED=1`).

    Returns:
        A `PrivateNetwork` to start the tasks in, or None: this namespace is
        already private, or no private one can be made and exposure is allowed
        (a warning naming every task's port is logged and printed).

    Raises:
        ExposedNetworkError: no private namespace can be made and exposure
            is not allowed; the message says why and how to opt in.
    """
    if is_private():
        return None
    try:
        return PrivateNetwork.create()
    except NamespaceUnavailable as e:
        reason = str(e)
    exposed = netns_holder.exposed_interfaces()
    ports = ", ".join(f"{name} on port {port}" for name, port in tasks)
    if exposure_allowed(allow_exposed):
        message = (f"autodist: WARNING: this local cluster's TensorFlow servers are reachable "
                   f"from other hosts through interfaces {exposed}: {ports}. Anyone who "
                   "reaches these ports can read and write files as this user. (No private "
                   f"network namespace could be made: {reason})")
        logger.warning(message)
        print(message, file=sys.stderr, flush=True)
        return None
    raise ExposedNetworkError(
        f"a local cluster's TensorFlow servers bind every interface and let anyone who "
        f"reaches them read and write files as this user, so autodist runs them in a "
        f"private network namespace; none could be made here ({reason}). This machine's "
        f"interfaces {exposed} are up. Run inside one (as root: `unshare -n bash -c 'ip "
        "link set lo up && ...'`), allow unprivileged user namespaces, or, on a trusted "
        f"network only, opt in with allow_exposed=True or {ALLOW_EXPOSED_ENV}=1 (tasks "
        f"would listen on: {ports})")


def _read_ready(holder: subprocess.Popen, timeout_s: float) -> bool:
    """Whether the holder says it is ready within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    received = b""
    fd = holder.stdout.fileno()
    while len(received) < len(_READY):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            return False
        chunk = os.read(fd, len(_READY) - len(received))
        if not chunk:
            return False
        received += chunk
    return received == _READY


def _stop(holder: subprocess.Popen, timeout_s: float = 5.0) -> str:
    """Ends a holder (closing its stdin, then killing it); the tail of its stderr."""
    try:
        holder.stdin.close()
    except OSError:
        pass
    try:
        holder.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        holder.kill()
        holder.wait(timeout=timeout_s)
    error = holder.stderr.read() if holder.returncode else b""
    holder.stdout.close()
    holder.stderr.close()
    text = error.decode(errors="replace").strip() or f"exit code {holder.returncode}"
    return text[-_REASON_CHARS:]
