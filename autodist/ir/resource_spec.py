"""ResourceSpec: the cluster a strategy runs on.

Every node of the spec is one TensorFlow task. A node with the ``worker`` role
belongs to the job ``worker`` and runs one compute replica per GPU, or, with
no GPU, one per CPU device it lists: ``cpus: [0, 1]`` is two replicas, on the
logical CPU devices 0 and 1 that its task process creates (in-graph
replication, as on a node with two GPUs). A node that only has the ``ps``
role belongs to the job ``ps``. Parameter-server variables live on the first
CPU of the nodes that have the ``ps`` role.

A node's ``gpus`` are positions among the GPUs its host shows (see
`autodist.ir.gpus`); its task process is given only those, so they are its
``GPU:0`` .. ``GPU:n-1`` and are named so. Device names are TensorFlow's,
e.g. ``/job:worker/task:1/device:GPU:0``.

Memory is described per node: ``gpu_memory`` (each GPU's) and
``cpu_memory`` (the host memory the node's task may use, shared by its CPU
devices). Zero means unknown, and the search does not constrain it.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any, Collection, Iterable, Mapping

from google.protobuf import text_format
from google.protobuf.message import DecodeError

from autodist.ir.errors import ResourceSpecError, short_repr, shorten
from autodist.ir.fingerprint import fingerprint
from autodist.ir.resource_spec_checks import check_nodes
# The limits and readers are re-exported: they were defined here before.
from autodist.ir.resource_spec_parsing import (  # noqa: F401
    DEFAULT_BANDWIDTH_GBPS, MAX_ADDRESS_CHARS, MAX_DEVICES, MAX_DEVICES_PER_NODE, MAX_NODES,
    MAX_YAML_BYTES, MAX_YAML_DEPTH, MAX_YAML_NODES, VALID_ROLES, checked_count, nodes_from_dict,
    parse_size, read_tf_config, read_yaml_file, tf_config_nodes)
from autodist.proto import resource_spec_pb2

RESOURCE_SPEC_SCHEMA_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Device:
    """One device of the cluster.

    Attributes:
        name: TensorFlow device name, e.g. "/job:worker/task:0/device:CPU:0".
        node_index: Index of the node in ResourceSpec.nodes.
        device_type: "CPU" or "GPU".
        index: The device index on its node.
    """

    name: str
    node_index: int
    device_type: str
    index: int


@dataclasses.dataclass(frozen=True)
class TaskDevices:
    """The devices a node's task process must have, set up before its server starts.

    Attributes:
        cpus: Logical CPU devices to create (CPU:0 .. CPU:cpus-1).
        gpus: The host's GPUs to give it (positions among those the host
            shows, see `autodist.ir.gpus`); inside the task they are GPU:0 ..
    """

    cpus: int
    gpus: tuple[int, ...]



class ResourceSpec:
    """The nodes, devices, roles and bandwidths of a cluster.

    Build one with `ResourceSpec.local`, `ResourceSpec.from_yaml`,
    `ResourceSpec.from_tf_config` or `ResourceSpec.from_dict`; every
    constructor validates and raises `ResourceSpecError` naming the field and
    the value received.

    Example:
        >>> spec = ResourceSpec.local(workers=2, ps=1)
        >>> spec.replica_devices
        ['/job:worker/task:0/device:CPU:0', '/job:worker/task:1/device:CPU:0']
        >>> spec.ps_devices
        ['/job:ps/task:0/device:CPU:0']
    """

    def __init__(self, proto: resource_spec_pb2.ResourceSpec) -> None:
        self._proto = resource_spec_pb2.ResourceSpec()
        self._proto.CopyFrom(proto)
        if not self._proto.schema_version:
            self._proto.schema_version = RESOURCE_SPEC_SCHEMA_VERSION
        check_nodes(self._proto.nodes)
        self._tasks = self._assign_tasks()
        self._node_by_device: dict[str, int] | None = None

    # ----------------------------------------------------------- constructors
    @classmethod
    def local(cls, workers: int = 2, ps: int = 0,
              bandwidth_gbps: float | None = None,
              address: str = "localhost", *, cpu_replicas_per_worker: int = 1,
              gpus_per_worker: int = 0,
              cpu_memory: int | str | None = None) -> ResourceSpec:
        """A cluster of local processes on one host, ports chosen at launch.

        Example:
            >>> spec = ResourceSpec.local(workers=2, cpu_replicas_per_worker=2)
            >>> spec.replica_devices[:2]
            ['/job:worker/task:0/device:CPU:0', '/job:worker/task:0/device:CPU:1']

        Args:
            workers: Number of worker tasks, >= 1.
            ps: Number of parameter-server-only tasks. With 0, the workers'
                CPUs hold parameter-server variables.
            bandwidth_gbps: Bandwidth per task in Gbit/s; None = unknown.
            address: Host of every task.
            cpu_replicas_per_worker: Replicas per worker task on logical CPU
                devices (the task splits its CPU into that many), >= 1.
            gpus_per_worker: GPUs per worker task, one replica each; worker i
                gets the host's GPUs i*M .. i*M+M-1 (M = gpus_per_worker).
            cpu_memory: Host memory of each task, in bytes or as a size such
                as "2GB"; 0 = unknown (unconstrained). None detects it: this
                host's memory (`host_memory_bytes`) split evenly between the
                tasks and the driver process, which share the host.

        Returns:
            The spec; worker 0 is the chief.
        """
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ResourceSpecError(
                f"ResourceSpec.local: workers must be an integer >= 1. Received: {workers!r}")
        if not isinstance(ps, int) or isinstance(ps, bool) or ps < 0:
            raise ResourceSpecError(
                f"ResourceSpec.local: ps must be an integer >= 0. Received: {ps!r}")
        cpu_replicas = checked_count(cpu_replicas_per_worker, 1,
                              "ResourceSpec.local: cpu_replicas_per_worker", MAX_DEVICES_PER_NODE)
        gpus = checked_count(gpus_per_worker, 0, "ResourceSpec.local: gpus_per_worker",
                      MAX_DEVICES_PER_NODE)
        if gpus and cpu_replicas > 1:
            raise ResourceSpecError(
                "ResourceSpec.local: a worker runs its replicas on its GPUs or on its CPU "
                f"devices, not both. Received: gpus_per_worker={gpus}, "
                f"cpu_replicas_per_worker={cpu_replicas}")
        if cpu_memory is None:
            memory = host_memory_bytes() // (workers + ps + 1)
        else:
            memory = parse_size(cpu_memory, "ResourceSpec.local: cpu_memory")
        worker_roles = ["worker"] if ps else ["worker", "ps"]
        nodes = []
        for i in range(workers):
            nodes.append({"address": address, "chief": i == 0,
                          "cpus": list(range(cpu_replicas)),
                          "gpus": list(range(i * gpus, (i + 1) * gpus)),
                          "roles": worker_roles, "network_bandwidth": bandwidth_gbps,
                          "cpu_memory": memory})
        for _ in range(ps):
            nodes.append({"address": address, "cpus": [0], "roles": ["ps"],
                          "network_bandwidth": bandwidth_gbps, "cpu_memory": memory})
        return cls.from_dict({"nodes": nodes}, source="ResourceSpec.local")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> ResourceSpec:
        """Reads the AutoDist-style YAML format.

        The file holds a list of nodes, each with ``address`` (host or
        ``host:port``), optional ``port``, ``cpus`` (logical CPU device
        indices, default [0]; a worker without GPUs runs a replica on each),
        ``gpus`` (the host's GPUs, one replica each), ``chief`` (exactly one
        node), ``network_bandwidth`` (Gbit/s) and ``roles`` (default both
        ``worker`` and ``ps``). A count stands for indices from 0: ``cpus:
        2`` is ``[0, 1]``. ``gpu_memory`` (each GPU's memory) and
        ``cpu_memory`` (the task's host memory) are optional, as bytes or
        sizes such as ``80GB``, ``16GiB`` or ``512Mi``; left out, memory is
        unknown and the search does not constrain it::

            nodes:
              - address: 10.0.0.1
                gpus: [0, 1]
                chief: true
                network_bandwidth: 25
                gpu_memory: 16GB
                cpu_memory: 64GB
              - address: 10.0.0.2
                gpus: [0, 1]
                network_bandwidth: 25
                gpu_memory: 16GB
                cpu_memory: 64GB

        Aliases are allowed, within bounds: a file over MAX_YAML_BYTES, nested
        deeper than MAX_YAML_DEPTH, or whose aliases expand to more than
        MAX_YAML_NODES nodes is refused before anything is built from it.

        Args:
            path: Path of the YAML file.

        Returns:
            The validated spec.
        """
        return cls.from_dict(read_yaml_file(path), source=str(path))

    @classmethod
    def from_tf_config(cls, tf_config: str | Mapping[str, Any] | None = None, *,
                       gpus_per_worker: int | None = None,
                       cpu_replicas_per_worker: int = 1,
                       bandwidth_gbps: float | None = None) -> ResourceSpec:
        """Reads a TF_CONFIG (the convention of Kubernetes TF operators).

        ``chief`` and ``worker`` tasks become worker nodes (the chief, or else
        worker 0, is the chief); ``ps`` tasks become parameter-server nodes.
        Every worker node gets the same devices: each pod runs one task.

        Args:
            tf_config: The JSON string or parsed dict; None reads the
                ``TF_CONFIG`` environment variable.
            gpus_per_worker: GPUs of each worker node; None counts the GPUs
                this host shows (`autodist.ir.gpus.visible_gpus`: its
                ``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi -L``; no CUDA is
                started), taking every pod to be alike.
            cpu_replicas_per_worker: Replicas per worker node on logical CPU
                devices (used only without GPUs), >= 1.
            bandwidth_gbps: Bandwidth per node in Gbit/s; None = unknown.

        Returns:
            The validated spec.
        """
        nodes = tf_config_nodes(tf_config, gpus_per_worker, cpu_replicas_per_worker,
                                bandwidth_gbps)
        return cls.from_dict({"nodes": nodes}, source="TF_CONFIG")

    @classmethod
    def from_dict(cls, data: Any, source: str = "resource spec") -> ResourceSpec:
        """Builds a spec from the parsed YAML structure ({"nodes": [...]})."""
        return cls(resource_spec_pb2.ResourceSpec(
            schema_version=RESOURCE_SPEC_SCHEMA_VERSION, nodes=nodes_from_dict(data, source)))

    # ------------------------------------------------------------ properties
    @property
    def proto(self) -> resource_spec_pb2.ResourceSpec:
        """A copy of the underlying protobuf."""
        copy = resource_spec_pb2.ResourceSpec()
        copy.CopyFrom(self._proto)
        return copy

    @property
    def nodes(self) -> list[resource_spec_pb2.Node]:
        return list(self._proto.nodes)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self._proto)

    def task_of(self, node_index: int) -> tuple[str, int]:
        """Returns (job, task index) of a node."""
        return self._tasks[node_index]

    def node_of_task(self, job: str, task: int) -> int:
        """Index of the node that is task `job`:`task`.

        Raises:
            ResourceSpecError: No node is that task.
        """
        try:
            return self._tasks.index((job, task))
        except ValueError:
            raise ResourceSpecError(
                f"no node is task {job}:{task}; tasks: "
                f"{[f'{j}:{t}' for j, t in self._tasks]}") from None

    def task_devices(self, node_index: int) -> TaskDevices:
        """The devices node `node_index`'s task process must set up."""
        node = self._proto.nodes[node_index]
        return TaskDevices(cpus=max(node.cpus) + 1, gpus=tuple(node.gpus))

    @property
    def num_worker_tasks(self) -> int:
        """Number of tasks in the TensorFlow job "worker"."""
        return sum(1 for job, _ in self._tasks if job == "worker")

    @property
    def chief_index(self) -> int:
        return next(i for i, n in enumerate(self._proto.nodes) if n.chief)

    @property
    def devices(self) -> list[Device]:
        """Every device of the cluster, node by node."""
        out = []
        for i, node in enumerate(self._proto.nodes):
            job, task = self._tasks[i]
            for c in node.cpus:
                out.append(Device(f"/job:{job}/task:{task}/device:CPU:{c}", i, "CPU", c))
            for g in range(len(node.gpus)):  # the task sees its GPUs as 0..n-1
                out.append(Device(f"/job:{job}/task:{task}/device:GPU:{g}", i, "GPU", g))
        return out

    @property
    def device_names(self) -> list[str]:
        return [d.name for d in self.devices]

    @property
    def replica_devices(self) -> list[str]:
        """Compute devices: the GPUs of worker nodes, or their CPUs without GPUs."""
        out = []
        for i, node in enumerate(self._proto.nodes):
            if "worker" not in node.roles:
                continue
            job, task = self._tasks[i]
            if node.gpus:
                out += [f"/job:{job}/task:{task}/device:GPU:{g}" for g in range(len(node.gpus))]
            else:
                out += [f"/job:{job}/task:{task}/device:CPU:{c}" for c in node.cpus]
        return out

    @property
    def ps_devices(self) -> list[str]:
        """Devices that may hold parameter-server variables (first CPU of ps nodes)."""
        out = []
        for i, node in enumerate(self._proto.nodes):
            if "ps" in node.roles:
                job, task = self._tasks[i]
                out.append(f"/job:{job}/task:{task}/device:CPU:{node.cpus[0]}")
        return out

    def node_of(self, device: str) -> int:
        """Index of the node holding `device`; raises KeyError if absent."""
        if self._node_by_device is None:  # the spec is immutable: built once
            self._node_by_device = {d.name: d.node_index for d in self.devices}
        return self._node_by_device[device]

    def bandwidth_gbps(self, node_or_device: int | str) -> float:
        """Bandwidth of a node (by index or by one of its devices), in Gbit/s."""
        index = node_or_device if isinstance(node_or_device, int) else self.node_of(node_or_device)
        value = self._proto.nodes[index].network_bandwidth_gbps
        return value if value > 0 else DEFAULT_BANDWIDTH_GBPS

    def memory_bytes(self, device: str) -> int:
        """Memory of a device in bytes, 0 when unknown.

        A GPU has its node's ``gpu_memory``; a CPU device has its node's
        ``cpu_memory``, which all CPU devices of the node share.

        Raises:
            KeyError: `device` is not in the spec.
        """
        node = self._proto.nodes[self.node_of(device)]
        return node.gpu_memory_bytes if "/device:GPU:" in device else node.cpu_memory_bytes

    def cluster_def(self, ports: Iterable[int] | None = None) -> dict[str, list[str]]:
        """The TensorFlow cluster as {job: ["host:port", ...]}.

        Args:
            ports: Port per node, overriding the spec's (needed where the
                spec leaves ports to be chosen at launch).
        """
        ports = list(ports) if ports is not None else [n.port for n in self._proto.nodes]
        if len(ports) != len(self._proto.nodes):
            raise ResourceSpecError(
                f"cluster_def needs one port per node ({len(self._proto.nodes)}). "
                f"Received: {short_repr(ports)}")
        jobs: dict[str, list[str]] = {}
        for job, _ in self._tasks:   # tasks are not in node order when the chief is not first
            jobs.setdefault(job, []).append("")
        for i, node in enumerate(self._proto.nodes):
            job, task = self._tasks[i]
            if not ports[i]:
                raise ResourceSpecError(
                    f"node {i} ({node.address}) has no port; pass ports= or set one in the spec")
            jobs[job][task] = f"{node.address}:{ports[i]}"
        return jobs

    # ------------------------------------------------------------ transforms
    def with_worker_tasks(self, tasks: Collection[int]) -> ResourceSpec:
        """The spec with only the worker nodes whose task is in `tasks` (and every PS-only
        node), e.g. the members of an elastic run, or all workers but a failed one.

        The nodes keep their order, so the new spec's worker task j is the j-th
        smallest of `tasks` (the chief, task 0, first) and its PS tasks are this
        spec's.

        Raises:
            ResourceSpecError: a task this spec does not have, or no chief left.
        """
        unknown = sorted(set(tasks) - set(range(self.num_worker_tasks)))
        if unknown:
            raise ResourceSpecError(f"with_worker_tasks: the spec has worker tasks "
                                    f"0..{self.num_worker_tasks - 1}. Received: "
                                    f"{short_repr(sorted(set(tasks)))}")
        proto = self.proto
        del proto.nodes[:]
        proto.nodes.extend(node for i, node in enumerate(self._proto.nodes)
                           if self._tasks[i][0] != "worker" or self._tasks[i][1] in tasks)
        return ResourceSpec(proto)

    def with_bandwidth_scaled(self, scale: float) -> ResourceSpec:
        """The spec with every known node bandwidth multiplied by `scale` (unknown stays
        unknown).

        Raises:
            ResourceSpecError: a bandwidth the scale makes infinite or negative.
        """
        proto = self.proto
        for node in proto.nodes:
            if node.network_bandwidth_gbps:
                node.network_bandwidth_gbps *= scale
        return ResourceSpec(proto)

    # --------------------------------------------------------- serialization
    def to_text(self) -> str:
        return text_format.MessageToString(self._proto)

    @classmethod
    def from_text(cls, text: str) -> ResourceSpec:
        proto = resource_spec_pb2.ResourceSpec()
        try:
            text_format.Parse(text, proto)
        except (text_format.ParseError, RecursionError, ValueError, TypeError) as e:
            raise ResourceSpecError(f"malformed resource spec text: "
                                    f"{shorten(str(e), 500)}") from e
        return cls(proto)

    def serialize(self) -> bytes:
        return self._proto.SerializeToString(deterministic=True)

    @classmethod
    def deserialize(cls, data: bytes) -> ResourceSpec:
        proto = resource_spec_pb2.ResourceSpec()
        try:
            proto.ParseFromString(data)
        except (DecodeError, RecursionError, ValueError, TypeError) as e:
            raise ResourceSpecError(f"not a ResourceSpec protobuf: "
                                    f"{shorten(str(e), 500)}") from e
        return cls(proto)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ResourceSpec) and self._proto == other._proto

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        return (f"ResourceSpec(nodes={len(self._proto.nodes)}, "
                f"replicas={len(self.replica_devices)}, ps={len(self.ps_devices)})")

    # ------------------------------------------------------------ internals
    def _assign_tasks(self) -> list[tuple[str, int]]:
        # The chief is worker task 0; other workers follow in file order.
        nodes = self._proto.nodes
        order = sorted(range(len(nodes)), key=lambda i: (not nodes[i].chief, i))
        counters = {"worker": 0, "ps": 0}
        tasks: list[tuple[str, int]] = [("", 0)] * len(nodes)
        for i in order:
            job = "worker" if "worker" in nodes[i].roles else "ps"
            tasks[i] = (job, counters[job])
            counters[job] += 1
        return tasks


def host_memory_bytes() -> int:
    """This host's memory in bytes, within its cgroup's limit; 0 when unknown.

    Physical memory from ``sysconf``; a container's cgroup limit
    (``memory.max`` of cgroup v2, ``memory.limit_in_bytes`` of v1) when lower.
    """
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        total = 0
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            limit = int(pathlib.Path(path).read_text().strip())
        except (OSError, ValueError):
            continue  # absent, or "max": no limit
        if 0 < limit and (not total or limit < total):
            total = limit
    return max(0, int(total))
