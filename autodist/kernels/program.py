"""Program: the distributed step as it is lowered, pass by pass.

Every kernel pass has the signature ``apply(program, strategy) -> program``
and checks the stage it needs:

    CAPTURED --partitioner--> PARTITIONED --replicator--> REPLICATED
             --synchronizer--> SYNCHRONIZED

A Program is built for one TensorFlow task (one worker process): it holds the
replicas that run on that task. Passes add to its `graph`; nothing here
launches processes or runs a session.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

from autodist.ir.errors import AutodistError
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy


class Stage(enum.IntEnum):
    CAPTURED = 0
    PARTITIONED = 1
    REPLICATED = 2
    SYNCHRONIZED = 3


class StageError(AutodistError, RuntimeError):
    """A pass was applied to a program at the wrong lowering stage."""


@dataclasses.dataclass
class Shard:
    """One stored piece of a variable (the whole variable if unpartitioned).

    Attributes:
        var_name: The variable's name in the GraphItem.
        index: Shard index (0 for an unpartitioned variable).
        num_shards: Number of shards of the variable.
        axis: Partition axis (0 if unpartitioned).
        offset: Start of the shard along `axis`.
        shape: Shape of the shard.
        dtype: TensorFlow dtype name.
        sparse: The variable's gradient is IndexedSlices.
        synchronizer: The strategy's Synchronizer proto for this shard.
        placeholder: Name of the resource placeholder standing for this
            shard in the rewritten GraphDef.
    """

    var_name: str
    index: int
    num_shards: int
    axis: int
    offset: int
    shape: list[int]
    dtype: str
    sparse: bool
    synchronizer: Any
    placeholder: str

    @property
    def name(self) -> str:
        """Unique storage name, e.g. "dense/kernel/part_1"."""
        return self.var_name if self.num_shards == 1 else f"{self.var_name}/part_{self.index}"

    @property
    def kind(self) -> str:
        """"ps" or "all_reduce"."""
        return self.synchronizer.WhichOneof("kind")


@dataclasses.dataclass
class VirtualNode:
    """One virtual node: a copy of the step on its part of the global batch.

    Attributes:
        index: Index of the virtual node among all of the strategy's.
        inputs: Input name -> its part of the replica's inputs.
        weight: Its share of its replica's examples (a scalar tensor; None
            for a replica's only virtual node).
        loss: Its mean loss.
        gradients: Variable name -> gradient of its mean loss; times `weight`
            when `weighted`.
        weighted: The weight seeded its backward pass, so `gradients` are
            those of its weighted loss (see `replicator.gradient_seed`).
        metric_states: Per metric variable of the capture, its batch's
            contribution to the metric's state.
    """

    index: int
    inputs: dict[str, Any] = dataclasses.field(default_factory=dict)
    weight: Any = None
    loss: Any = None
    gradients: dict[str, Any] = dataclasses.field(default_factory=dict)
    weighted: bool = False
    metric_states: list[Any] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Replica:
    """One compute replica built into the program.

    Attributes:
        index: Index of the replica among all replicas of the strategy.
        device: Its device.
        virtual_nodes: The virtual nodes it runs, one after the other (one
            when the strategy has no virtual nodes).
        inputs: Input name -> placeholder: feed the examples of its virtual
            nodes, in their order, one after the other.
        sizes: With several virtual nodes, an int32 placeholder: how many
            examples of `inputs` each one reads. None with one.
        default_sizes: What `sizes` is when not fed (each virtual node's share
            of the strategy's global batch); feed it only when they differ.
        all_sizes: Where the step draws random numbers for the global batch
            (`random_draws`), an int32 placeholder: the examples of every
            virtual node of the strategy in the step (feed it every step);
            else None.
        loss: The replica's mean loss (its virtual nodes' losses weighted by
            examples).
        gradients: Variable name -> dense tensor or tf.IndexedSlices: the
            gradient of `loss`.
        state_updates: Ops updating state variables (batch-norm statistics).
        scale: A float placeholder: the replica's share of the global batch's
            examples in the step (fed every step).
    """

    index: int
    device: str
    virtual_nodes: list[VirtualNode] = dataclasses.field(default_factory=list)
    inputs: dict[str, Any] = dataclasses.field(default_factory=dict)
    sizes: Any = None
    default_sizes: list[int] | None = None
    all_sizes: Any = None
    loss: Any = None
    gradients: dict[str, Any] = dataclasses.field(default_factory=dict)
    state_updates: list[Any] = dataclasses.field(default_factory=list)
    scale: Any = None


@dataclasses.dataclass
class SyncOutputs:
    """What the synchronizer pass builds for a task to run (set at SYNCHRONIZED).

    Attributes:
        train_op: Runs one step of the task's replicas (and, in one phase,
            their parameter-server work).
        ps_op: With two phases (a step that all-reduces and pushes to
            parameter servers), the PS work to run after `train_op`; else None.
        after_step: A non-chief task's wait for the chief's synchronous PS
            update (and the refresh of its local copies); else None.
        scales: Replica index -> a float placeholder: its share of the
            global batch.
        weighted_loss: This task's part of the global loss (its replicas'
            mean losses times their shares).
        step: The number of updates applied (a shared int64 variable).
        ssp: Asynchronous PS: (tick op, clocks read, staleness bound); else None.
        asynchronous: Some shard applies each replica's update on its own.
        refresh: Copies the PS values into this task's local copies (run
            once the PS is initialized); None without local copies.
        learning_rate: This task's fixed learning rate (a float32 variable,
            initialized to the captured rate, that the worker sets: the
            model's rate at the start, a callback's between epochs); None for
            a schedule or a rate the strategy fixes.
        run_outs: An int64 placeholder (default 0) that every run of a step
            is fed: the iterations Keras' fit counted beyond the updates
            applied, one per epoch that ended with its step finding the
            data's end (`autodist.runtime.run_outs`); the optimizer's update
            count is `step` plus it. None under loss scaling (which counts
            finite steps).
    """

    train_op: Any
    ps_op: Any
    after_step: Any
    scales: dict[int, Any]
    weighted_loss: Any
    step: Any
    ssp: tuple[Any, Any, int] | None
    asynchronous: bool
    refresh: Any
    learning_rate: Any = None
    run_outs: Any = None


@dataclasses.dataclass(frozen=True)
class StorageRole:
    """What a storage variable holds, so no one parses its name.

    Attributes:
        kind: "variable" (a shard of a trainable variable), "slot" (an
            optimizer slot of one), "local_copy" (a task's copy of a PS
            shard), "state" (a virtual node's copy of a state variable),
            "shared" (a scalar every task shares: counters, flags),
            "residual" (a replica's error-feedback residual of one
            all-reduced shard: what its compressor has not yet sent),
            "residual_step" (the update count at which a replica last wrote
            its residuals), or "internal" (stashes: start at their initial
            value).
        shard: The shard's storage name ("variable", "slot", "local_copy",
            "residual").
        slot: The slot's name ("slot").
        state: The state variable's name ("state").
        replica: The replica whose mirrored copy this is (None: one copy
            shared by every task, i.e. on a parameter server); for a
            "residual", the replica whose compressor keeps it.
        virtual_node: The virtual node of a "state" copy.
        square: A "residual" of the summed squares of a densified sparse
            shard's rows (reduced beside its gradient), not of the gradient.
    """

    kind: str
    shard: str | None = None
    slot: str | None = None
    state: str | None = None
    replica: int | None = None
    virtual_node: int | None = None
    square: bool = False

    @property
    def on_parameter_server(self) -> bool:
        """One variable for the whole job (the chief initializes it)."""
        return self.kind == "shared" or (self.kind in ("variable", "slot")
                                         and self.replica is None)


@dataclasses.dataclass
class Program:
    """The distributed program of one task, built by the kernel passes.

    Attributes:
        graph_item: The captured step.
        resource_spec: The cluster.
        task: (job, index) of the task this program runs on.
        stage: How far it is lowered.
        graph_def: The step's GraphDef (rewritten by the partitioner).
        shards: Variable name -> its shards (set by the partitioner).
        graph: The tf.Graph being built (set by the replicator).
        storage: Shard name -> the variable holding it on this task's view.
        local_copies: Shard name -> this task's local copy of a PS shard with
            `local_replication` (what its replicas read; set by the replicator).
        replicas: Replicas on this task (set by the replicator).
        roles: Storage name -> what it holds (see `StorageRole`).
        metric_states: Per metric variable of the capture, this task's
            contribution to its state in a step (set by the replicator).
        outputs: What a task runs (set by the synchronizer).
        collective_timeout_s: Bound on every collective the passes build (0:
            none; see `SyncOptions.timeout_s`).
        version: Membership version of an elastic job (its collectives' group).
        step_collectives: The replicas' steps themselves sum over replicas
            (`global_batch`: batch statistics, masked losses' counts; set by the
            replicator).
        tables: Placeholder of a lookup table in the step -> this task's copy of
            it (set by the replicator).
        table_initializers: Ops filling those copies (run once, at start).
    """

    graph_item: GraphItem
    resource_spec: ResourceSpec
    task: tuple[str, int]
    stage: Stage = Stage.CAPTURED
    graph_def: Any = None
    shards: dict[str, list[Shard]] = dataclasses.field(default_factory=dict)
    graph: Any = None
    storage: dict[str, Any] = dataclasses.field(default_factory=dict)
    local_copies: dict[str, Any] = dataclasses.field(default_factory=dict)
    replicas: list[Replica] = dataclasses.field(default_factory=list)
    roles: dict[str, StorageRole] = dataclasses.field(default_factory=dict)
    metric_states: list[Any] = dataclasses.field(default_factory=list)
    outputs: SyncOutputs | None = None
    collective_timeout_s: float = 60.0
    version: int = 0
    step_collectives: bool = False
    tables: dict[str, Any] = dataclasses.field(default_factory=dict)
    table_initializers: list[Any] = dataclasses.field(default_factory=list)

    def require(self, stage: Stage, pass_name: str) -> None:
        """Raises StageError unless the program is at `stage`."""
        if self.stage != stage:
            raise StageError(f"{pass_name} needs a {stage.name} program; this one is "
                             f"{self.stage.name}")

    @property
    def task_prefix(self) -> str:
        job, index = self.task
        return f"/job:{job}/task:{index}/"

    def local_replica_devices(self, strategy: Strategy) -> list[tuple[int, str]]:
        """(index, device) of the strategy's replicas that live on this task."""
        return [(i, d) for i, d in enumerate(strategy.replicas)
                if d.startswith(self.task_prefix)]
