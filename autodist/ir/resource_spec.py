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
import json
import math
import os
import pathlib
import re
from typing import Any, Iterable, Mapping

from google.protobuf import text_format
from google.protobuf.message import DecodeError

from autodist.ir.errors import ResourceSpecError, short_repr, shorten
from autodist.ir.fingerprint import fingerprint
from autodist.ir.gpus import visible_gpus
from autodist.proto import resource_spec_pb2

RESOURCE_SPEC_SCHEMA_VERSION = 1
# Used when a node's bandwidth is unknown (0 in the proto).
DEFAULT_BANDWIDTH_GBPS = 10.0
VALID_ROLES = ("worker", "ps")
_NODE_KEYS = {"address", "port", "chief", "cpus", "gpus", "network_bandwidth",
              "roles", "ssh_config", "gpu_memory", "cpu_memory"}
# Units of memory sizes ("16GB", "16 GiB", "512Mi"): decimal and binary.
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6,
               "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
               "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20,
               "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")
# Bounds past which a spec is a mistake (or hostile), checked before any work
# that grows with the numbers.
MAX_NODES = 10_000
MAX_DEVICES_PER_NODE = 4096
MAX_DEVICES = 65_536   # in the whole spec
MAX_ADDRESS_CHARS = 1024
# A YAML file larger than this, or whose aliases expand to more nodes, is refused.
MAX_YAML_BYTES = 1 << 20
MAX_YAML_NODES = 200_000
MAX_YAML_DEPTH = 64


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



def read_tf_config(tf_config: str | Mapping[str, Any] | None = None) -> Any:
    """TF_CONFIG parsed: from a JSON string, a dict (returned as is) or the environment.

    Raises:
        ResourceSpecError: TF_CONFIG is unset or not valid JSON.
    """
    if tf_config is None:
        tf_config = os.environ.get("TF_CONFIG")
        if not tf_config:
            raise ResourceSpecError("TF_CONFIG is not set in the environment")
    if isinstance(tf_config, str):
        try:
            return json.loads(tf_config)
        except (json.JSONDecodeError, RecursionError) as e:
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise ResourceSpecError(f"TF_CONFIG is not valid JSON: {why}. "
                                    f"Received: {short_repr(tf_config)}") from e
    return tf_config


def _load_yaml(text: str, source: str) -> Any:
    """YAML parsed safely and within bounds.

    Refuses documents nested deeper than MAX_YAML_DEPTH, whose aliases expand
    beyond MAX_YAML_NODES nodes, or that refer to themselves. Uses libyaml when
    PyYAML has it (fast, and it bounds nesting itself), else a pure-Python
    loader that stops composing at the depth bound (PyYAML's own scanner is
    quadratic in the nesting of flow collections).
    """
    import yaml

    loader = None
    try:
        loader = (getattr(yaml, "CSafeLoader", None) or _depth_bounded_loader(yaml))(text)
        root = loader.get_single_node()
        if root is None:
            return None
        _check_yaml_graph(root, source)
        return loader.construct_document(root)
    except yaml.YAMLError as e:
        raise ResourceSpecError(f"resource spec {source} is not valid YAML: "
                                f"{shorten(str(e), 500)}") from e
    except RecursionError as e:
        raise ResourceSpecError(f"resource spec {source} is nested too deeply") from e
    except (TypeError, ValueError, AttributeError) as e:
        # PyYAML's constructors raise these for some malformed documents
        # (e.g. a merge key whose value is of the wrong kind).
        raise ResourceSpecError(f"resource spec {source} is not valid YAML: "
                                f"{type(e).__name__}: {shorten(str(e), 300)}") from e
    finally:
        if loader is not None:
            loader.dispose()


def _depth_bounded_loader(yaml) -> type:
    """PyYAML's pure-Python SafeLoader, refusing nesting deeper than MAX_YAML_DEPTH."""

    class DepthBoundedLoader(yaml.SafeLoader):
        _depth = 0

        def compose_node(self, parent, index):
            self._depth += 1
            try:
                if self._depth > MAX_YAML_DEPTH:
                    raise yaml.composer.ComposerError(
                        None, None, f"nested deeper than {MAX_YAML_DEPTH} levels",
                        self.peek_event().start_mark)
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1

    return DepthBoundedLoader


def _check_yaml_graph(root: Any, source: str) -> None:
    """Bounds the composed document's depth and its size with every alias expanded.

    Aliases make the document a graph whose nodes are shared. Each distinct
    node is visited once (iteratively), so the check costs the size of the
    file, not of the expansion.
    """
    def children(node: Any) -> list[Any]:
        if not isinstance(node.value, list):
            return []
        return [c for item in node.value for c in (item if isinstance(item, tuple) else (item,))]

    done: dict[int, tuple[int, int]] = {}   # id -> (expanded size, depth)
    open_: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            kids = [done[id(c)] for c in children(node)]
            size = min(1 + sum(k[0] for k in kids), MAX_YAML_NODES + 1)
            depth = 1 + max((k[1] for k in kids), default=0)
            if size > MAX_YAML_NODES:
                raise ResourceSpecError(f"resource spec {source} expands to more than "
                                        f"{MAX_YAML_NODES} YAML nodes (through its aliases); "
                                        "refusing it")
            if depth > MAX_YAML_DEPTH:
                raise ResourceSpecError(f"resource spec {source} is nested deeper than "
                                        f"{MAX_YAML_DEPTH} levels")
            done[key] = (size, depth)
            open_.discard(key)
            continue
        if key in done:
            continue
        if key in open_:
            raise ResourceSpecError(f"resource spec {source} has an alias that refers to "
                                    "itself (a recursive structure)")
        open_.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children(node) if id(c) not in done)


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
        self._validate()
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
        cpu_replicas = _count(cpu_replicas_per_worker, 1,
                              "ResourceSpec.local: cpu_replicas_per_worker", MAX_DEVICES_PER_NODE)
        gpus = _count(gpus_per_worker, 0, "ResourceSpec.local: gpus_per_worker",
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
        path = pathlib.Path(path)
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_YAML_BYTES + 1)
        except OSError as e:
            raise ResourceSpecError(f"cannot read resource spec {str(path)!r}: {e}") from e
        if len(raw) > MAX_YAML_BYTES:
            raise ResourceSpecError(f"resource spec {str(path)!r} is larger than "
                                    f"{MAX_YAML_BYTES} bytes; refusing it")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ResourceSpecError(f"resource spec {str(path)!r} is not UTF-8 text: {e}") from e
        return cls.from_dict(_load_yaml(text, repr(str(path))), source=str(path))

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
        tf_config = read_tf_config(tf_config)
        cluster = tf_config.get("cluster") if isinstance(tf_config, Mapping) else None
        if not isinstance(cluster, Mapping) or not cluster:
            raise ResourceSpecError(f"TF_CONFIG must have a non-empty 'cluster' mapping. "
                                    f"Received: {short_repr(tf_config)}")
        unknown = [job for job in cluster if job not in ("chief", "worker", "ps", "evaluator")]
        if unknown:
            raise ResourceSpecError(
                f"TF_CONFIG cluster has unknown jobs {short_repr(unknown)}; "
                f"expected chief, worker, ps. Received: {short_repr(dict(cluster))}")
        gpus = len(visible_gpus()) if gpus_per_worker is None else \
            _count(gpus_per_worker, 0, "gpus_per_worker", MAX_DEVICES_PER_NODE)
        cpu_replicas = _count(cpu_replicas_per_worker, 1, "cpu_replicas_per_worker",
                              MAX_DEVICES_PER_NODE)
        nodes = []
        has_chief = bool(cluster.get("chief"))
        for job in ("chief", "worker", "ps"):
            addresses = cluster.get(job) or []
            if not isinstance(addresses, list):
                raise ResourceSpecError(
                    f"TF_CONFIG cluster.{job} must be a list of 'host:port'. "
                    f"Received: {short_repr(addresses)}")
            for i, addr in enumerate(addresses):
                node: dict[str, Any] = {"address": addr, "cpus": [0],
                                        "network_bandwidth": bandwidth_gbps}
                if job == "ps":
                    node["roles"] = ["ps"]
                else:
                    node["roles"] = ["worker"] if cluster.get("ps") else ["worker", "ps"]
                    node["gpus"] = list(range(gpus))
                    node["cpus"] = list(range(1 if gpus else cpu_replicas))
                    node["chief"] = (job == "chief") or (not has_chief and i == 0)
                nodes.append(node)
        return cls.from_dict({"nodes": nodes}, source="TF_CONFIG")

    @classmethod
    def from_dict(cls, data: Any, source: str = "resource spec") -> ResourceSpec:
        """Builds a spec from the parsed YAML structure ({"nodes": [...]})."""
        if not isinstance(data, Mapping) or "nodes" not in data:
            raise ResourceSpecError(f"{source}: expected a mapping with a 'nodes' list. "
                                    f"Received: {short_repr(data)}")
        nodes = data["nodes"]
        if not isinstance(nodes, list) or not nodes:
            raise ResourceSpecError(f"{source}: 'nodes' must be a non-empty list. "
                                    f"Received: {short_repr(nodes)}")
        if len(nodes) > MAX_NODES:
            raise ResourceSpecError(f"{source}: 'nodes' has {len(nodes)} entries, more than "
                                    f"{MAX_NODES}")
        proto = resource_spec_pb2.ResourceSpec(schema_version=RESOURCE_SPEC_SCHEMA_VERSION)
        devices = 0
        for i, raw in enumerate(nodes):
            proto.nodes.append(_node_from_dict(raw, f"{source}: nodes[{i}]"))
            devices += len(proto.nodes[-1].cpus) + len(proto.nodes[-1].gpus)
            if devices > MAX_DEVICES:
                raise ResourceSpecError(
                    f"{source}: the nodes list more than {MAX_DEVICES} devices in all (within "
                    f"nodes[0..{i}]); refusing a cluster this large")
        if not any(n.chief for n in proto.nodes):
            first_worker = next((n for n in proto.nodes if "worker" in n.roles), None)
            if first_worker is not None:
                first_worker.chief = True
        return cls(proto)

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
    def _validate(self) -> None:
        nodes = self._proto.nodes
        if not nodes:
            raise ResourceSpecError("a resource spec needs at least one node. Received: 0 nodes")
        if len(nodes) > MAX_NODES:
            raise ResourceSpecError(f"a resource spec has at most {MAX_NODES} nodes. "
                                    f"Received: {len(nodes)}")
        seen: dict[tuple[str, int], int] = {}
        for i, n in enumerate(nodes):
            if not n.address:
                raise ResourceSpecError(f"nodes[{i}].address is empty")
            if len(n.address) > MAX_ADDRESS_CHARS:
                raise ResourceSpecError(f"nodes[{i}].address is longer than {MAX_ADDRESS_CHARS} "
                                        f"characters. Received: {short_repr(n.address)}")
            where = f"nodes[{i}] ({n.address})"
            if not 0 <= n.port <= 65535:
                raise ResourceSpecError(f"{where}.port must be in 0..65535. Received: {n.port}")
            if not n.roles:
                raise ResourceSpecError(f"{where}.roles is empty; expected worker and/or ps")
            for r in n.roles:
                if r not in VALID_ROLES:
                    raise ResourceSpecError(f"{where}.roles: unknown role {short_repr(r)}; "
                                            f"expected one of {VALID_ROLES}")
            if not n.cpus:
                raise ResourceSpecError(f"{where}.cpus is empty; every task has a CPU")
            for field in ("cpus", "gpus"):
                values = getattr(n, field)
                if len(values) > MAX_DEVICES_PER_NODE:
                    raise ResourceSpecError(f"{where}.{field} lists {len(values)} devices, more "
                                            f"than {MAX_DEVICES_PER_NODE}")
                values = list(values)
                if any(v < 0 for v in values) or len(set(values)) != len(values):
                    raise ResourceSpecError(f"{where}.{field} must be distinct indices >= 0. "
                                            f"Received: {short_repr(values)}")
            if n.gpus and "worker" not in n.roles:
                raise ResourceSpecError(
                    f"{where} has GPUs {list(n.gpus)} but no 'worker' role to use them")
            if not n.network_bandwidth_gbps >= 0 or math.isinf(n.network_bandwidth_gbps):
                raise ResourceSpecError(
                    f"{where}.network_bandwidth must be finite and >= 0 Gbit/s. "
                    f"Received: {n.network_bandwidth_gbps}")
            if n.gpu_memory_bytes and not n.gpus:
                raise ResourceSpecError(
                    f"{where}.gpu_memory is {n.gpu_memory_bytes} bytes but the node has no "
                    "gpus")
            if n.port:
                key = (n.address, n.port)
                if key in seen:
                    raise ResourceSpecError(
                        f"{where} repeats {n.address}:{n.port} of nodes[{seen[key]}]")
                seen[key] = i
        if not any("worker" in n.roles for n in nodes):
            raise ResourceSpecError("no node has the 'worker' role: nothing can compute. "
                                    f"Received roles: {short_repr([list(n.roles) for n in nodes])}")
        chiefs = [i for i, n in enumerate(nodes) if n.chief]
        if len(chiefs) != 1:
            raise ResourceSpecError(f"exactly one node must be the chief. Received: chief on "
                                    f"nodes {short_repr(chiefs)}")
        if "worker" not in nodes[chiefs[0]].roles:
            raise ResourceSpecError(
                f"the chief (node {chiefs[0]}, {nodes[chiefs[0]].address}) must have the "
                f"'worker' role. Received roles: {list(nodes[chiefs[0]].roles)}")

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


def _node_from_dict(raw: Any, where: str) -> resource_spec_pb2.Node:
    if not isinstance(raw, Mapping):
        raise ResourceSpecError(f"{where} must be a mapping. Received: {short_repr(raw)}")
    unknown = [key for key in raw if key not in _NODE_KEYS]
    if unknown:
        raise ResourceSpecError(
            f"{where} has unknown fields {short_repr(unknown)}; expected some of "
            f"{sorted(_NODE_KEYS)}. Received: {short_repr(dict(raw))}")
    address = raw.get("address")
    if not isinstance(address, str) or not address.strip() or not _is_utf8(address):
        raise ResourceSpecError(f"{where}.address must be a non-empty string. "
                                f"Received: {short_repr(address)}")
    address = address.strip()
    if len(address) > MAX_ADDRESS_CHARS:
        raise ResourceSpecError(f"{where}.address is longer than {MAX_ADDRESS_CHARS} characters. "
                                f"Received: {short_repr(address)}")
    port = raw.get("port", 0)
    address, in_address = _host_and_port(address, where)
    if in_address is not None:
        port = in_address
    if isinstance(port, bool) or not isinstance(port, int):
        raise ResourceSpecError(f"{where}.port must be an integer. Received: {short_repr(port)}")
    if not 0 <= port <= 65535:
        raise ResourceSpecError(f"{where}.port must be in 0..65535. Received: {short_repr(port)}")
    node = resource_spec_pb2.Node(address=address, port=port)
    chief = raw.get("chief", False)
    if not isinstance(chief, bool):
        raise ResourceSpecError(f"{where}.chief must be true or false. "
                                f"Received: {short_repr(chief)}")
    node.chief = chief
    node.cpus.extend(_indices(raw.get("cpus", [0]), f"{where}.cpus"))
    node.gpus.extend(_indices(raw.get("gpus", []), f"{where}.gpus"))
    bandwidth = raw.get("network_bandwidth")
    if bandwidth is not None:
        if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or \
                not 0 < bandwidth < math.inf:
            raise ResourceSpecError(
                f"{where}.network_bandwidth must be a positive number of Gbit/s (finite). "
                f"Received: {short_repr(bandwidth)}")
        try:
            node.network_bandwidth_gbps = float(bandwidth)
        except OverflowError as e:   # an integer too large for a float
            raise ResourceSpecError(f"{where}.network_bandwidth is too large. "
                                    f"Received: {short_repr(bandwidth)}") from e
    for key, field in (("gpu_memory", "gpu_memory_bytes"), ("cpu_memory", "cpu_memory_bytes")):
        if raw.get(key) is not None:
            setattr(node, field, parse_size(raw[key], f"{where}.{key}"))
    roles = raw.get("roles", ["worker", "ps"])
    if isinstance(roles, str):
        roles = [roles]
    if not isinstance(roles, list) or not all(isinstance(r, str) for r in roles):
        raise ResourceSpecError(f"{where}.roles must be a list of strings. "
                                f"Received: {short_repr(roles)}")
    for r in roles:
        if r not in VALID_ROLES:
            raise ResourceSpecError(f"{where}.roles: unknown role {short_repr(r)}; "
                                    f"expected one of {VALID_ROLES}")
    node.roles.extend(roles)
    return node


def _host_and_port(address: str, where: str) -> tuple[str, int | None]:
    """(host, port or None) of "host", "host:port", "[v6]:port", "[v6]" or a bare IPv6
    address ("::1"); an IPv6 host keeps its brackets, as TensorFlow's cluster names it."""
    if address.startswith("["):
        end = address.find("]")
        rest = address[end + 1:] if end > 0 else None
        if end <= 1 or rest not in ("",) and not rest.startswith(":"):
            raise ResourceSpecError(f"{where}.address is a malformed IPv6 address (expected "
                                    f"'[v6]' or '[v6]:port'). Received: {short_repr(address)}")
        host, port_text = address[:end + 1], rest[1:] if rest else None
    elif address.count(":") > 1:
        return f"[{address}]", None   # a bare IPv6 address: no port in it
    elif ":" in address:
        host, _, port_text = address.partition(":")
    else:
        return address, None
    if port_text is None:
        return host, None
    if not port_text.isascii() or not port_text.isdigit() or not host.strip("[]"):
        raise ResourceSpecError(
            f"{where}.address has a malformed port. Received: {short_repr(address)}")
    return host, int(port_text)


def _count(value: Any, minimum: int, where: str, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ResourceSpecError(
            f"{where} must be an integer >= {minimum}. Received: {short_repr(value)}")
    if maximum is not None and value > maximum:
        raise ResourceSpecError(
            f"{where} must be an integer <= {maximum}. Received: {short_repr(value)}")
    return value


def parse_size(value: Any, where: str) -> int:
    """A memory size in bytes: an integer, or a string such as "16GB", "16 GiB", "512Mi".

    Units are decimal (k, KB, M, MB, G, GB, T, TB) or binary (Ki, KiB, Mi, MiB,
    Gi, GiB, Ti, TiB), case-insensitive; no unit means bytes.

    Args:
        value: The size.
        where: What the size is for, named in the error.

    Raises:
        ResourceSpecError: The value is not a size >= 0.
    """
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool) \
            and math.isfinite(value):
        number = float(value)
    elif isinstance(value, str) and len(value) <= 64:
        match = _SIZE.match(value)
        if match and match.group(2).lower() in _SIZE_UNITS:
            number = float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    if number is None or number < 0 or number >= 2 ** 64:
        raise ResourceSpecError(
            f"{where} must be a number of bytes or a size such as '16GB', '16GiB' or "
            f"'512Mi'. Received: {short_repr(value)}")
    return int(round(number))


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


def _is_utf8(text: str) -> bool:
    """False for strings with lone surrogates (YAML and JSON escapes can make them)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _indices(value: Any, where: str) -> list[int]:
    """Device indices: a list of distinct integers, or a count ("gpus: 2" means [0, 1])."""
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value <= MAX_DEVICES_PER_NODE:
            raise ResourceSpecError(f"{where} as a count must be in [0, {MAX_DEVICES_PER_NODE}]. "
                                    f"Received: {short_repr(value)}")
        return list(range(value))
    if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ResourceSpecError(f"{where} must be a list of device indices. "
                                f"Received: {short_repr(value)}")
    if len(value) > MAX_DEVICES_PER_NODE:
        raise ResourceSpecError(f"{where} lists {len(value)} devices, more than "
                                f"{MAX_DEVICES_PER_NODE}")
    if any(v < 0 for v in value) or len(set(value)) != len(value):
        raise ResourceSpecError(f"{where} must be distinct indices >= 0. "
                                f"Received: {short_repr(value)}")
    if any(v >= 2 ** 31 for v in value):
        raise ResourceSpecError(f"{where} has an index of 2^31 or more. "
                                f"Received: {short_repr(value)}")
    return value
