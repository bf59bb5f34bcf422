"""The search space: per-variable choices under knowledge constraints.

A candidate is an integer vector: entry `v` picks one of variable `v`'s
options (a complete `VariableConfig`: partition, per-shard placement and
synchronizer) and the last entry picks the job's consistency model. Candidates
are therefore cheap to sample, mutate and score in bulk (a matrix of
candidates is what the simulator and the features work on), and `decode`
turns one into a `Strategy` that always validates.

Knowledge constraints shape the options rather than filtering samples, so a
constraint can never be violated:

* a sparse gradient (embedding) goes to parameter servers or is all-gathered,
  and partitions only along axis 0 (unpartitioned under all-reduce). It is
  densified and all-reduced (in a fusion slot, with dense gradients) only
  where that can help: when the table is no larger than the rows the
  replicas' lookups move per step (one row per lookup, repeats included), as
  for a small vocabulary looked up many times per example;
* a dense variable partitions along its first partitionable axis;
* shards are bounded by `max_shards` and by `min_shard_bytes`, and the shards
  of a variable sit on distinct parameter servers;
* fused all-reduce groups are bounded by `max_groups` per compressor;
* at scale (more parameter-server devices than `exhaustive_ps_devices`)
  the PS layouts are thinned, since their number grows with the square of
  the devices (and splits with the cube): a variable is split into a power
  of two or the largest number of shards, the shards of an n-way split sit
  on one of the aligned blocks of n consecutive devices (which tile the
  devices, so load still spreads), and splits between PS and all-reduce
  are left out. With 32 PS devices a dense variable then has 130 options
  instead of about 75,000;
* local replication is offered only where it can help: on a node that runs
  more than one replica (it saves repeated pulls by the replicas of a node);
* memory: an option is left out when it cannot fit, i.e. when some device's
  memory (`autodist.search.memory`) would overflow with it even if every
  other variable took its smallest option (a 2 GB table on 1 GB GPUs is
  never mirrored on them); what is left out is kept in `memory_refusals`
  for `explain`. Whether a whole candidate fits is the simulator's check
  (`Prediction.fits`): the tuner never picks one that does not;
* a dense variable may also be split between the two kinds: its first
  shards on distinct parameter servers, the others all-reduced in one fusion
  slot. It spreads the gradient traffic over the PS links and the workers'
  links: ring all-reduce moves 2(W-1)/W of the bytes through each worker
  link, a PS W/P of them through its own. Whether that pays depends on how
  much the phases of a step overlap (PS reads in the forward pass; a mixed
  step pushes after its all-reduce), which the simulator models.

Compressors and asynchronous consistency change the numbers a run produces,
so the defaults keep training exactly synchronous and uncompressed; pass
`compressors=` and `consistency=` to search over them.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence

import numpy as np

from autodist.ir.device_names import op_name
from autodist.ir.errors import InvalidArgumentError
from autodist.ir.graph_item import GraphItem, VariableInfo, gradient_clipping
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy, is_gathered
from autodist.proto import strategy_pb2
from autodist.search.memory import DoesNotFitError, MemoryModel, MemoryRefusal, format_bytes

AllReduceSynchronizer = strategy_pb2.AllReduceSynchronizer

_COMPRESSORS = {"none": AllReduceSynchronizer.NONE, "fp16": AllReduceSynchronizer.FP16,
                "fp16_error_feedback": AllReduceSynchronizer.FP16_ERROR_FEEDBACK}
NUM_COMPRESSORS = len(_COMPRESSORS)


@dataclasses.dataclass(frozen=True)
class Consistency:
    """The job's consistency model for parameter-server variables.

    Attributes:
        sync: Aggregate every replica's gradient before one update per step.
        staleness: With sync, how many steps a replica may run ahead (0 =
            fully synchronous).
    """

    sync: bool = True
    staleness: int = 0

    @classmethod
    def parse(cls, text: str | Consistency) -> Consistency:
        """Reads "sync", "async" or "ssp:<s>" (bounded staleness s >= 1)."""
        if isinstance(text, Consistency):
            return text
        if text == "sync":
            return cls()
        if text == "async":
            return cls(sync=False)
        if isinstance(text, str) and text.startswith("ssp:"):
            try:
                staleness = int(text[4:])
            except ValueError:
                staleness = -1
            if staleness >= 1:
                return cls(staleness=staleness)
        raise InvalidArgumentError(f"unknown consistency {text!r}; expected 'sync', 'async' or "
                                   "'ssp:<staleness >= 1>'")

    def __str__(self) -> str:
        if not self.sync:
            return "async"
        return f"ssp:{self.staleness}" if self.staleness else "sync"


@dataclasses.dataclass(frozen=True)
class SpaceOptions:
    """Bounds and switches of the search space.

    Attributes:
        max_shards: Most shards of one variable (default: the number of
            parameter-server devices).
        min_shard_bytes: Smallest shard worth making.
        max_groups: Fused all-reduce groups per compressor.
        compressors: Compressors to consider for all-reduce.
        consistency: Consistency models to consider for PS variables
            ("sync", "async", "ssp:<s>").
        allow_ps: Offer parameter-server placements (when the spec has PS).
        allow_all_reduce: Offer all-reduce / all-gather (with >= 1 replica).
        allow_local_replication: Offer local replication where it can help.
        allow_hybrid: Offer dense variables split between parameter servers
            and all-reduce (at most `max_shards`, by default the number of PS
            devices + 2, shards; at least one of each kind).
        exhaustive_ps_devices: Up to this many PS devices, every shard count
            and every rotation of the PS layouts is offered; beyond, shard
            counts are powers of two (and the largest), layouts are aligned
            blocks, and splits between PS and all-reduce are left out.
    """

    max_shards: int | None = None
    min_shard_bytes: int = 64 * 1024
    max_groups: int = 4
    compressors: tuple[str, ...] = ("none",)
    consistency: tuple[str, ...] = ("sync",)
    allow_ps: bool = True
    allow_all_reduce: bool = True
    allow_local_replication: bool = True
    allow_hybrid: bool = True
    exhaustive_ps_devices: int = 4

    def __post_init__(self) -> None:
        if self.max_shards is not None and self.max_shards < 1:
            raise InvalidArgumentError(f"max_shards must be >= 1. Received: {self.max_shards!r}")
        if self.min_shard_bytes < 1:
            raise InvalidArgumentError("min_shard_bytes must be >= 1. Received: "
                                       f"{self.min_shard_bytes!r}")
        if self.exhaustive_ps_devices < 1:
            raise InvalidArgumentError(f"exhaustive_ps_devices must be >= 1. "
                                       f"Received: {self.exhaustive_ps_devices!r}")
        if self.max_groups < 1:
            raise InvalidArgumentError(f"max_groups must be >= 1. Received: {self.max_groups!r}")
        for name in self.compressors:
            if name not in _COMPRESSORS:
                raise InvalidArgumentError(f"unknown compressor {name!r}; expected one of "
                                           f"{sorted(_COMPRESSORS)}")
        if not self.compressors:
            raise InvalidArgumentError("compressors must name at least one compressor")
        if not self.consistency:
            raise InvalidArgumentError("consistency must name at least one model")
        for text in self.consistency:
            Consistency.parse(text)
        if not (self.allow_ps or self.allow_all_reduce):
            raise InvalidArgumentError("allow_ps and allow_all_reduce cannot both be False")


class SearchSpace:
    """Every strategy the search may pick for one GraphItem on one ResourceSpec.

    Args:
        graph_item, resource_spec: The workload.
        options: Bounds and switches of the space.
        batch_size: The global batch size (default: the GraphItem's estimate
            batch per replica); memory is checked at it.

    Attributes:
        graph_item, resource_spec: The workload.
        batch_size: The global batch size memory is checked at.
        memory: The memory model options are checked with.
        memory_refusals: Per variable, the options left out because they
            cannot fit.
        variables: The trainable variables, in the GraphItem's order.
        options: options[v] lists variable v's `VariableConfig`s; an all-reduce
            synchronizer's `group` holds a fusion slot that `decode` turns into
            a group id.
        consistencies: The job-level consistency choices (last candidate entry).

    Example:
        >>> space = SearchSpace(gi, spec)                    # doctest: +SKIP
        >>> c = space.sample(1, np.random.default_rng(0))[0] # doctest: +SKIP
        >>> space.decode(c).validate(gi, spec)               # doctest: +SKIP
    """

    def __init__(self, graph_item: GraphItem, resource_spec: ResourceSpec,
                 options: SpaceOptions | None = None, batch_size: int | None = None) -> None:
        self.graph_item = graph_item
        self.resource_spec = resource_spec
        self.config = options or SpaceOptions()
        self.variables: list[VariableInfo] = list(graph_item.variables)
        if not self.variables:
            raise InvalidArgumentError(f"GraphItem {graph_item.name!r} has no trainable variables "
                                       "to distribute")
        self.consistencies = [Consistency.parse(c) for c in self.config.consistency]
        self.ps_devices = list(resource_spec.ps_devices) if self.config.allow_ps else []
        # A clipping norm is computed within one update group (Strategy.validate):
        # clipnorm keeps each variable on one kind of synchronizer, global_clipnorm
        # every variable (all-reduce where allowed).
        clipping = gradient_clipping(graph_item.optimizer.hyperparameters)
        self.clipping = clipping[0] if clipping and clipping[0] != "clipvalue" else None
        # Dynamic loss scaling checks every gradient of a step at once, as a global
        # norm does: every variable all-reduced, or every one on synchronous PS,
        # without error-feedback residuals (Strategy.validate).
        self.loss_scaling = graph_item.optimizer.HasField("loss_scale")
        self.one_group = self.clipping == "global_clipnorm" or self.loss_scaling
        if self.one_group and self.config.allow_all_reduce:
            self.ps_devices = []
        if self.loss_scaling:
            self.consistencies = [c for c in self.consistencies
                                  if c.sync and not c.staleness] or [Consistency()]
        self.compressors = tuple(name for name in self.config.compressors
                                 if not (self.loss_scaling and name == "fp16_error_feedback"))
        self.replicas_per_node = _replicas_per_node(resource_spec)
        self.lookups_per_example = lookups_per_example(graph_item)
        replicas = len(resource_spec.replica_devices)
        self.batch_size = batch_size or graph_item.estimate_batch_size * replicas
        if self.batch_size < 1:
            raise InvalidArgumentError(f"batch_size must be >= 1. Received: {self.batch_size}")
        self.memory = MemoryModel(graph_item, resource_spec, self.batch_size,
                                  self.lookups_per_example)
        self.options: list[list[strategy_pb2.VariableConfig]] = [
            self._variable_options(v) for v in self.variables]
        self.memory_refusals: list[list[MemoryRefusal]] = self._fit_to_memory()
        self._num_slots = self.config.max_groups
        self._priors: dict[int, np.ndarray] = {}  # per variable, for its option count

    # ------------------------------------------------------------ the space
    @property
    def num_variables(self) -> int:
        return len(self.variables)

    @property
    def num_slots(self) -> int:
        """Fusion slots per compressor (seeds may add slots beyond max_groups)."""
        return self._num_slots

    @property
    def option_counts(self) -> np.ndarray:
        """Options per candidate entry: one per variable, then the consistency."""
        return np.array([len(o) for o in self.options] + [len(self.consistencies)],
                        dtype=np.int64)

    @property
    def size(self) -> int:
        """The number of distinct candidates (an exact integer)."""
        return math.prod(int(n) for n in self.option_counts)

    def sample(self, n: int, rng: np.random.Generator,
               prior: str = "uniform") -> np.ndarray:
        """`n` candidates drawn independently per entry.

        Args:
            n: Number of candidates.
            rng: The random generator (seed it for reproducible searches).
            prior: "uniform" over each entry's options, or "knowledge": two
                thirds of the mass on the kind (PS / all-reduce) that usually
                wins for the variable (PS for sparse gradients, all-reduce for
                dense ones), spread evenly within each kind.

        Returns:
            An (n, num_variables + 1) int64 matrix.
        """
        if prior not in ("uniform", "knowledge"):
            raise InvalidArgumentError(f"unknown prior {prior!r}; expected 'uniform' or "
                                       "'knowledge'")
        counts = self.option_counts
        out = np.empty((n, len(counts)), dtype=np.int64)
        for j, count in enumerate(counts):
            if prior == "uniform" or j == self.num_variables:
                out[:, j] = rng.integers(0, count, size=n)
            else:
                out[:, j] = rng.choice(count, size=n, p=self._knowledge_prior(j))
        return out

    def _knowledge_prior(self, v: int) -> np.ndarray:
        cached = self._priors.get(v)
        if cached is not None and len(cached) == len(self.options[v]):
            return cached
        self._priors[v] = self._compute_knowledge_prior(v)
        return self._priors[v]

    def _compute_knowledge_prior(self, v: int) -> np.ndarray:
        kinds = [{s.WhichOneof("kind") for s in c.shards} for c in self.options[v]]
        want = "ps" if self.variables[v].sparse_gradient else "all_reduce"
        # Options split between the kinds count as not preferred.
        preferred = np.array([k == {want} for k in kinds])
        weights = np.ones(len(kinds))
        if preferred.any() and (~preferred).any():
            weights[preferred] = 2.0 / preferred.sum()
            weights[~preferred] = 1.0 / (~preferred).sum()
        return weights / weights.sum()

    # ------------------------------------------------------ encode / decode
    def decode(self, candidate: Sequence[int], origin: str = "search") -> Strategy:
        """The Strategy a candidate stands for (validated against the workload)."""
        candidate = np.asarray(candidate)
        if candidate.shape != (self.num_variables + 1,):
            raise InvalidArgumentError(f"a candidate has {self.num_variables + 1} entries "
                                       "(variables + consistency). Received shape "
                                       f"{candidate.shape}")
        consistency = self.consistencies[int(candidate[-1])]
        proto = strategy_pb2.Strategy(origin=origin,
                                      graph_item_fingerprint=self.graph_item.fingerprint,
                                      resource_spec_fingerprint=self.resource_spec.fingerprint)
        proto.graph_config.replicas.extend(self.resource_spec.replica_devices)
        configs = [self.options[v][int(candidate[v])] for v in range(self.num_variables)]
        group_ids = self._group_ids(configs)
        for v, template in enumerate(configs):
            config = proto.variables.add()
            config.CopyFrom(template)
            for k, shard in enumerate(config.shards):
                if shard.WhichOneof("kind") == "ps":
                    shard.ps.sync = consistency.sync
                    shard.ps.staleness = consistency.staleness
                else:
                    shard.all_reduce.group = group_ids[(v, k)]
        strategy = Strategy(proto)
        strategy.validate(self.graph_item, self.resource_spec)
        return strategy

    def _group_ids(self, configs: list[strategy_pb2.VariableConfig]) -> dict[tuple[int, int], int]:
        """Fusion slots → group ids in order of first gradient; all-gathered → one each.

        Slots are namespaced by compressor (and dtype), because a fused group
        must agree on them.
        """
        dense: dict[tuple[int, int, str], list[tuple[int, int]]] = {}
        sparse: list[tuple[int, int]] = []
        for v, config in enumerate(configs):
            var = self.variables[v]
            for k, shard in enumerate(config.shards):
                if shard.WhichOneof("kind") != "all_reduce":
                    continue
                if is_gathered(shard.all_reduce, var.sparse_gradient):
                    sparse.append((var.gradient_order, v, k))
                else:
                    key = (shard.all_reduce.group, shard.all_reduce.compressor, var.dtype)
                    dense.setdefault(key, []).append((var.gradient_order, v, k))
        ordered = sorted(dense.values(), key=lambda members: min(members))
        ids: dict[tuple[int, int], int] = {}
        for gid, members in enumerate(ordered):
            for _order, v, k in members:
                ids[(v, k)] = gid
        for gid, (_order, v, k) in enumerate(sorted(sparse), start=len(ordered)):
            ids[(v, k)] = gid
        return ids

    def admits(self, strategy: Strategy) -> bool:
        """Whether `strategy`'s choices may join the space (seeds): with a clipping
        norm, only choices that keep every candidate valid."""
        kinds = [{s.WhichOneof("kind") for s in c.shards} for c in strategy.variables]
        if self.clipping == "clipnorm":
            return all(len(k) == 1 for k in kinds)
        if self.one_group:
            groups = set().union(*kinds) <= ({"ps"} if self.ps_devices else {"all_reduce"})
            return groups and (not self.loss_scaling or _no_residuals_nor_async(strategy))
        return True

    def encode(self, strategy: Strategy) -> np.ndarray:
        """The candidate of `strategy`, adding its choices as options when missing.

        Used to seed the search with builders' strategies and to score any
        strategy with the same tables. Fused groups of the strategy become
        slots (so adding may grow `num_slots`); its PS consistency must be
        one of the space's consistencies, or it is added too.

        Raises:
            ValueError: The strategy names other variables than the GraphItem.
        """
        by_name = {c.var_name: c for c in strategy.variables}
        names = [v.name for v in self.variables]
        if set(by_name) != set(names):
            missing = sorted(set(names) - set(by_name))
            extra = sorted(set(by_name) - set(names))
            raise InvalidArgumentError(f"strategy does not match the space's variables: missing "
                                       f"{missing}, unknown {extra}")
        candidate = np.zeros(self.num_variables + 1, dtype=np.int64)
        consistency = Consistency()
        for v, name in enumerate(names):
            config = strategy_pb2.VariableConfig()
            config.CopyFrom(by_name[name])
            for shard in config.shards:
                if shard.WhichOneof("kind") == "ps":
                    consistency = Consistency(shard.ps.sync, shard.ps.staleness)
                    shard.ps.sync, shard.ps.staleness = True, 0
                else:
                    self._num_slots = max(self._num_slots, shard.all_reduce.group + 1)
            try:
                candidate[v] = next(i for i, o in enumerate(self.options[v]) if o == config)
            except StopIteration:
                self.options[v].append(config)
                candidate[v] = len(self.options[v]) - 1
        if consistency not in self.consistencies:
            self.consistencies.append(consistency)
        candidate[-1] = self.consistencies.index(consistency)
        return candidate

    # ---------------------------------------------------------- the options
    def _variable_options(self, var: VariableInfo) -> list[strategy_pb2.VariableConfig]:
        options = self._ps_options(var)
        if self.config.allow_all_reduce:
            options += self._all_reduce_options(var)
            if self.config.allow_hybrid and self.clipping is None and not self.loss_scaling:
                options += self._hybrid_options(var)
        if not options:
            raise InvalidArgumentError(f"variable {var.name!r} has no option in this space: no PS "
                                       "device and all-reduce disabled")
        return options

    def _ps_options(self, var: VariableInfo) -> list[strategy_pb2.VariableConfig]:
        devices = self.ps_devices
        if not devices:
            return []
        local = [False]
        if self.config.allow_local_replication and max(self.replicas_per_node) > 1:
            local.append(True)
        options = []
        axis = _axis(var)
        limit = min(self.config.max_shards or len(devices), len(devices))
        max_shards = 1
        if axis is not None:
            max_shards = max(1, min(limit, var.shape[axis],
                                    var.byte_size // self.config.min_shard_bytes))
        for replicate in local:
            for device in devices:
                options.append(strategy_pb2.VariableConfig(
                    var_name=var.name, shards=[_ps(device, replicate)]))
            for n in self._shard_counts(max_shards):
                for layout in self._ps_layouts(n):
                    config = strategy_pb2.VariableConfig(var_name=var.name)
                    config.partitioner.axis = axis
                    config.partitioner.num_shards = n
                    config.shards.extend(_ps(device, replicate) for device in layout)
                    options.append(config)
        return options

    @property
    def at_scale(self) -> bool:
        """Whether PS layouts are thinned (more PS devices than `exhaustive_ps_devices`)."""
        return len(self.ps_devices) > self.config.exhaustive_ps_devices

    def _shard_counts(self, max_shards: int) -> list[int]:
        """Shard counts from 2 to `max_shards`; at scale powers of two and the largest."""
        if not self.at_scale:
            return list(range(2, max_shards + 1))
        powers = {1 << k for k in range(1, max_shards.bit_length()) if 1 << k <= max_shards}
        return sorted(powers | ({max_shards} if max_shards >= 2 else set()))

    def _ps_layouts(self, n: int) -> list[tuple[str, ...]]:
        """n distinct consecutive PS devices; rotations differ only when some are left out.

        At scale, only the aligned blocks: starts at multiples of n.
        """
        devices = self.ps_devices
        starts = range(len(devices)) if n < len(devices) else range(1)
        if self.at_scale and n < len(devices):
            starts = range(0, len(devices), n)
        return [tuple(devices[(start + k) % len(devices)] for k in range(n)) for start in starts]

    def _dense_all_reduce(self, var: VariableInfo) -> list[strategy_pb2.Synchronizer]:
        """All-reduce synchronizers (spec AUTO) for every compressor and fusion slot."""
        floating = var.dtype.startswith("float")
        return [strategy_pb2.Synchronizer(all_reduce=AllReduceSynchronizer(
                    spec=AllReduceSynchronizer.AUTO, compressor=_COMPRESSORS[name], group=slot))
                for name in self.compressors
                if floating or _COMPRESSORS[name] == AllReduceSynchronizer.NONE
                for slot in range(self.config.max_groups)]

    def _all_reduce_options(self, var: VariableInfo) -> list[strategy_pb2.VariableConfig]:
        if not var.sparse_gradient:
            return [strategy_pb2.VariableConfig(var_name=var.name, shards=[sync])
                    for sync in self._dense_all_reduce(var)]
        options = []
        floating = var.dtype.startswith("float")
        for name in self.compressors:
            compressor = _COMPRESSORS[name]
            if compressor != AllReduceSynchronizer.NONE and not floating:
                continue
            if compressor == AllReduceSynchronizer.FP16_ERROR_FEEDBACK:
                continue  # the residual is dense
            options.append(strategy_pb2.VariableConfig(var_name=var.name, shards=[
                strategy_pb2.Synchronizer(all_reduce=AllReduceSynchronizer(
                    spec=AllReduceSynchronizer.ALL_GATHER, compressor=compressor))]))
        if self._densify_can_help(var):
            for sync in self._dense_all_reduce(var):
                sync.all_reduce.spec = AllReduceSynchronizer.RING
                options.append(strategy_pb2.VariableConfig(var_name=var.name, shards=[sync]))
        return options

    def _densify_can_help(self, var: VariableInfo) -> bool:
        """Whether the table is no larger than the rows all replicas' lookups move per step.

        Ring all-reduce moves 2(W-1)/W of the table through each worker link;
        all-gather (W-1) replicas' rows. At the GraphItem's estimate batch
        per replica, densifying can win only below that bound (the cost
        model decides).
        """
        rows = self.lookups_per_example.get(var.name, 0.0) * self.graph_item.estimate_batch_size
        dim = var.shape[0] if var.shape else 1
        return dim <= rows * len(self.resource_spec.replica_devices)

    def _hybrid_options(self, var: VariableInfo) -> list[strategy_pb2.VariableConfig]:
        """A dense variable's first shards on parameter servers, the rest all-reduced.

        n even shards, j of them on distinct consecutive PS devices (every
        rotation when some devices are left out), the other n - j in one
        fusion slot: the PS carries j/n of the bytes. Options for n from 2 to
        the shard bound, j from 1 to min(PS devices, n - 1), every slot and
        compressor.
        """
        devices = self.ps_devices
        axis = _axis(var)
        if var.sparse_gradient or not devices or axis is None or self.at_scale:
            return []
        limit = self.config.max_shards or len(devices) + 2
        max_shards = min(limit, var.shape[axis], var.byte_size // self.config.min_shard_bytes)
        all_reduce = self._dense_all_reduce(var)
        options = []
        for n in range(2, max_shards + 1):
            for j in range(1, min(len(devices), n - 1) + 1):
                for layout, sync in itertools.product(self._ps_layouts(j), all_reduce):
                    config = strategy_pb2.VariableConfig(var_name=var.name)
                    config.partitioner.axis = axis
                    config.partitioner.num_shards = n
                    config.shards.extend(_ps(device, False) for device in layout)
                    config.shards.extend([sync] * (n - j))
                    options.append(config)
        return options

    def _fit_to_memory(self) -> list[list[MemoryRefusal]]:
        """Leaves out the options that cannot fit, to a fixed point.

        An option cannot fit when a pool overflows with it and every other
        variable at its smallest bytes per column (a lower bound of what
        they need). Leaving options out can raise those bounds, so the
        check repeats until nothing changes.

        Raises:
            DoesNotFitError: A variable has no option that can fit.
        """
        refusals: list[list[MemoryRefusal]] = [[] for _ in self.variables]
        memory = self.memory
        if not memory.constrained:
            return refusals
        columns = [np.array([memory.config_columns(var, c) for c in options])
                   for var, options in zip(self.variables, self.options)]
        lows = np.array([c.min(axis=0) for c in columns])
        changed = True
        while changed:
            changed = False
            for v, var in enumerate(self.variables):
                others = lows.sum(axis=0) - lows[v]
                used = memory.pool_bytes(columns[v] + others)
                ratio = np.where(np.isfinite(memory.capacities), used / memory.capacities, 0.0)
                keep = ratio.max(axis=1) <= 1.0
                if keep.all():
                    continue
                if not keep.any():
                    raise self._does_not_fit(var, used, ratio)
                for i in np.flatnonzero(~keep):
                    pool = int(np.argmax(ratio[i]))
                    refusals[v].append(MemoryRefusal(self.options[v][i], memory.pools[pool],
                                                     float(used[i, pool])))
                self.options[v] = [o for o, k in zip(self.options[v], keep) if k]
                columns[v] = columns[v][keep]
                lows[v] = columns[v].min(axis=0)
                changed = True
        return refusals

    def _does_not_fit(self, var: VariableInfo, used: np.ndarray,
                      ratio: np.ndarray) -> DoesNotFitError:
        best = int(np.argmin(ratio.max(axis=1)))
        pool = int(np.argmax(ratio[best]))
        return DoesNotFitError(
            f"variable {var.name!r} ({format_bytes(var.byte_size)}, "
            f"{'sparse' if var.sparse_gradient else 'dense'} gradient) fits no device: its "
            f"smallest option needs {format_bytes(used[best, pool])} in "
            f"{self.memory.pools[pool].name} (capacity "
            f"{format_bytes(self.memory.pools[pool].capacity_bytes)}), with every other "
            f"variable at its smallest and a batch of {self.batch_size}; add devices or "
            "memory, allow parameter servers, or lower the batch")

    def describe(self) -> str:
        """A one-paragraph account of the space (size, options, constraints)."""
        counts = self.option_counts
        return (f"search space of {self.graph_item.name!r} on "
                f"{self.resource_spec.num_worker_tasks} "
                f"worker task(s), {len(self.ps_devices)} PS device(s): {self.num_variables} "
                f"variables, {int(counts[:-1].min())}..{int(counts[:-1].max())} options each, "
                f"{len(self.consistencies)} consistency choice(s); "
                f"size 10^{math.log10(self.size):.1f}")


def _ps(device: str, local_replication: bool) -> strategy_pb2.Synchronizer:
    # sync/staleness are filled in from the candidate's consistency by decode.
    return strategy_pb2.Synchronizer(ps=strategy_pb2.PSSynchronizer(
        reduction_destination=device, local_replication=local_replication, sync=True))


def _no_residuals_nor_async(strategy: Strategy) -> bool:
    """No shard of `strategy` keeps an error-feedback residual or updates asynchronously."""
    if strategy.is_asynchronous:
        return False
    return not any(shard.WhichOneof("kind") == "all_reduce" and
                   shard.all_reduce.compressor == AllReduceSynchronizer.FP16_ERROR_FEEDBACK
                   for config in strategy.variables for shard in config.shards)


def _axis(var: VariableInfo) -> int | None:
    """Embeddings split along rows; dense variables along their first allowed axis."""
    axes = list(var.partitionable_axes)
    if var.sparse_gradient:
        return 0 if 0 in axes else None
    return axes[0] if axes else None


def lookups_per_example(graph_item: GraphItem) -> dict[str, float]:
    """Rows each sparse variable's gradient holds per example (one per lookup).

    From the size of the gradient's values tensor at the GraphItem's
    estimate batch; 1.0 when the capture did not record it.
    """
    ops = {op.name: op for op in graph_item.ops}
    estimate = graph_item.estimate_batch_size
    out = {}
    for var in graph_item.variables:
        if not var.sparse_gradient:
            continue
        row_bytes = var.byte_size / max(1, var.shape[0] if var.shape else 1)
        op = ops.get(op_name(var.gradient.values))
        out[var.name] = (op.output_bytes / row_bytes / estimate
                         if op and op.output_bytes else 1.0)
    return out


def _replicas_per_node(spec: ResourceSpec) -> list[int]:
    counts = [0] * len(spec.nodes)
    for device in spec.replica_devices:
        counts[spec.node_of(device)] += 1
    return counts
