"""Per-device memory of a strategy: what each device must hold during a step.

Memory comes in pools: each GPU is a pool of its own; the CPU devices of a
node share one, the node's host memory (its CPU replicas, the
parameter-server variables it holds, local copies of them). A pool's
capacity is the ResourceSpec's ``gpu_memory`` / ``cpu_memory``; unknown (0)
is unconstrained.

What a variable shard of B bytes costs (S = the optimizer's slots per
variable, W = replicas, r = the rows of a sparse gradient one replica's step
looks up in the shard, one per lookup, repeats included, of `row` bytes
each plus an 8-byte index):

* all-reduced (mirrored), on every replica: the variable and its slots
  (1 + S)·B, its gradient B and the fused buffer it is reduced in B. A
  densified sparse gradient is as dense (twice for optimizers that square
  it); an all-gathered one holds its own rows r·(row + 8) and every
  replica's W·r·(row + 8);
* on a parameter server, in its node's host pool: the variable and its
  slots (1 + S)·B and, synchronous, every replica's gradient queued for the
  chief's sum in replica order and the sum, (W + 1)·B (sparse: the W·r
  pushed rows and their concatenation, twice for squaring optimizers;
  asynchronous: one gradient, B or r rows); on every replica the value it
  reads and its gradient, 2·B (sparse: the r rows read and their gradient);
* local replication adds a copy B in the host pool of every node that runs
  replicas;
* an update that densifies a sparse gradient (every rule but plain SGD)
  needs a dense temporary B where it runs.

Every replica also holds the step's activations and its state variables
(batch-norm statistics). The activation estimate comes from the capture's
per-op output bytes at its estimate batch, scaled linearly to the batch per
replica: the batch's inputs, every forward op's outputs except those that
alias their input (identities, reshapes, variable reads), as if all were
kept for the backward pass, and once more the largest of them (the gradient
flowing back through it). TensorFlow frees or reuses many of those buffers
(element-wise ops forward their input's), so the estimate is mostly high:
against TensorFlow's measured peak of a training step on the CPU
(`benchmarks/results/memory_estimate.md`: activations and gradients, above
the variables and slots) it is 1.0–3.2× for an MLP, a small Transformer, a
small CNN at batch 128 and Keras' ResNet50, and 0.5× for the small CNN at
batch 32, whose convolution workspaces it does not see. Other overheads
(the runtime itself, a CUDA context, allocator fragmentation) are not
counted: leave headroom in the capacities.

Everything is a vector over a few columns (`MemoryModel.columns`): bytes on
every replica, bytes in the host pool of every node that runs replicas, and
bytes in each node's host pool. A candidate's column sums map to pools by a
fixed matrix, so checking thousands of candidates is one matrix product.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import numpy as np

from autodist.ir.errors import AutodistError
from autodist.ir.graph_item import GraphItem, VariableInfo, optimizer_squares_gradient
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy, is_asynchronous, is_gathered
from autodist.proto import strategy_pb2

INDEX_BYTES = 8  # int64 row ids of a sparse gradient
# Ops whose output aliases an input or is bookkeeping: no activation memory.
_ALIASING_OPS = frozenset({
    "Identity", "IdentityN", "ReadVariableOp", "Reshape", "ExpandDims", "Squeeze",
    "StopGradient", "Const", "Shape", "ShapeN", "Size", "Rank", "NoOp", "VarHandleOp",
    "Snapshot", "PreventGradient", "EnsureShape",
})
# Column indices (the node host columns follow).
REPLICA, WORKER_HOST = 0, 1
_HOST0 = 2


class DoesNotFitError(AutodistError, ValueError):
    """The workload does not fit the cluster's memory whatever the strategy."""


@dataclasses.dataclass(frozen=True)
class MemoryPool:
    """Memory shared by some devices.

    Attributes:
        name: A readable name, e.g. "GPU memory of each replica" or
            "host memory of /job:ps/task:0".
        devices: The devices that allocate from it (all of them alike for a
            group of equal GPUs).
        capacity_bytes: Its size; `math.inf` when unknown.
    """

    name: str
    devices: tuple[str, ...]
    capacity_bytes: float


@dataclasses.dataclass(frozen=True)
class MemoryRefusal:
    """An option the search space left out because it cannot fit.

    Attributes:
        config: The variable's option.
        pool: The pool it overflows (the fullest).
        needed_bytes: That pool's bytes with the option and every other
            variable at its smallest.
    """

    config: strategy_pb2.VariableConfig
    pool: MemoryPool
    needed_bytes: float


def format_bytes(nbytes: float) -> str:
    """Bytes with a decimal unit and three significant digits, e.g. "2.15 GB"."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


class MemoryModel:
    """Memory per pool of the strategies for one GraphItem on one ResourceSpec.

    Args:
        graph_item, resource_spec: The workload.
        batch_size: The global batch size (activations scale with the batch
            per replica).
        rows_per_example: Rows each sparse gradient holds per example (see
            `autodist.search.space.lookups_per_example`); 1.0 when missing.

    Example:
        >>> model = MemoryModel(gi, spec, batch_size=256)          # doctest: +SKIP
        >>> model.pool_bytes(model.strategy_columns(strategy))     # doctest: +SKIP
    """

    def __init__(self, graph_item: GraphItem, resource_spec: ResourceSpec, batch_size: int,
                 rows_per_example: Mapping[str, float] | None = None) -> None:
        self.graph_item = graph_item
        self.resource_spec = resource_spec
        replicas = resource_spec.replica_devices
        self.num_replicas = len(replicas)
        self.num_nodes = len(resource_spec.nodes)
        self.batch_size = batch_size
        self.per_replica_batch = max(batch_size / self.num_replicas, 1.0)   # the busiest
        self.columns = _HOST0 + self.num_nodes
        self._rows = dict(rows_per_example or {})
        self._cache: dict[tuple, np.ndarray] = {}
        self._squares = optimizer_squares_gradient(graph_item.optimizer)
        self._dense_updates = not sparse_updates_touch_rows_only(graph_item)
        self.activation_bytes = activation_bytes(graph_item, self.per_replica_batch)
        self.state_bytes = float(sum(s.byte_size for s in graph_item.state_variables))
        self.fixed = np.zeros(self.columns)
        self.fixed[REPLICA] = self.activation_bytes + self.state_bytes
        self.pools, self.coefficients = self._pools()
        self.capacities = np.array([p.capacity_bytes for p in self.pools])
        self.constrained = bool(np.isfinite(self.capacities).any())

    # ---------------------------------------------------------------- pools
    def _pools(self) -> tuple[list[MemoryPool], np.ndarray]:
        spec = self.resource_spec
        replica_nodes = [spec.node_of(d) for d in spec.replica_devices]
        pools: list[MemoryPool] = []
        rows: list[np.ndarray] = []
        gpus: dict[float, list[str]] = {}   # equal GPUs form one pool group
        for device in spec.replica_devices:
            if "/device:GPU:" in device:
                gpus.setdefault(_capacity(spec.memory_bytes(device)), []).append(device)
        for capacity, devices in gpus.items():
            row = np.zeros(self.columns)
            row[REPLICA] = 1.0
            alike = f" (and {len(devices) - 1} more alike)" if len(devices) > 1 else ""
            pools.append(MemoryPool(f"GPU memory of {devices[0]}{alike}", tuple(devices),
                                    capacity))
            rows.append(row)
        for n, node in enumerate(spec.nodes):
            job, task = spec.task_of(n)
            cpu_replicas = [d for d, home in zip(spec.replica_devices, replica_nodes)
                            if home == n and "/device:CPU:" in d]
            row = np.zeros(self.columns)
            row[_HOST0 + n] = 1.0
            row[WORKER_HOST] = float(n in replica_nodes)
            row[REPLICA] = float(len(cpu_replicas))
            cpus = tuple(f"/job:{job}/task:{task}/device:CPU:{c}" for c in node.cpus)
            pools.append(MemoryPool(f"host memory of /job:{job}/task:{task}", cpus,
                                    _capacity(node.cpu_memory_bytes)))
            rows.append(row)
        return pools, np.array(rows)

    # -------------------------------------------------------------- options
    def config_columns(self, var: VariableInfo,
                       config: strategy_pb2.VariableConfig) -> np.ndarray:
        """The bytes one variable's config puts in each column (a read-only array)."""
        key = option_key(var, config, self._rows.get(var.name, 1.0))
        cached = self._cache.get(key)
        if cached is None:
            cached = self._config_columns(var, config)
            cached.flags.writeable = False
            self._cache[key] = cached
        return cached

    def _config_columns(self, var: VariableInfo,
                        config: strategy_pb2.VariableConfig) -> np.ndarray:
        out = np.zeros(self.columns)
        spec = self.resource_spec
        sizes = shard_sizes(var, config)
        dim = sum(sizes)
        row_bytes = var.byte_size / dim
        slots = len(var.slots)
        w = self.num_replicas
        lookups = self._rows.get(var.name, 1.0) * self.per_replica_batch
        for k, shard in enumerate(config.shards):
            fraction = sizes[k] / dim
            b = var.byte_size * fraction
            rows = lookups * fraction
            sparse_rows = rows * (row_bytes + INDEX_BYTES)
            update_temp = b if var.sparse_gradient and self._dense_updates else 0.0
            if shard.WhichOneof("kind") == "ps":
                home = _HOST0 + spec.node_of(shard.ps.reduction_destination)
                # Synchronous: every replica's gradient waits in its queue for the
                # chief's ordered sum (`ps_synchronizer.OrderedSum`); asynchronous:
                # one gradient at a time is applied.
                queued = 1 if is_asynchronous(shard) else w
                if var.sparse_gradient:
                    # The queued rows, and the sum's concatenation of them.
                    pushed = queued * sparse_rows * (2 if queued > 1 else 1)
                    out[home] += (1 + slots) * b + pushed * (2 if self._squares else 1)
                    out[REPLICA] += rows * row_bytes + sparse_rows
                else:
                    out[home] += (1 + slots) * b + (queued + (queued > 1)) * b
                    out[REPLICA] += 2 * b
                out[home] += update_temp
                if shard.ps.local_replication:
                    out[WORKER_HOST] += b
            else:
                out[REPLICA] += (1 + slots) * b
                if is_gathered(shard.all_reduce, var.sparse_gradient):
                    out[REPLICA] += (1 + w) * sparse_rows + update_temp
                elif shard.all_reduce.spec == strategy_pb2.AllReduceSynchronizer.ALL_GATHER:
                    out[REPLICA] += (1 + w) * b  # a dense gradient gathered whole
                else:
                    squares = 2 if var.sparse_gradient and self._squares else 1
                    out[REPLICA] += 2 * b * squares
        return out

    def strategy_columns(self, strategy: Strategy) -> np.ndarray:
        """The column sums of a whole strategy (its variables in any order)."""
        by_name = {c.var_name: c for c in strategy.variables}
        total = np.zeros(self.columns)
        for var in self.graph_item.variables:
            total += self.config_columns(var, by_name[var.name])
        return total

    # ---------------------------------------------------------------- pools
    def pool_bytes(self, column_sums: np.ndarray) -> np.ndarray:
        """Bytes per pool, (N, pools), of (N, columns) variable column sums (fixed added)."""
        return (np.atleast_2d(column_sums) + self.fixed) @ self.coefficients.T

    def fractions(self, column_sums: np.ndarray) -> np.ndarray:
        """Per candidate, the fullest pool's bytes over its capacity (0: unconstrained)."""
        if not self.constrained:
            return np.zeros(len(np.atleast_2d(column_sums)))
        used = self.pool_bytes(column_sums)
        with np.errstate(invalid="ignore"):
            ratio = np.where(np.isfinite(self.capacities), used / self.capacities, 0.0)
        return ratio.max(axis=1)

    def overflow(self, column_sums: np.ndarray) -> tuple[MemoryPool, float] | None:
        """The fullest overflowing pool of one candidate and its bytes, or None if it fits."""
        used = self.pool_bytes(column_sums)[0]
        over = np.where(np.isfinite(self.capacities), used / self.capacities, 0.0)
        worst = int(np.argmax(over))
        return (self.pools[worst], float(used[worst])) if over[worst] > 1.0 else None

    def describe(self, column_sums: np.ndarray) -> str:
        """One line per pool: bytes used / capacity."""
        used = self.pool_bytes(column_sums)[0]
        lines = []
        for pool, nbytes in zip(self.pools, used):
            cap = ("unconstrained" if math.isinf(pool.capacity_bytes)
                   else format_bytes(pool.capacity_bytes))
            lines.append(f"{pool.name}: {format_bytes(nbytes)} of {cap}")
        return "\n".join(lines)


def option_key(var: VariableInfo, config: strategy_pb2.VariableConfig,
               rows_per_example: float) -> tuple:
    """What a config's costs depend on: the variable's shape, kind and slots, and
    the config but for its variable name (equal for the layers of a deep model)."""
    anonymous = strategy_pb2.VariableConfig()
    anonymous.CopyFrom(config)
    anonymous.ClearField("var_name")
    return (var.dtype, tuple(var.shape), var.byte_size, var.sparse_gradient,
            tuple(var.slots), rows_per_example if var.sparse_gradient else 0.0,
            anonymous.SerializeToString(deterministic=True))


def activation_bytes(graph_item: GraphItem, per_replica_batch: float) -> float:
    """Estimated activation memory of one replica's step at `per_replica_batch`.

    The inputs and every forward op's outputs except aliasing ones, plus the
    largest forward output again (its gradient), from the capture's
    estimates at its estimate batch, scaled linearly to `per_replica_batch`.
    """
    estimate = graph_item.estimate_batch_size
    total = 0.0
    largest = 0.0
    for op in graph_item.proto.ops:
        if op.type in _ALIASING_OPS:
            continue
        if op.phase == "input":
            total += op.output_bytes
        elif op.phase == "forward":
            total += op.output_bytes
            largest = max(largest, float(op.output_bytes))
    return (total + largest) * per_replica_batch / estimate


def shard_sizes(var: VariableInfo, config: strategy_pb2.VariableConfig) -> list[int]:
    """Sizes of a config's shards along its axis (a whole variable: its rows)."""
    p = config.partitioner
    if p.num_shards <= 1:
        return [var.shape[0] if var.shape else 1]
    if p.shard_sizes:
        return list(p.shard_sizes)
    base, extra = divmod(var.shape[p.axis], p.num_shards)
    return [base + (1 if i < extra else 0) for i in range(p.num_shards)]


def sparse_updates_touch_rows_only(graph_item: GraphItem) -> bool:
    """Whether the optimizer updates only a sparse gradient's rows (plain SGD).

    Every other rule densifies the gradient first (zero-fill, segment sum,
    then the update).
    """
    opt = graph_item.optimizer
    if opt.algorithm != "sgd" or opt.hyperparameters.get("weight_decay", 0.0):
        return False
    if opt.family == "keras":
        return opt.hyperparameters.get("momentum", 0.0) == 0.0
    return not any(v.slots for v in graph_item.variables)


def _capacity(nbytes: int) -> float:
    return float(nbytes) if nbytes > 0 else math.inf
