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

from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy


class Stage(enum.IntEnum):
    CAPTURED = 0
    PARTITIONED = 1
    REPLICATED = 2
    SYNCHRONIZED = 3


class StageError(RuntimeError):
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
    """

    index: int
    inputs: dict[str, Any] = dataclasses.field(default_factory=dict)
    weight: Any = None
    loss: Any = None
    gradients: dict[str, Any] = dataclasses.field(default_factory=dict)
    weighted: bool = False


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
        loss: The replica's mean loss (its virtual nodes' losses weighted by
            examples).
        gradients: Variable name -> dense tensor or tf.IndexedSlices: the
            gradient of `loss`.
        state_updates: Ops updating state variables (batch-norm statistics).
    """

    index: int
    device: str
    virtual_nodes: list[VirtualNode] = dataclasses.field(default_factory=list)
    inputs: dict[str, Any] = dataclasses.field(default_factory=dict)
    sizes: Any = None
    default_sizes: list[int] | None = None
    loss: Any = None
    gradients: dict[str, Any] = dataclasses.field(default_factory=dict)
    state_updates: list[Any] = dataclasses.field(default_factory=list)


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
        extras: Pass-specific results (train op, scale placeholder, ...).
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
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)

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
