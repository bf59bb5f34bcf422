"""The analytic simulator: predicted step time of candidate strategies.

An α-β model of one synchronous training step on the ResourceSpec:

* compute: the GraphItem's FLOPs scaled to the per-replica batch, divided by
  a calibrated FLOP rate, plus a per-op overhead; or the model's passes
  measured on the cluster (`measured_compute`), scaled to the batch;
* parameter servers: every replica pulls each dense shard and pushes its
  gradient (a sparse variable moves only the touched rows and their indices);
  traffic between a replica and a shard on its own node is free; local
  replication replaces the replicas' pulls by one refresh per node;
* ring all-reduce of each fused group: 2(W-1)/W of its bytes in and out of
  every node and 2(W-1) latencies; fp16 halves the wire bytes;
* all-gather of a sparse gradient: (W-1) times a replica's indices and values
  (one row per lookup, repeats included), the latency of one all-gather for
  all the sparse shards of a wire dtype (they travel together); a densified
  sparse gradient (spec
  RING) is reduced with its group as dense bytes (twice for optimizers that
  square it: the rows' squares travel too);
* a node's link is full duplex: its time is max(bytes in, bytes out) divided
  by its bandwidth; the step waits for the busiest node; the step's traffic
  comes in phases (PS reads in the forward pass, then the gradients' pushes
  and all-reduce; a mixed step pushes after its all-reduce, in a second
  run) that overlap by `Calibration.ps_overlap`;
* per-message latency α at the busiest node (a collective's hops at their
  own α where calibrated on the cluster), optimizer updates at memory
  bandwidth on the devices that apply them (plain SGD touches only a sparse
  gradient's rows; other rules densify it: three passes over the table),
  the chief's token round for a synchronous PS step, and one extra session
  run when a step mixes PS and all-reduce (the runtime runs them in two
  phases);
* overlap with the backward pass: a fused group can start reducing once its
  last gradient exists (`gradient_ready_fractions`: the share of the backward
  FLOPs done by then), so the ring traffic of groups whose gradients are
  ready early hides behind the rest of the backward pass. The link serves
  the groups' bytes as they become ready (work-conserving; concurrent
  collectives share it) and the traffic still exposed after the backward
  pass, plus one group's fixed cost, is what the step waits for; the
  groups' fixed costs (their hops' α) run on the same CPU as the backward
  pass and never hide behind it, only behind other groups' transfers, so the
  exposed time is at least their sum. `Prediction.parts["overlap_s"]` is
  what this saves against the additive model (0 for one group whose last
  gradient is the backward pass's last), scaled by
  `Calibration.backward_overlap` (0, off, unless set);
* where calibrated on a cluster (`autodist.runtime.cluster_calibration`): a
  fixed cost per task per step (the step's coordination), CPU time per byte
  the busiest task moves (gRPC's and the collectives' copies, beyond the
  link's time), and CPU replicas that share a host's cores computing at
  their share of them.

The predicted step time adds these parts; the lower bound is max(compute,
bandwidth time), i.e. perfect overlap and no latency. Each candidate's
memory per device comes from the same tables (`autodist.search.memory`):
`Prediction.fits` says whether every device holds it. Everything is
vectorised over a matrix of candidates (see `SearchSpace`), so scoring
thousands of candidates takes milliseconds.
"""
from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from autodist.ir.errors import InvalidArgumentError
from autodist.ir.graph_item import VariableInfo, optimizer_squares_gradient
from autodist.ir.strategy import Strategy, is_gathered, sums_by_gathering
from autodist.proto import strategy_pb2
from autodist.search.measured_compute import MeasuredCompute
from autodist.search.memory import (REPLICA, MemoryModel, option_key, shard_sizes,
                                    sparse_updates_touch_rows_only)
from autodist.search.space import NUM_COMPRESSORS, SearchSpace, lookups_per_example

AllReduceSynchronizer = strategy_pb2.AllReduceSynchronizer

_INDEX_BYTES = 8  # int64 row ids
# Candidates are scored in blocks of about this many table entries (at the
# table's full width); the entries all of a block's candidates share are
# summed once, so the blocks also fix the order of a greedy step's sums.
_GATHER_ELEMENTS = 1 << 22
# Gathered entries summed at a time within a block: 2 MB stay in the cache
# (whole blocks, 33 MB at 200 variables, summed 1.7x slower).
_CACHED_ELEMENTS = 1 << 18


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Machine constants of the simulator.

    Attributes:
        flops_per_s: Sustained compute rate of one replica.
        op_overhead_s: Fixed cost of running one op.
        latency_s: α, the cost of one message (gRPC round or collective hop).
        memory_bytes_per_s: Rate of optimizer updates (read-modify-write).
        run_overhead_s: Cost of one extra session run per step.
        ps_overlap: How much of the step's traffic overlaps across its
            phases, between 0 (the PS reads of the forward pass, then the
            gradients' traffic, and in a mixed step the all-reduce and then
            the PS pushes of the second run, each wait for the previous) and
            1 (all of it at once, as in the lower bound). 0.5 ranks the trial
            data set's strategies best (pairwise accuracy 0.646, against 0.634
            fully overlapped and 0.643 fully phased; see
            `benchmarks/results/cost_model.md`); for the PS step of the
            2-worker MLP at 100 Mbit/s it gives a bandwidth term of 258 ms
            (172 overlapped, 345 phased) against 256 ms measured.
        collective_latency_s: α of one hop of a ring all-reduce or all-gather
            (None: `latency_s`).
        task_overhead_s: Fixed cost of a step per task of the cluster (the
            chief's coordination, each task's run dispatch); 0 uncalibrated.
        byte_cost_s: CPU time per byte the busiest task sends or receives
            (serialization and copies of gRPC and the collectives), beyond the
            link's time; 0 uncalibrated.
        host_cores: Cores of a host that runs CPU replicas (0: unknown, no
            sharing modelled); `flops_per_s` is then the rate of one core,
            and CPU replicas beyond a host's cores share them (their FLOPs
            and their ops' fixed costs alike).
        conv_flops_per_s: Rate of the convolutions' FLOPs (forward and both
            backward kernels), which run well below a matmul's rate on a
            CPU; None: `flops_per_s`.
        backward_overlap: How much of the all-reduce time that the overlap
            model hides behind the backward pass is taken off the step (see
            the module docstring), between 0 (none: the additive model, where
            more fused groups only add fixed costs) and 1. 0 by default, as
            before the model existed: the fixed-cost fit
            (`autodist.search.calibration_fit`) assumes the additive model,
            and uncalibrated α (0.1 ms a hop) with 1 here prefers buckets
            where they measured slower (`benchmarks/results/overlap.md`);
            with a cluster's calibration, 1 ranks the measured bucket sizes
            as measured.
        source: Where the constants come from ("default", or what measured them).
    """

    flops_per_s: float = 2e10
    op_overhead_s: float = 4e-6
    latency_s: float = 1e-4
    memory_bytes_per_s: float = 4e9
    run_overhead_s: float = 1e-3
    ps_overlap: float = 0.5
    collective_latency_s: float | None = None
    task_overhead_s: float = 0.0
    byte_cost_s: float = 0.0
    host_cores: int = 0
    conv_flops_per_s: float | None = None
    backward_overlap: float = 0.0
    source: str = "default"

    def __post_init__(self) -> None:
        for name in ("ps_overlap", "backward_overlap"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
                raise InvalidArgumentError(f"{name} must be in [0, 1]. Received: {value!r}")
        for name in ("flops_per_s", "memory_bytes_per_s", "conv_flops_per_s"):
            value = getattr(self, name)
            if value is None and name == "conv_flops_per_s":
                continue
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise InvalidArgumentError(f"Calibration.{name} must be a positive number. "
                                           f"Received: {value!r}")
        for name in ("op_overhead_s", "latency_s", "run_overhead_s", "task_overhead_s",
                     "collective_latency_s", "byte_cost_s"):
            value = getattr(self, name)
            if value is None and name == "collective_latency_s":
                continue
            if not (isinstance(value, (int, float)) and math.isfinite(value)
                    and 0 <= value <= 3600):
                raise InvalidArgumentError(f"Calibration.{name} must be seconds in [0, 3600]. "
                                           f"Received: {value!r}")
        if not (isinstance(self.host_cores, int) and 0 <= self.host_cores <= 1 << 20):
            raise InvalidArgumentError("Calibration.host_cores must be an int in [0, 2^20]. "
                                       f"Received: {self.host_cores!r}")
        if not isinstance(self.source, str):
            raise InvalidArgumentError(f"Calibration.source must be a string. "
                                       f"Received: {self.source!r}")

    @property
    def hop_latency_s(self) -> float:
        """α of one collective hop."""
        return self.latency_s if self.collective_latency_s is None else self.collective_latency_s

    def to_dict(self) -> dict[str, object]:
        """The constants as JSON-compatible values (`from_dict` reads them back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: object, source: str = "calibration") -> Calibration:
        """A Calibration from `to_dict`'s mapping, every value checked.

        Raises:
            InvalidArgumentError: Not a mapping, an unknown key, or a bad value
                (named, with `source`).
        """
        if not isinstance(data, dict):
            raise InvalidArgumentError(f"{source} must be a mapping of Calibration fields. "
                                       f"Received: {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise InvalidArgumentError(f"{source} has unknown Calibration fields {unknown}; "
                                       f"known: {sorted(known)}")
        try:
            return cls(**data)
        except (TypeError, InvalidArgumentError) as e:
            raise InvalidArgumentError(f"{source}: {e}") from None

    @classmethod
    def measure(cls, seconds: float = 0.2) -> Calibration:
        """Measures the FLOP rate and memory rate of this machine with NumPy.

        A short micro-benchmark (about `seconds` in all): a 256×256 float32
        matmul loop and an array update loop. Latencies keep their defaults
        (they need the cluster to measure).
        """
        rng = np.random.default_rng(0)
        a = rng.standard_normal((256, 256), dtype=np.float32)
        b = rng.standard_normal((256, 256), dtype=np.float32)
        flops = 0.0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds / 2:
            a @ b
            flops += 2 * 256 ** 3
        flops_per_s = flops / (time.perf_counter() - start)
        x = np.zeros(1 << 20, dtype=np.float32)
        y = np.ones_like(x)
        moved = 0.0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds / 2:
            x += 0.1 * y
            moved += 3 * x.nbytes
        memory = moved / (time.perf_counter() - start)
        return cls(flops_per_s=flops_per_s, memory_bytes_per_s=memory)


@dataclasses.dataclass
class Prediction:
    """Predicted step times and their parts for N candidates (arrays of shape (N,)).

    Attributes:
        step_time_s: Predicted step time.
        lower_bound_s: Compute and bandwidth perfectly overlapped, no latency.
        parts: Named parts of the step time and the quantities behind them
            (bytes, messages, groups), used as features by the cost model.
    """

    step_time_s: np.ndarray
    lower_bound_s: np.ndarray
    parts: dict[str, np.ndarray]

    @property
    def fits(self) -> np.ndarray:
        """Whether each candidate fits every device's memory (parts["memory_fraction"] <= 1)."""
        return self.parts["memory_fraction"] <= 1.0 + 1e-12


# Columns of the per-option table: bytes in/out, messages and updated bytes
# per node, then scalar columns, then one column per fusion group.
_SCALARS = ("ps_bytes", "ps_shards", "ar_bytes", "ag_payload", "ag_count", "ps_vars",
            "ar_vars", "sparse_ps_bytes", "var_bytes_on_ps")


class Simulator:
    """Scores candidates of a SearchSpace with the α-β model.

    Args:
        space: The search space (its options are compiled into tables; call
            again after `space.encode` added options — done automatically).
        calibration: Machine constants (default: `Calibration()`).
        batch_size: The global batch size (default: the space's).
        measured_compute: A replica's forward and backward passes measured
            on the cluster (`cluster_calibration.measure_compute`): used,
            scaled to the per-replica batch, instead of the estimate from
            FLOPs, rates and op costs (which then count no op runs).

    Attributes:
        memory: The memory model at this batch size (the space's when equal).
        op_runs: How many times a replica's step pays `op_overhead_s` (the
            GraphItem's ops, times the core sharing where calibrated).
    """

    def __init__(self, space: SearchSpace, calibration: Calibration | None = None,
                 batch_size: int | None = None,
                 measured_compute: MeasuredCompute | None = None) -> None:
        self.space = space
        self.calibration = calibration or Calibration()
        self.measured_compute = measured_compute
        spec = space.resource_spec
        self.replica_nodes = [spec.node_of(d) for d in spec.replica_devices]
        self.num_replicas = len(self.replica_nodes)
        self.num_nodes = len(spec.nodes)
        estimate = space.graph_item.estimate_batch_size
        self.batch_size = batch_size or space.batch_size
        if self.batch_size < 1:
            raise InvalidArgumentError(f"batch_size must be >= 1. Received: {self.batch_size}")
        self.memory = (space.memory if self.batch_size == space.batch_size else
                       MemoryModel(space.graph_item, spec, self.batch_size,
                                   space.lookups_per_example))
        # A batch smaller than the replicas (Keras takes batch_size=1; the run gives some
        # replicas no examples): the busiest replica holds one example.
        self.per_replica_batch = max(self.batch_size / self.num_replicas, 1.0)
        self.bandwidth = np.array([spec.bandwidth_gbps(n) * 1e9 / 8
                                   for n in range(self.num_nodes)])
        self.replicas_on = np.bincount(self.replica_nodes, minlength=self.num_nodes)
        gi = space.graph_item
        sharing = _core_sharing(spec, self.calibration)
        self.compute_s = _compute_s(gi, self.per_replica_batch, estimate, self.calibration,
                                    sharing)
        # The ops a replica's step pays `op_overhead_s` for (shared cores stretch them
        # only where calibrated, as `_compute_s` applies them).
        self.op_runs = len(gi.ops) * (sharing if self.calibration.host_cores > 0 else 1.0)
        if measured_compute is not None:   # its ops, shared cores and all
            self.compute_s = measured_compute.seconds_at(self.per_replica_batch)
            self.op_runs = 0.0
        self.backward_s = self.compute_s * _backward_share(gi)
        self._ready = gradient_ready_fractions(gi)
        self.num_tasks = len(spec.nodes)
        # Rows of each sparse gradient in a replica's step: one per lookup, repeats
        # included (what a PS push or read and an all-gather move); updates
        # touch at most the table's rows (`_update_bytes` caps them).
        self._rows = {name: per_example * self.per_replica_batch
                      for name, per_example in lookups_per_example(gi).items()}
        self._squares = optimizer_squares_gradient(gi.optimizer)
        self._sparse_rows_only = sparse_updates_touch_rows_only(gi)
        self._compiled_counts: tuple[int, ...] | None = None
        self._rows_cache: dict[tuple, np.ndarray] = {}

    # ---------------------------------------------------------------- tables
    def _compile(self) -> None:
        counts = tuple(len(o) for o in self.space.options)
        if counts == self._compiled_counts:
            return
        n = self.num_nodes
        self._groups = NUM_COMPRESSORS * self.space.num_slots
        self._cols = {"in": slice(0, n), "out": slice(n, 2 * n), "msgs": slice(2 * n, 3 * n),
                      "update": slice(3 * n, 4 * n), "pull_in": slice(4 * n, 5 * n),
                      "pull_out": slice(5 * n, 6 * n)}
        base = 6 * n
        for i, name in enumerate(_SCALARS):
            self._cols[name] = base + i
        self._cols["groups"] = slice(base + len(_SCALARS), base + len(_SCALARS) + self._groups)
        base += len(_SCALARS) + self._groups
        # Gathered shards by whether their rows travel as float16: the runtime
        # gathers each kind's shards together, in one all-gather.
        self._cols["gathers"] = slice(base, base + 2)
        base += 2
        self._cols["memory"] = slice(base, base + self.memory.columns)
        width = base + self.memory.columns
        rows = []
        self._offsets = np.zeros(len(counts), dtype=np.int64)
        total = 0
        for v, options in enumerate(self.space.options):
            self._offsets[v] = total
            total += len(options)
            for config in options:
                rows.append(self._option_row(self.space.variables[v], config, width))
        self._table = np.array(rows, dtype=np.float64)
        # Per option, per fusion group it reduces into: when its gradient is ready.
        ready = np.zeros((len(rows), self._groups))
        index = 0
        for v, options in enumerate(self.space.options):
            var = self.space.variables[v]
            for config in options:
                for shard in config.shards:
                    ar = shard.all_reduce
                    if (shard.WhichOneof("kind") == "all_reduce" and ar.spec
                            != AllReduceSynchronizer.ALL_GATHER
                            and not is_gathered(ar, var.sparse_gradient)):
                        column = ar.compressor * self.space.num_slots + ar.group
                        ready[index, column] = self._ready.get(var.name, 1.0)
                index += 1
        self._ready_table = ready
        # Many columns are zero for every option (messages to workers, fusion
        # slots of compressors not offered, host memory of nodes without PS
        # shards): predict gathers the others only. NumPy sums one column
        # pairwise but several in order, so a single one is not split off.
        used = np.flatnonzero((self._table != 0).any(axis=0))
        self._used_columns = used if len(used) > 1 else np.arange(width)
        self._used_table = np.ascontiguousarray(self._table[:, self._used_columns])
        self._compiled_counts = counts

    def _option_row(self, var: VariableInfo, config: strategy_pb2.VariableConfig,
                    width: int) -> np.ndarray:
        # The layers of a deep model share shapes and options: compute each row once.
        key = (width, self.space.num_slots,
               option_key(var, config, self._rows.get(var.name, 0.0)))
        row = self._rows_cache.get(key)
        if row is None:
            row = self._rows_cache[key] = self._compute_option_row(var, config, width)
        return row

    def _compute_option_row(self, var: VariableInfo, config: strategy_pb2.VariableConfig,
                            width: int) -> np.ndarray:
        row = np.zeros(width)
        c = self._cols
        spec = self.space.resource_spec
        sizes = shard_sizes(var, config)
        dim = sum(sizes)
        row_bytes = var.byte_size / dim
        touched = self._rows.get(var.name, 0.0)
        for k, shard in enumerate(config.shards):
            fraction = sizes[k] / dim
            shard_bytes = var.byte_size * fraction
            kind = shard.WhichOneof("kind")
            if kind == "ps":
                home = spec.node_of(shard.ps.reduction_destination)
                if var.sparse_gradient:
                    rows = touched * fraction
                    push = rows * (row_bytes + _INDEX_BYTES)
                    pull = rows * row_bytes
                    request = rows * _INDEX_BYTES
                    row[c["sparse_ps_bytes"]] += push + pull
                else:
                    push = pull = shard_bytes
                    request = 0.0
                replicas = self.replicas_on
                remote = replicas > 0
                remote[home] = False
                row[c["msgs"].start + home] += 2 * replicas.sum()
                # One refresh per node with local replication, else one pull per replica.
                node_pull = np.where(remote, shard_bytes if shard.ps.local_replication
                                     else replicas * pull, 0.0)
                node_push = np.where(remote, replicas * (push + request), 0.0)
                node_request = np.where(remote, replicas * request, 0.0)
                row[c["out"]] += node_push
                row[c["in"].start + home] += node_push.sum()
                row[c["in"]] += node_pull
                row[c["out"].start + home] += node_pull.sum()
                # Reads (and a sparse lookup's row ids) happen in the forward pass.
                row[c["pull_out"]] += node_request
                row[c["pull_in"].start + home] += node_request.sum()
                row[c["pull_in"]] += node_pull
                row[c["pull_out"].start + home] += node_pull.sum()
                row[c["ps_bytes"]] += node_push.sum() + node_pull.sum()
                row[c["update"].start + home] += self._update_bytes(var, shard_bytes, fraction)
                row[c["ps_shards"]] += 1
                row[c["var_bytes_on_ps"]] += shard_bytes
            else:
                ar = shard.all_reduce
                scale = 0.5 if ar.compressor != AllReduceSynchronizer.NONE else 1.0
                gathered = (is_gathered(ar, var.sparse_gradient)
                            or ar.spec == AllReduceSynchronizer.ALL_GATHER)
                densified = var.sparse_gradient and not gathered
                if gathered:
                    rows = touched * fraction if var.sparse_gradient else sizes[k]
                    row[c["ag_payload"]] += rows * (row_bytes * scale + _INDEX_BYTES)
                    row[c["ag_count"]] += 1
                    row[c["gathers"].start + (ar.compressor != AllReduceSynchronizer.NONE)] = 1
                else:
                    wire = shard_bytes * scale * (2 if densified and self._squares else 1)
                    column = ar.compressor * self.space.num_slots + ar.group
                    row[c["groups"].start + column] += wire
                    row[c["ar_bytes"]] += wire
                update = shard_bytes if densified else self._update_bytes(var, shard_bytes,
                                                                          fraction)
                row[c["update"]] += np.where(self.replicas_on > 0, update, 0.0)
        row[c["memory"]] = self.memory.config_columns(var, config)
        kinds = {s.WhichOneof("kind") for s in config.shards}
        row[c["ps_vars"]] += "ps" in kinds
        row[c["ar_vars"]] += "all_reduce" in kinds
        return row

    def _update_bytes(self, var: VariableInfo, shard_bytes: float, fraction: float) -> float:
        """Bytes an optimizer update of one shard moves through memory.

        Plain SGD scatters a sparse gradient's rows; every other rule
        densifies it first (zero-fill, segment sum, then the update: about
        three passes over the shard).
        """
        if not var.sparse_gradient:
            return shard_bytes
        if self._sparse_rows_only:
            rows = self._rows.get(var.name, 0.0) * fraction * self.num_replicas
            return min(shard_bytes, rows * var.byte_size / max(1, var.shape[0]))
        return 3 * shard_bytes

    # --------------------------------------------------------------- scoring
    def predict(self, candidates: np.ndarray) -> Prediction:
        """Predicted step times of an (N, V + 1) candidate matrix."""
        self._compile()
        candidates = np.atleast_2d(np.asarray(candidates, dtype=np.int64))
        v = self.space.num_variables
        if candidates.shape[1] != v + 1:
            raise InvalidArgumentError(f"candidates must have {v + 1} columns (variables + "
                                       f"consistency). Received shape {candidates.shape}")
        width = self._table.shape[1]
        table, columns = self._used_table, self._used_columns
        sums = np.zeros((len(candidates), width))
        chunk = max(1, _GATHER_ELEMENTS // max(1, v * width))
        for start in range(0, len(candidates), chunk):
            block = candidates[start:start + chunk, :v] + self._offsets
            # Entries every candidate of the block shares are summed once: a
            # greedy step's candidates differ in one entry.
            shared = (block == block[0]).all(axis=0)
            base = table[block[0, shared]].sum(axis=0)
            sums[start:start + chunk, columns] = base + _row_sums(table, block[:, ~shared])
        sync = np.array([c.sync for c in self.space.consistencies])[candidates[:, v]]
        staleness = np.array([c.staleness for c in self.space.consistencies])[candidates[:, v]]
        return self._times(sums, sync, staleness, self._group_ready(candidates[:, :v]))

    def _group_ready(self, choices: np.ndarray) -> np.ndarray:
        """(N, groups): when each fused group's last gradient is ready (a share of the
        backward pass)."""
        table = self._ready_table
        out = np.zeros((len(choices), table.shape[1]))
        if self.calibration.backward_overlap == 0 or not table.any():
            return out  # unused: skip the gather
        used = np.flatnonzero(table.any(axis=0))
        table = table[:, used]
        step = max(1, _GATHER_ELEMENTS // max(1, choices.shape[1] * len(used)))
        for start in range(0, len(choices), step):
            block = choices[start:start + step] + self._offsets
            # As in `predict`: the entries every candidate of the block shares, once.
            shared = (block == block[0]).all(axis=0)
            base = table[block[0, shared]].max(axis=0, initial=0.0)
            rest = table[block[:, ~shared]].max(axis=1, initial=0.0)
            out[start:start + step, used] = np.maximum(base, rest)
        return out

    def node_traffic(self, candidate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Bytes into and out of each node per step, per variable of one candidate.

        Args:
            candidate: A (V + 1,) candidate vector.

        Returns:
            (bytes in, bytes out), each of shape (V, nodes): PS pulls and
            pushes, and the traffic of the variable's all-reduce (ring, or
            gathered where its group is small) and all-gather on every node
            that runs replicas. Summed over the
            variables they are the node bytes `predict` adds up.
        """
        self._compile()
        candidate = np.asarray(candidate, dtype=np.int64)
        v = self.space.num_variables
        c = self._cols
        rows = self._table[self._offsets + candidate[:v]]
        w = self.num_replicas
        collective = np.zeros(v)
        if w > 1:
            by_group = rows[:, c["groups"]]
            wire_factor, _ = _group_collectives(by_group.sum(axis=0)[None, :], w)
            collective = ((by_group * wire_factor).sum(axis=1)
                          + (w - 1) * rows[:, c["ag_payload"]])
        ring = collective[:, None] * (self.replicas_on > 0)[None, :]
        return rows[:, c["in"]] + ring, rows[:, c["out"]] + ring

    def predict_strategy(self, strategy: Strategy) -> Prediction:
        """The prediction for one Strategy (its choices are added to the space)."""
        return self.predict(self.space.encode(strategy)[None, :])

    def _times(self, sums: np.ndarray, sync: np.ndarray, staleness: np.ndarray,
               ready: np.ndarray) -> Prediction:
        cal = self.calibration
        c = self._cols
        w = self.num_replicas
        has_replicas = self.replicas_on > 0
        node_in = sums[:, c["in"]].copy()
        node_out = sums[:, c["out"]].copy()
        groups = sums[:, c["groups"]]
        wire_factor, group_hops = _group_collectives(groups, w)
        ar_wire = (wire_factor * groups).sum(axis=1)
        ag_wire = (w - 1) * sums[:, c["ag_payload"]]
        collective = (ar_wire + ag_wire)[:, None] * has_replicas[None, :]
        node_in += collective
        node_out += collective
        def busiest_s(bytes_in: np.ndarray, bytes_out: np.ndarray) -> np.ndarray:
            return (np.maximum(bytes_in, bytes_out) / self.bandwidth).max(axis=1)

        overlapped_s = busiest_s(node_in, node_out)
        has_ps = sums[:, c["ps_vars"]] > 0
        has_ar = (sums[:, c["ar_vars"]] > 0) & (w > 1)
        mixed = has_ps & has_ar
        # In phases: PS reads in the forward pass, then the gradients' traffic; a
        # mixed step pushes its PS gradients in a second run after the all-reduce.
        pull_in, pull_out = sums[:, c["pull_in"]], sums[:, c["pull_out"]]
        apart_s = (busiest_s(collective, collective)
                   + busiest_s(node_in - collective - pull_in, node_out - collective - pull_out))
        together_s = busiest_s(node_in - pull_in, node_out - pull_out)
        phased_s = busiest_s(pull_in, pull_out) + np.where(mixed, apart_s, together_s)
        overlap = cal.ps_overlap
        bandwidth_s = overlap * overlapped_s + (1 - overlap) * phased_s
        non_empty_groups = (groups > 0).sum(axis=1)
        all_gathers = (sums[:, c["gathers"]] > 0).sum(axis=1)
        collective_hops = 0 if w == 1 else (group_hops.sum(axis=1) + (w - 1) * all_gathers)
        ps_messages = sums[:, c["msgs"]].max(axis=1)
        latency_s = cal.latency_s * ps_messages + cal.hop_latency_s * collective_hops
        # Asynchronous PS applies every replica's update, not one per step.
        updates = np.where(sync, 1.0, float(w))[:, None]
        update_s = (sums[:, c["update"]] * updates).max(axis=1) / cal.memory_bytes_per_s
        sync_s = np.where(has_ps & sync & (staleness == 0), 2 * cal.latency_s, 0.0)
        phase_s = np.where(mixed, cal.run_overhead_s, 0.0)
        compute_s = np.full(len(sums), self.compute_s)
        max_node_bytes = np.maximum(node_in, node_out).max(axis=1)
        # Fixed costs per step and per task, and the CPU's time per byte a task moves.
        overhead_s = cal.task_overhead_s * self.num_tasks + cal.byte_cost_s * max_node_bytes
        overlap_s = cal.backward_overlap * self._hidden_s(groups, ready)
        step = (compute_s + bandwidth_s + latency_s + update_s + sync_s + phase_s + overhead_s
                - overlap_s)
        lower = np.maximum(compute_s, overlapped_s)
        parts = {
            "compute_s": compute_s, "bandwidth_s": bandwidth_s, "latency_s": latency_s,
            "update_s": update_s, "sync_s": sync_s, "phase_s": phase_s, "overlap_s": overlap_s,
            "max_node_bytes": max_node_bytes,
            "sum_node_bytes": (node_in + node_out).sum(axis=1),
            "ps_bytes": sums[:, c["ps_bytes"]], "ps_shards": sums[:, c["ps_shards"]],
            "ps_messages_max": ps_messages, "messages": sums[:, c["msgs"]].sum(axis=1)
            + collective_hops,
            "collective_hops": np.broadcast_to(np.asarray(collective_hops, float), len(sums)),
            "extra_runs": mixed.astype(float),
            "ar_bytes": sums[:, c["ar_bytes"]], "ar_groups": non_empty_groups.astype(float),
            "ag_payload": sums[:, c["ag_payload"]], "ag_count": sums[:, c["ag_count"]],
            "ps_vars": sums[:, c["ps_vars"]], "ar_vars": sums[:, c["ar_vars"]],
            "sparse_ps_bytes": sums[:, c["sparse_ps_bytes"]],
            "var_bytes_on_ps": sums[:, c["var_bytes_on_ps"]],
            "ps_imbalance": _imbalance(sums[:, c["update"]], self.space, self.num_nodes),
            "sync": sync.astype(float), "staleness": staleness.astype(float),
            "replica_memory_bytes": sums[:, c["memory"].start + REPLICA]
            + self.memory.fixed[REPLICA],
            "memory_fraction": self.memory.fractions(sums[:, c["memory"]]),
        }
        return Prediction(step_time_s=step, lower_bound_s=lower, parts=parts)

    def _hidden_s(self, groups: np.ndarray, ready: np.ndarray) -> np.ndarray:
        """Time the fused groups' all-reduces hide behind the backward pass (N,).

        Args:
            groups: (N, G) wire bytes of each fused group (before the ring's factor).
            ready: (N, G) when each group's last gradient exists, as a share of
                the backward pass.

        The additive model pays every group's transfer and fixed cost after
        the backward pass. Here the link serves each group's bytes from the
        time it is ready, in the order they come (the finish time of a
        work-conserving link: the latest, over groups k, of k's ready time plus
        the transfers of the groups ready no earlier); after the backward pass
        the step waits for what is left of it plus one group's fixed cost, and
        at least for every group's fixed cost (CPU work that does not hide
        behind the backward pass's). What the additive model charges beyond
        that is hidden.
        """
        w = self.num_replicas
        if w <= 1:
            return np.zeros(len(groups))
        has_replicas = self.replicas_on > 0
        link = self.bandwidth[has_replicas].min()
        wire_factor, group_hops = _group_collectives(groups, w)
        transfer = wire_factor * groups / link
        fixed = group_hops * self.calibration.hop_latency_s
        count = (groups > 0).sum(axis=1)
        start = np.where(groups > 0, ready, 0.0) * self.backward_s
        # Transfers of the groups ready no earlier than group k, for every k.
        later = (start[:, None, :] >= start[:, :, None]) * transfer[:, None, :]
        finish = (start + later.sum(axis=2)).max(axis=1)
        last = fixed.max(axis=1)
        exposed = np.maximum(np.maximum(finish - self.backward_s, 0.0) + last,
                             fixed.sum(axis=1))
        charged = transfer.sum(axis=1) + fixed.sum(axis=1)
        return np.where(count > 0, np.maximum(charged - exposed, 0.0), 0.0)


def _group_collectives(groups: np.ndarray, replicas: int) -> tuple[np.ndarray, np.ndarray]:
    """Per fused group (N, G): bytes on the wire per byte of the group, and exchanges.

    A ring all-reduce moves 2 (W-1)/W of the group in 2 (W-1) exchanges; a
    small group is gathered and added instead (`ir.strategy.sums_by_gathering`,
    as the kernel decides it, with float32 elements): W-1 group sizes in W-1
    exchanges.
    """
    w = replicas
    if w <= 1:
        return np.zeros_like(groups, dtype=float), np.zeros_like(groups, dtype=float)
    small = sums_by_gathering(groups, w)
    wire = np.where(small, float(w - 1), 2 * (w - 1) / w)
    hops = np.where(groups > 0, np.where(small, float(w - 1), 2.0 * (w - 1)), 0.0)
    return wire, hops


def gradient_ready_fractions(graph_item) -> dict[str, float]:
    """When each variable's gradient exists, as a share of the backward pass (0 to 1).

    The share of the dense gradients' bytes produced up to it in
    `gradient_order`: a dense layer's backward FLOPs grow with its weights. A
    sparse gradient (rows of a lookup) adds nothing to the backward pass.
    (The GraphItem's ops cannot place a gradient more exactly: the tensors it
    records are the tape's identities, created after the whole backward pass.)
    """
    ordered = sorted(graph_item.variables, key=lambda v: v.gradient_order)
    sizes = np.array([0.0 if v.sparse_gradient else float(v.byte_size) for v in ordered])
    done = np.cumsum(sizes) / max(sizes.sum(), 1.0)
    return {v.name: float(f) for v, f in zip(ordered, done)}


def _backward_share(graph_item) -> float:
    """The backward pass's share of a step's FLOPs (2/3 where the ops do not say)."""
    total = sum(op.flops for op in graph_item.ops)
    backward = sum(op.flops for op in graph_item.ops if op.phase == "backward")
    return backward / total if total > 0 and backward > 0 else 2 / 3


def _row_sums(table: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Per candidate, the sum of its table rows: (N, K) row indices -> (N, width).

    Sums a few candidates at a time so that their gathered rows stay in the
    cache; each candidate's rows are added in order, as in
    `table[rows].sum(axis=1)`, so the sums are the same to the bit.
    """
    out = np.empty((len(rows), table.shape[1]))
    step = max(1, _CACHED_ELEMENTS // max(1, rows.shape[1] * table.shape[1]))
    for start in range(0, len(rows), step):
        np.take(table, rows[start:start + step], axis=0).sum(axis=1,
                                                             out=out[start:start + step])
    return out


def _compute_s(graph_item, batch: float, estimate_batch: int, calibration: Calibration,
               sharing: float) -> float:
    """One replica's compute: FLOPs at their rates plus the ops' fixed costs.

    Uncalibrated (`host_cores` 0) the ops' fixed costs are not shared, as the
    default constants always scored; calibrated, a CPU replica that shares
    its host's cores gets its share of them for both.
    """
    flops = graph_item.total_flops * batch / estimate_batch
    conv_rate = calibration.conv_flops_per_s
    if conv_rate is not None:
        conv = sum(op.flops for op in graph_item.ops
                   if op.type.startswith(_CONV_PREFIX)) * batch / estimate_batch
        flops_s = (flops - conv) / calibration.flops_per_s + conv / conv_rate
    else:
        flops_s = flops / calibration.flops_per_s
    ops_s = len(graph_item.ops) * calibration.op_overhead_s
    if calibration.host_cores <= 0:
        return flops_s * sharing + ops_s
    return (flops_s + ops_s) * sharing


# Op types whose FLOPs run at `Calibration.conv_flops_per_s` (Conv2D,
# Conv2DBackpropInput, Conv2DBackpropFilter, Conv3D, ...).
_CONV_PREFIX = ("Conv", "DepthwiseConv")


def _core_sharing(spec, calibration: Calibration) -> float:
    """How much slower a CPU replica computes where a host's CPU replicas outnumber its cores.

    1 without a calibrated `host_cores`, or where every replica is a GPU.
    Tasks with the same address share a host.
    """
    if calibration.host_cores <= 0:
        return 1.0
    replicas = set(spec.replica_devices)
    per_host: dict[str, int] = {}
    for device in spec.devices:
        if device.name in replicas and device.device_type == "CPU":
            host = spec.nodes[device.node_index].address
            per_host[host] = per_host.get(host, 0) + 1
    return max([1.0] + [n / calibration.host_cores for n in per_host.values()])


def _imbalance(update: np.ndarray, space: SearchSpace, num_nodes: int) -> np.ndarray:
    """Max over mean of the bytes each PS node updates (1 = balanced, 0 = no PS)."""
    spec = space.resource_spec
    ps_nodes = sorted({spec.node_of(d) for d in space.ps_devices})
    if not ps_nodes:
        return np.zeros(len(update))
    ps = update[:, ps_nodes]
    mean = ps.mean(axis=1)
    return np.where(mean > 0, ps.max(axis=1) / np.maximum(mean, 1e-30), 0.0)
