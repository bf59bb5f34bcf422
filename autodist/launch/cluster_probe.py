"""Probing a served cluster: every task's devices and memory, and the links between tasks.

`probe_tf_config()` (or `probe_cluster(spec)`), run in the chief's process
while the cluster's tasks serve (`autodist serve --tf-config`, or plain
`tf.distribute.Server`s), returns a `ClusterProbe`: the ResourceSpec with
what was measured filled in, and how it was measured.

* Devices: a client session on each task's server lists the server's own
  devices (a device filter that matches no task leaves only the master's).
  A GPU's memory is TensorFlow's memory limit of that device. TensorFlow's
  number for a CPU device is a fixed placeholder (256 MiB), so a task's host
  memory is read on the task itself by a `ReadFile` op on its CPU:
  ``MemTotal`` of ``/proc/meminfo``, or its cgroup's limit when lower; tasks
  that share an address share it, as `ResourceSpec.local` shares one host.
* Links: a payload (`DEFAULT_PAYLOAD_BYTES`) made on one task and read on
  another, in a session on the reader's server (the path a training step's
  tensors take), timed `repeats` times; the median time of a tiny tensor's
  trip is the latency and is taken off the payload's median time. Every
  pair of tasks is measured, both ways, up to `MAX_PAIRED_TASKS` tasks, else
  the chief's links to each task. A node's bandwidth is the slower of its
  fastest sending and its fastest receiving link (a link is at most as fast
  as the slower of its two ends).

Every session names its tasks in device filters (a session without them
waits forever for an absent task, `docs/tf_elastic_notes.md` Q1) and every
run has a timeout; a task whose port does not accept connections within
`timeout_s` is named in a `ProbeError` before any session starts.

When this process is the chief (TF_CONFIG's task) and nothing serves at the
chief's address, as before `fit` starts the chief, this process stands in
for it: its devices are this host's (GPUs counted without starting CUDA;
their memory unknown) and its links are measured from this process
(``client`` links: the payload fetched into, or fed from, this process).
"""
from __future__ import annotations

import dataclasses
import datetime
import re
import statistics
import time
import warnings
from typing import Any, Callable, Mapping, Sequence

from autodist.ir.errors import AutodistError
from autodist.ir.resource_spec import ResourceSpec, host_memory_bytes, read_tf_config

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_PAYLOAD_BYTES = 4 << 20
DEFAULT_REPEATS = 5
# `planning_spec`'s probe: short, as it runs before every remote plan.
PLANNING_PAYLOAD_BYTES = 1 << 20
PLANNING_REPEATS = 3
# Above this many tasks only the chief's links are measured (pairs grow quadratically).
MAX_PAIRED_TASKS = 8
_POLL_S = 0.05
# A link whose payload timed no slower than the tiny tensor (noise on a loaded host) is
# timed again with this many times the rounds, once.
_RETIMED = 4
# A device filter that matches no task: the session lists only its master's own devices.
_NO_TASK_FILTER = "/job:autodist_probe_no_such_job/task:0"
_DEVICE = re.compile(r"^/job:([^/]+)/replica:\d+/task:(\d+)/device:([A-Z_]+):(\d+)$")
_MEMINFO_TOTAL = re.compile(rb"^MemTotal:\s+(\d+)\s*kB", re.MULTILINE)
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


class ProbeError(AutodistError, RuntimeError):
    """A task did not answer the probe in time, or answered as another task.

    Attributes:
        tasks: The tasks concerned, "job:index" as the ResourceSpec names them.
    """

    def __init__(self, message: str, tasks: Sequence[str]) -> None:
        super().__init__(message)
        self.tasks = tuple(tasks)


@dataclasses.dataclass(frozen=True)
class ProbedDevice:
    """A device a task's server has.

    Attributes:
        name: The device's name on its server, e.g. "/job:worker/replica:0/task:1/device:GPU:0".
        device_type: "CPU", "GPU", ...
        memory_bytes: TensorFlow's memory limit of a GPU; 0 for a CPU device
            (TensorFlow's number there is a placeholder).
    """

    name: str
    device_type: str
    memory_bytes: int


@dataclasses.dataclass(frozen=True)
class ProbedTask:
    """What the probe found on one task.

    Attributes:
        task: "job:index" as the ResourceSpec names it (the chief is worker:0).
        address: "host:port".
        server_task: "job:index" as the task's server names itself; "" when
            this process stood in for it.
        devices: Its devices.
        host_memory_bytes: Its host's memory; 0 when unknown.
        memory_source: Where `host_memory_bytes` was read.
    """

    task: str
    address: str
    server_task: str
    devices: tuple[ProbedDevice, ...]
    host_memory_bytes: int
    memory_source: str

    def count(self, device_type: str) -> int:
        """How many devices of `device_type` the task has."""
        return sum(1 for d in self.devices if d.device_type == device_type)


@dataclasses.dataclass(frozen=True)
class LinkMeasurement:
    """One link's latency and bandwidth.

    Attributes:
        reader: The task that received the payload ("job:index").
        sender: The task that made it.
        path: "server": read by `reader`'s server from `sender`'s, as a
            training step's tensors are; "client": between a task and this
            process, standing in for the chief (fetched or fed).
        latency_s: Median round trip of a tiny tensor, less the run's own cost.
        transfer_s: Median time of the payload, less the tiny tensor's.
        bandwidth_gbps: Payload bits / `transfer_s`, in Gbit/s; 0 when the
            payload took no longer than the tiny tensor (unknown).
    """

    reader: str
    sender: str
    path: str
    latency_s: float
    transfer_s: float
    bandwidth_gbps: float

    def joins(self, task: str) -> bool:
        """Whether `task` is one end of the link."""
        return task in (self.reader, self.sender)


@dataclasses.dataclass(frozen=True)
class ClusterProbe:
    """A probed cluster: the spec with measured devices, memory and bandwidth, and how.

    Attributes:
        spec: The ResourceSpec; its nodes' devices are those the servers have,
            ``gpu_memory``/``cpu_memory`` as measured (0 where unknown), and
            ``network_bandwidth`` the fastest measured link of each node.
        tasks: What each task reported, in the spec's node order.
        links: Every measured link.
        payload_bytes: The payload of a bandwidth measurement.
        repeats: Timed runs per measurement (medians taken).
        measured_at: When (UTC, ISO 8601).
        seconds: How long the probe took.
    """

    spec: ResourceSpec
    tasks: tuple[ProbedTask, ...]
    links: tuple[LinkMeasurement, ...]
    payload_bytes: int
    repeats: int
    measured_at: str
    seconds: float

    def describe(self) -> str:
        """The measured cluster and how it was measured, as text for people."""
        lines = [f"probed {len(self.tasks)} tasks at {self.measured_at} in {self.seconds:.1f}s: "
                 f"bandwidth from a {_size(self.payload_bytes)} payload, latency from a "
                 f"1-byte tensor, medians of {self.repeats} runs"]
        for i, task in enumerate(self.tasks):
            node = self.spec.nodes[i]
            named = f" (its server: {task.server_task})" if task.server_task not in (
                "", task.task) else ("" if task.server_task else " (stood in by this process)")
            gpus = f", {len(node.gpus)} GPU of {_size(node.gpu_memory_bytes)}" if node.gpus \
                else ""
            bandwidth = f"{node.network_bandwidth_gbps:.3g} Gbit/s" \
                if node.network_bandwidth_gbps else "bandwidth unknown"
            lines.append(f"  {task.task:<10} {task.address}{named}: {len(node.cpus)} CPU{gpus}, "
                         f"host memory {_size(node.cpu_memory_bytes)} "
                         f"({task.memory_source}), {bandwidth}")
        for link in self.links:
            speed = f"{link.bandwidth_gbps:.3g} Gbit/s" if link.bandwidth_gbps else \
                "bandwidth unknown (no slower than the tiny tensor)"
            lines.append(f"  link {link.sender} -> {link.reader} ({link.path}): latency "
                         f"{link.latency_s * 1e3:.3f} ms, {speed}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the spec as text, the tasks, the links and the settings."""
        return {"resource_spec": self.spec.to_text(),
                "tasks": [dataclasses.asdict(t) for t in self.tasks],
                "links": [dataclasses.asdict(link) for link in self.links],
                "payload_bytes": self.payload_bytes, "repeats": self.repeats,
                "measured_at": self.measured_at, "seconds": self.seconds}


# ------------------------------------------------------------------ entry points
def probe_tf_config(tf_config: str | Mapping[str, Any] | None = None, *,
                    timeout_s: float = DEFAULT_TIMEOUT_S,
                    payload_bytes: int = DEFAULT_PAYLOAD_BYTES, repeats: int = DEFAULT_REPEATS,
                    pairs: bool = True, stand_in_for_chief: bool | None = None,
                    log: Callable[[str], None] = lambda _: None) -> ClusterProbe:
    """Probes a TF_CONFIG cluster whose tasks serve (see the module's description).

    The tasks' servers may name their jobs as autodist does (the chief is
    worker task 0: `autodist serve --tf-config`) or as TF_CONFIG does
    (``chief``, ``worker``, ``ps``).

    Args:
        tf_config: The JSON string or parsed dict; None reads ``TF_CONFIG``.
        timeout_s: Bound on each task answering and on each run.
        payload_bytes: Bytes moved per bandwidth measurement.
        repeats: Timed runs per measurement, >= 1.
        pairs: Measure every pair of tasks (up to `MAX_PAIRED_TASKS` tasks),
            not only the chief's links.
        stand_in_for_chief: This process stands in for the chief (its host's
            devices; links from this process). None: when TF_CONFIG's task
            is the chief and nothing accepts connections at its address.
        log: Receives a line per stage.

    Returns:
        The probe; its `spec` is the measured ResourceSpec.

    Raises:
        ProbeError: A task did not answer within `timeout_s` (named with its address).
        ResourceSpecError: TF_CONFIG is missing or malformed.
    """
    from autodist.ir.addresses import accepts

    config = read_tf_config(tf_config)
    spec = ResourceSpec.from_tf_config(config, gpus_per_worker=0)
    names = _tf_config_task_names(config)
    if stand_in_for_chief is None:
        task = config.get("task") if isinstance(config, Mapping) else None
        own = f"{task.get('type')}:{task.get('index', 0)}" if isinstance(task, Mapping) else ""
        chief = spec.chief_index
        stand_in_for_chief = own == names[chief] and not accepts(_address(spec, chief))
    return probe_cluster(spec, timeout_s=timeout_s, payload_bytes=payload_bytes,
                         repeats=repeats, pairs=pairs, stand_in_for_chief=stand_in_for_chief,
                         other_names=names, log=log)


def planning_spec(tf_config: str | Mapping[str, Any] | None = None, *,
                  timeout_s: float = DEFAULT_TIMEOUT_S,
                  payload_bytes: int = PLANNING_PAYLOAD_BYTES, repeats: int = PLANNING_REPEATS,
                  log: Callable[[str], None] = lambda _: None) -> ResourceSpec:
    """The TF_CONFIG cluster to plan on: probed (its tasks' devices and memory, each
    node's links to the chief, a short payload), or, where a task does not answer
    within `timeout_s`, as TF_CONFIG declares it (bandwidth and memory unknown), with
    a warning naming the task.

    What `optimize(launch="remote")` and `autodist search --tf-config` plan on
    when given no spec; `log` receives the probe's description.

    Raises:
        ResourceSpecError: TF_CONFIG is missing or malformed.
    """
    try:
        probe = probe_tf_config(tf_config, timeout_s=timeout_s, payload_bytes=payload_bytes,
                                repeats=repeats, pairs=False)
    except ProbeError as e:
        warnings.warn(f"planning on TF_CONFIG's cluster as declared (bandwidth and memory "
                      f"unknown): probing it failed: {e}", RuntimeWarning, stacklevel=2)
        return ResourceSpec.from_tf_config(read_tf_config(tf_config))
    log(probe.describe())
    return probe.spec


def probe_cluster(spec: ResourceSpec, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                  payload_bytes: int = DEFAULT_PAYLOAD_BYTES, repeats: int = DEFAULT_REPEATS,
                  pairs: bool = True, stand_in_for_chief: bool = False,
                  other_names: Sequence[str] | None = None,
                  log: Callable[[str], None] = lambda _: None) -> ClusterProbe:
    """Probes a cluster whose tasks serve at the spec's addresses (every node needs its port).

    Args:
        spec: The cluster.
        other_names: Per node, another "job:index" its server may call
            itself (TF_CONFIG's naming); a server naming itself otherwise is
            at the wrong address, an error.
        timeout_s, payload_bytes, repeats, pairs, stand_in_for_chief, log:
            As for `probe_tf_config`.

    Raises:
        ProbeError: A task did not answer within `timeout_s`, or a server
            names itself as another task.
    """
    if repeats < 1 or payload_bytes < 1 or not timeout_s > 0:
        raise ProbeError(f"probe needs repeats >= 1, payload_bytes >= 1 and timeout_s > 0. "
                         f"Received: {repeats!r}, {payload_bytes!r}, {timeout_s!r}", ())
    start = time.monotonic()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    stand_in = spec.chief_index if stand_in_for_chief else None
    served = [i for i in range(len(spec.nodes)) if i != stand_in]
    _wait_for_ports(spec, served, timeout_s)
    prober = _Prober(spec, timeout_s, payload_bytes, repeats)
    tasks: list[ProbedTask] = []
    for i in range(len(spec.nodes)):
        log(f"listing the devices of {_name(spec, i)}")
        tasks.append(prober.stand_in(i) if i == stand_in else
                     prober.task(i, other_names[i] if other_names else None))
    links = []
    for reader, sender in _links_to_measure(spec, served, stand_in, pairs):
        log(f"measuring the link {_name(spec, sender)} -> {_name(spec, reader)}")
        links.append(prober.client_link(reader, sender, stand_in) if stand_in in (reader, sender)
                     else prober.server_link(reader, sender))
    return ClusterProbe(spec=measured_spec(spec, tasks, links), tasks=tuple(tasks),
                        links=tuple(links), payload_bytes=payload_bytes, repeats=repeats,
                        measured_at=stamp, seconds=time.monotonic() - start)


# ------------------------------------------------------------ what the probe makes
def measured_spec(spec: ResourceSpec, tasks: Sequence[ProbedTask],
                  links: Sequence[LinkMeasurement]) -> ResourceSpec:
    """`spec` with the probed devices, memory and bandwidths.

    A node whose GPU count differs from the spec's gets GPUs 0..n-1; a worker
    without GPUs gets a CPU replica per CPU device its server has. GPU memory
    is the smallest of the node's GPUs'; host memory is shared evenly by the
    tasks at one address (and the chief's with this, the driver's, process).
    A node's bandwidth is the slower of its fastest sending and its fastest
    receiving link (0, unknown, where either was not measured).
    """
    proto = spec.proto
    chief_address = spec.nodes[spec.chief_index].address
    for node, task in zip(proto.nodes, tasks):
        gpus = [d for d in task.devices if d.device_type == "GPU"]
        if len(gpus) != len(node.gpus):
            node.gpus[:] = range(len(gpus))
        if "worker" in node.roles and not gpus:
            node.cpus[:] = range(max(1, task.count("CPU")))
        node.gpu_memory_bytes = min((d.memory_bytes for d in gpus), default=0)
        sharing = sum(1 for n in spec.nodes if n.address == node.address) + \
            (node.address == chief_address)
        node.cpu_memory_bytes = task.host_memory_bytes // sharing
        sends = max((link.bandwidth_gbps for link in links if link.sender == task.task),
                    default=0.0)
        receives = max((link.bandwidth_gbps for link in links if link.reader == task.task),
                       default=0.0)
        node.network_bandwidth_gbps = min(sends, receives)
    return ResourceSpec(proto)


def host_memory_from_files(meminfo: bytes | None, cgroup_limits: Sequence[bytes | None]) -> int:
    """A host's memory from its ``/proc/meminfo`` and cgroup limit files (None: unreadable).

    ``MemTotal``, or the lowest cgroup limit below it ("max": no limit); 0
    when none is readable.
    """
    match = _MEMINFO_TOTAL.search(meminfo or b"")
    total = int(match.group(1)) * 1024 if match else 0
    for raw in cgroup_limits:
        try:
            limit = int((raw or b"").strip())
        except ValueError:
            continue
        if 0 < limit and (not total or limit < total):
            total = limit
    return total


def _links_to_measure(spec: ResourceSpec, served: Sequence[int], stand_in: int | None,
                      pairs: bool) -> list[tuple[int, int]]:
    """(reader, sender) node pairs, both ways: every pair, or the chief's links only."""
    chief = spec.chief_index
    every = [chief, *[i for i in served if i != chief]]
    if pairs and len(every) <= MAX_PAIRED_TASKS:
        ends = [(a, b) for k, a in enumerate(every) for b in every[k + 1:]]
    else:
        ends = [(chief, i) for i in every if i != chief]
    return [link for a, b in ends for link in ((a, b), (b, a))]


def _tf_config_task_names(config: Mapping[str, Any]) -> list[str]:
    """TF_CONFIG's "job:index" of each node, in the order `from_tf_config` makes them."""
    cluster = config["cluster"]
    return [f"{job}:{i}" for job in ("chief", "worker", "ps")
            for i in range(len(cluster.get(job) or []))]


def _wait_for_ports(spec: ResourceSpec, nodes: Sequence[int], timeout_s: float) -> None:
    from autodist.ir.addresses import accepts

    missing = [i for i in nodes if not spec.nodes[i].port]
    if missing:
        raise ProbeError(f"probing needs every task's port; none for "
                         f"{[_name(spec, i) for i in missing]}", [_name(spec, i) for i in missing])
    deadline = time.monotonic() + timeout_s
    waiting = list(nodes)
    while waiting:
        waiting = [i for i in waiting if not accepts(_address(spec, i))]
        if waiting and time.monotonic() > deadline:
            absent = [f"{_name(spec, i)} at {_address(spec, i)}" for i in waiting]
            raise ProbeError(f"tasks did not answer within {timeout_s:g}s (nothing accepts "
                             f"connections there; is the server started, e.g. `autodist serve "
                             f"--tf-config`, and is the address right?): {', '.join(absent)}",
                             [_name(spec, i) for i in waiting])
        if waiting:
            time.sleep(_POLL_S)


def _name(spec: ResourceSpec, node: int) -> str:
    job, index = spec.task_of(node)
    return f"{job}:{index}"


def _address(spec: ResourceSpec, node: int) -> str:
    return f"{spec.nodes[node].address}:{spec.nodes[node].port}"


def _size(n: int) -> str:
    if not n:
        return "unknown"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


# ------------------------------------------------------------------ measuring
class _Prober:
    """Sessions and timed runs against the tasks of one cluster."""

    def __init__(self, spec: ResourceSpec, timeout_s: float, payload_bytes: int,
                 repeats: int) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        self.payload_bytes = payload_bytes
        self.repeats = repeats
        self.server_task: dict[int, str] = {}

    def task(self, node: int, other_name: str | None) -> ProbedTask:
        """A served task's devices (named by its server) and host memory."""
        import tensorflow as tf

        graph = tf.Graph()
        session = self._session(node, [_NO_TASK_FILTER], graph, [node])
        listed = self._guard(session.list_devices, [node], "list its devices")
        devices, own = [], set()
        for d in listed:
            match = _DEVICE.match(d.name)
            if match is None:
                continue
            own.add(f"{match.group(1)}:{match.group(2)}")
            memory = int(d.memory_limit_bytes) if d.device_type == "GPU" else 0
            devices.append(ProbedDevice(d.name, d.device_type, memory))
        expected = {_name(self.spec, node), other_name} - {None}
        if len(own) != 1 or not own <= expected:
            raise ProbeError(f"the server at {_address(self.spec, node)} is "
                             f"{sorted(own) or 'no task'}, not {' or '.join(sorted(expected))}; "
                             "is the address right?", [_name(self.spec, node)])
        self.server_task[node] = own.pop()
        memory, source = self._host_memory(node, session, graph)
        session.close()
        return ProbedTask(_name(self.spec, node), _address(self.spec, node),
                          self.server_task[node], tuple(devices), memory, source)

    def stand_in(self, node: int) -> ProbedTask:
        """This process's host as the node: its GPUs counted, its memory."""
        from autodist.ir.gpus import visible_gpus

        devices = [ProbedDevice("CPU:0", "CPU", 0)] + [
            ProbedDevice(f"GPU:{g}", "GPU", 0) for g in range(len(visible_gpus()))]
        return ProbedTask(_name(self.spec, node), _address(self.spec, node), "",
                          tuple(devices), host_memory_bytes(),
                          "this process's host (GPU memory unknown)")

    def server_link(self, reader: int, sender: int) -> LinkMeasurement:
        """The payload made on `sender`, read on `reader`, in a session on `reader`'s server."""
        import numpy as np
        import tensorflow as tf

        graph = tf.Graph()
        with graph.as_default():
            with tf.device(self._cpu(sender)):
                payload = tf.constant(np.zeros(self.payload_bytes, np.uint8))
                tiny = tf.constant(np.zeros(1, np.uint8))
            with tf.device(self._cpu(reader)):
                # A slice needs the tensor's data (tf.size would need only its shape).
                fetches = (tf.constant(np.zeros(1, np.uint8))[-1], tiny[-1], payload[-1])
        filters = [f"/job:{t.replace(':', '/task:')}" for t in
                   (self.server_task[reader], self.server_task[sender])]
        session = self._session(reader, filters, graph, [reader, sender])
        local, small, large = self._timed(session, fetches, [reader, sender])
        if large <= small or small <= local:
            # The payload's transfer or the tiny tensor's round trip lost in the noise (a
            # loaded machine): time them longer, once.
            local, small, large = self._timed(session, fetches, [reader, sender],
                                              rounds=_RETIMED * self.repeats)
        session.close()
        return self._link(reader, sender, "server", small - local, large - small)

    def client_link(self, reader: int, sender: int, stand_in: int) -> LinkMeasurement:
        """The payload moved between this process (standing in for `stand_in`) and the other
        end: fetched from it, or fed to it."""
        import numpy as np
        import tensorflow as tf

        other = sender if reader == stand_in else reader
        graph = tf.Graph()
        feeds: tuple[Any, ...] = (None, None)
        with graph.as_default(), tf.device(self._cpu(other)):
            if reader == stand_in:
                fetches = (tf.constant(np.zeros(1, np.uint8)), tf.constant(
                    np.zeros(self.payload_bytes, np.uint8)))
            else:
                fed = tf.compat.v1.placeholder(tf.uint8, [None])
                fetches = (fed[-1], fed[-1])
                feeds = ({fed: np.zeros(1, np.uint8)},
                         {fed: np.zeros(self.payload_bytes, np.uint8)})
        session = self._session(other, [self._filter(other)], graph, [other])
        small, large = self._timed(session, fetches, [other], feeds)
        if large <= small:   # as in `server_link`
            small, large = self._timed(session, fetches, [other], feeds,
                                       _RETIMED * self.repeats)
        session.close()
        return self._link(reader, sender, "client", small, large - small)

    # -------------------------------------------------------------- helpers
    def _link(self, reader: int, sender: int, path: str, latency_s: float,
              transfer_s: float) -> LinkMeasurement:
        bandwidth = self.payload_bytes * 8 / transfer_s / 1e9 if transfer_s > 0 else 0.0
        return LinkMeasurement(_name(self.spec, reader), _name(self.spec, sender), path,
                               max(0.0, latency_s), max(0.0, transfer_s), bandwidth)

    def _timed(self, session, fetches: Sequence[Any], nodes: Sequence[int],
               feeds: Sequence[Any] | None = None,
               rounds: int | None = None) -> list[float]:
        """Median seconds of each fetch: one untimed run each, then `rounds` rounds
        (default `repeats`), the fetches in turn in each."""
        feeds = feeds or [None] * len(fetches)
        for fetch, feed in zip(fetches, feeds):
            self._run(session, fetch, nodes, feed)
        times: list[list[float]] = [[] for _ in fetches]
        for _ in range(rounds or self.repeats):
            for k, (fetch, feed) in enumerate(zip(fetches, feeds)):
                begin = time.perf_counter()
                self._run(session, fetch, nodes, feed)
                times[k].append(time.perf_counter() - begin)
        return [statistics.median(t) for t in times]

    def _host_memory(self, node: int, session, graph) -> tuple[int, str]:
        import tensorflow as tf

        contents: list[bytes | None] = []
        for path in ("/proc/meminfo", *_CGROUP_LIMITS):
            with graph.as_default(), tf.device(self._cpu(node)):
                read = tf.io.read_file(path)
            try:
                contents.append(self._run(session, read, [node]))
            except tf.errors.OpError:   # absent on this host: not an error of the probe
                contents.append(None)
        memory = host_memory_from_files(contents[0], contents[1:])
        return memory, ("/proc/meminfo and the cgroup limit on the task" if memory
                        else "unknown: the task's /proc/meminfo is unreadable")

    def _cpu(self, node: int) -> str:
        return f"{self._filter(node)}/device:CPU:0"

    def _filter(self, node: int) -> str:
        job, _, index = self.server_task[node].partition(":")
        return f"/job:{job}/task:{index}"

    def _session(self, node: int, filters: list[str], graph, nodes: Sequence[int]):
        import tensorflow as tf

        timeout_ms = max(1, int(self.timeout_s * 1000))
        config = tf.compat.v1.ConfigProto(device_filters=filters,
                                          operation_timeout_in_ms=timeout_ms)
        # Constant folding would compute the probe's results once and move nothing per run.
        config.graph_options.rewrite_options.disable_meta_optimizer = True
        config.graph_options.optimizer_options.opt_level = tf.compat.v1.OptimizerOptions.L0
        return self._guard(lambda: tf.compat.v1.Session(
            f"grpc://{_address(self.spec, node)}", graph=graph, config=config), nodes,
            "open a session")

    def _run(self, session, fetch, nodes: Sequence[int], feed: Any = None):
        import tensorflow as tf

        options = tf.compat.v1.RunOptions(timeout_in_ms=max(1, int(self.timeout_s * 1000)))
        return self._guard(lambda: session.run(fetch, feed_dict=feed, options=options), nodes,
                           "run")

    def _guard(self, call: Callable[[], Any], nodes: Sequence[int], what: str) -> Any:
        import tensorflow as tf

        try:
            return call()
        except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
                tf.errors.CancelledError, tf.errors.AbortedError) as e:
            names = [_name(self.spec, i) for i in nodes]
            where = ", ".join(f"{n} at {_address(self.spec, i)}" for n, i in zip(names, nodes))
            raise ProbeError(f"probing {where}: could not {what} within {self.timeout_s:g}s: "
                             f"{type(e).__name__}: {e.message.strip()[:300]}", names) from e
