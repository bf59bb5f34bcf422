"""Reading a cluster description: YAML files within bounds, TF_CONFIG, and the node
mappings both become (`ResourceSpec.from_yaml`, `from_tf_config`, `from_dict`).

Every reader checks what it is given field by field and raises
`ResourceSpecError` naming the field and the value received.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import re
from typing import Any, Mapping

from autodist.ir.errors import ResourceSpecError, short_repr, shorten
from autodist.ir.gpus import visible_gpus
from autodist.proto import resource_spec_pb2

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


def read_yaml_file(path: str | os.PathLike) -> Any:
    """The YAML document of a resource-spec file, read within MAX_YAML_BYTES and parsed
    within bounds (`_load_yaml`)."""
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
    return _load_yaml(text, repr(str(path)))


def tf_config_nodes(tf_config: str | Mapping[str, Any] | None, gpus_per_worker: int | None,
                    cpu_replicas_per_worker: int,
                    bandwidth_gbps: float | None) -> list[dict[str, Any]]:
    """The nodes of a TF_CONFIG's cluster, as `ResourceSpec.from_dict` takes them (see
    `ResourceSpec.from_tf_config`)."""
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
        checked_count(gpus_per_worker, 0, "gpus_per_worker", MAX_DEVICES_PER_NODE)
    cpu_replicas = checked_count(cpu_replicas_per_worker, 1, "cpu_replicas_per_worker",
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
    return nodes


def nodes_from_dict(data: Any, source: str) -> list[resource_spec_pb2.Node]:
    """The nodes of a parsed description ({"nodes": [...]}), each checked; the first
    worker is the chief where no node is."""
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
    out: list[resource_spec_pb2.Node] = []
    devices = 0
    for i, raw in enumerate(nodes):
        out.append(_node_from_dict(raw, f"{source}: nodes[{i}]"))
        devices += len(out[-1].cpus) + len(out[-1].gpus)
        if devices > MAX_DEVICES:
            raise ResourceSpecError(
                f"{source}: the nodes list more than {MAX_DEVICES} devices in all (within "
                f"nodes[0..{i}]); refusing a cluster this large")
    if not any(n.chief for n in out):
        first_worker = next((n for n in out if "worker" in n.roles), None)
        if first_worker is not None:
            first_worker.chief = True
    return out


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


def checked_count(value: Any, minimum: int, where: str, maximum: int | None = None) -> int:
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
