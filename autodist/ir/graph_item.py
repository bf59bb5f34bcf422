"""GraphItem: the traced training step and what the compiler knows about it.

A GraphItem is made by `autodist.capture` and consumed by the search, the
kernels and the runtime. It wraps `graph_item.proto`; nothing here imports
TensorFlow, so the search can work on GraphItems without it.
"""
from __future__ import annotations

import os
import pathlib
from typing import Iterator, Mapping

import networkx as nx
from google.protobuf import text_format

from autodist.ir.atomic import atomic_write
from autodist.ir.device_names import input_op
from autodist.ir.errors import CaptureError, UnknownVariableError
from autodist.ir.fingerprint import fingerprint
from autodist.ir.graph_item_checks import GRAPH_ITEM_SCHEMA_VERSION, check_graph_item
from autodist.proto import graph_item_pb2


VariableInfo = graph_item_pb2.VariableInfo


class GraphItem:
    """The traced step (GraphDef) plus per-variable facts.

    Attributes exposed as properties: `variables` (trainable, in capture
    order), `state_variables`, `optimizer`, `inputs`, `loss_tensor`, `ops`.

    Example:
        >>> gi = autodist.capture(model)          # doctest: +SKIP
        >>> gi.variable("dense/kernel").byte_size  # doctest: +SKIP
        200704
    """

    def __init__(self, proto: graph_item_pb2.GraphItem) -> None:
        self._proto = graph_item_pb2.GraphItem()
        self._proto.CopyFrom(proto)
        if not self._proto.schema_version:
            self._proto.schema_version = GRAPH_ITEM_SCHEMA_VERSION
        self._by_name = {v.name: v for v in self._proto.variables}
        if len(self._by_name) != len(self._proto.variables):
            names = [v.name for v in self._proto.variables]
            dup = sorted({n for n in names if names.count(n) > 1})
            raise CaptureError(f"variable names must be unique. Received duplicates: {dup}")
        self._fingerprint: str | None = None

    # ------------------------------------------------------------ accessors
    @property
    def proto(self) -> graph_item_pb2.GraphItem:
        """The underlying protobuf (do not modify)."""
        return self._proto

    @property
    def name(self) -> str:
        return self._proto.name

    @property
    def estimate_batch_size(self) -> int:
        """The batch its op estimates are for (at least 1)."""
        return max(1, self._proto.estimate_batch_size)

    @property
    def source(self) -> str:
        return self._proto.source

    @property
    def variables(self) -> list[VariableInfo]:
        return list(self._proto.variables)

    @property
    def variable_names(self) -> list[str]:
        return [v.name for v in self._proto.variables]

    def variable(self, name: str) -> VariableInfo:
        """The trainable variable called `name`; KeyError names the known ones."""
        try:
            return self._by_name[name]
        except KeyError:
            raise UnknownVariableError(f"no trainable variable {name!r} in GraphItem "
                                       f"{self.name!r}; "
                                       f"known: {sorted(self._by_name)}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    @property
    def state_variables(self) -> list[graph_item_pb2.StateInfo]:
        return list(self._proto.state_variables)

    @property
    def optimizer(self) -> graph_item_pb2.OptimizerInfo:
        return self._proto.optimizer

    @property
    def inputs(self) -> list[graph_item_pb2.TensorInfo]:
        """Every input of the step (model inputs, targets, sample weights), in call order."""
        return list(self._proto.inputs)

    @property
    def model_inputs(self) -> list[graph_item_pb2.TensorInfo]:
        """The model's inputs (role "x", or unknown for a function or v1 graph)."""
        return [i for i in self._proto.inputs if i.role not in ("y", "sample_weight")]

    @property
    def target_inputs(self) -> list[graph_item_pb2.TensorInfo]:
        """The targets (role "y"), one per model output."""
        return [i for i in self._proto.inputs if i.role == "y"]

    @property
    def sample_weight_input(self) -> graph_item_pb2.TensorInfo | None:
        """The first target's sample weights (Keras captures), or None."""
        return next((i for i in self._proto.inputs if i.role == "sample_weight"), None)

    @property
    def sample_weight_inputs(self) -> list[graph_item_pb2.TensorInfo]:
        """The sample weights of the loss and metrics, one per target in the targets'
        order (Keras captures; an older capture has one, for every target), shaped
        as the target's loss values: one per example, or per example and timestep."""
        return [i for i in self._proto.inputs if i.role == "sample_weight"]

    @property
    def metric_states(self) -> list[graph_item_pb2.TensorInfo]:
        """Per metric variable, the tensor of a batch's contribution to its state."""
        return list(self._proto.metric_states)

    @property
    def random_ops(self) -> list[graph_item_pb2.RandomOpInfo]:
        """The step's random ops that draw for the batch (see `autodist.ir.random_ops`)."""
        return list(self._proto.random_ops)

    @property
    def batch_norms(self) -> list[graph_item_pb2.BatchNormInfo]:
        """The step's batch statistics and their gradients (see `autodist.ir.batch_norms`)."""
        return list(self._proto.batch_norms)

    @property
    def tables(self) -> list[graph_item_pb2.TableInfo]:
        """The lookup tables the step reads, with their contents."""
        return list(self._proto.tables)

    @property
    def loss_masks(self) -> list[graph_item_pb2.LossMaskInfo]:
        """The losses normalized by the batch's count of unmasked values."""
        return list(self._proto.loss_masks)

    @property
    def loss_reductions(self) -> list[graph_item_pb2.LossReductionInfo]:
        """The compiled losses reduced by a sum, or by a mean over the sample weights."""
        return list(self._proto.loss_reductions)

    @property
    def jit_compile(self) -> bool:
        """Whether the model's step is compiled with XLA (Keras' `jit_compile`)."""
        return self._proto.jit_compile

    @property
    def added_losses(self) -> list[graph_item_pb2.AddedLossInfo]:
        """Loss terms added by the model's layers that depend on the batch, and how."""
        return list(self._proto.added_losses)

    @property
    def loss_tensor(self) -> str:
        return self._proto.loss_tensor

    @property
    def ops(self) -> list[graph_item_pb2.OpInfo]:
        return list(self._proto.ops)

    @property
    def num_parameters(self) -> int:
        total = 0
        for v in self._proto.variables:
            n = 1
            for d in v.shape:
                n *= d
            total += n
        return total

    @property
    def total_variable_bytes(self) -> int:
        return sum(v.byte_size for v in self._proto.variables)

    @property
    def total_flops(self) -> float:
        """Estimated FLOPs of one step at `estimate_batch_size`."""
        return sum(op.flops for op in self._proto.ops)

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self._proto)
        return self._fingerprint

    def graph_def(self):
        """The step as a `tf.compat.v1.GraphDef` (imports TensorFlow)."""
        from tensorflow.core.framework import graph_pb2

        graph_def = graph_pb2.GraphDef()
        graph_def.ParseFromString(self._proto.graph_def)
        return graph_def

    def op_dag(self) -> nx.DiGraph:
        """The op DAG as a networkx graph.

        Nodes carry ``type``, ``phase``, ``flops``, ``output_bytes`` and
        ``order`` (topological index); edges go from producer to consumer,
        control edges included (attribute ``control=True``).
        """
        from tensorflow.core.framework import graph_pb2

        graph_def = graph_pb2.GraphDef()
        graph_def.ParseFromString(self._proto.graph_def)
        dag = nx.DiGraph()
        for order, op in enumerate(self._proto.ops):
            dag.add_node(op.name, type=op.type, phase=op.phase, flops=op.flops,
                         output_bytes=op.output_bytes, order=order)
        for node in graph_def.node:
            if node.name not in dag:
                dag.add_node(node.name, type=node.op, phase="", flops=0.0,
                             output_bytes=0, order=-1)
            for inp in node.input:
                control = inp.startswith("^")
                src = input_op(inp)
                dag.add_edge(src, node.name, control=control)
        return dag

    # ------------------------------------------------------- serialization
    def serialize(self) -> bytes:
        return self._proto.SerializeToString(deterministic=True)

    @classmethod
    def deserialize(cls, data: bytes, source: str = "the GraphItem") -> GraphItem:
        """A GraphItem from `serialize`'s bytes, every field checked (`graph_item_checks`).

        Raises:
            CaptureError: not a GraphItem, or a field that is wrong (named).
        """
        proto = graph_item_pb2.GraphItem()
        try:
            proto.ParseFromString(data)
        except Exception as e:  # noqa: BLE001 (protobuf raises DecodeError, RecursionError)
            raise CaptureError(f"{source} is not a GraphItem protobuf: "
                               f"{type(e).__name__}: {str(e)[:200]}") from None
        check_graph_item(proto, source)
        return cls(proto)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the binary proto atomically (a temporary file, then rename)."""
        atomic_write(path, self.serialize())

    @classmethod
    def load(cls, path: str | os.PathLike) -> GraphItem:
        try:
            data = pathlib.Path(path).read_bytes()
        except OSError as e:
            raise CaptureError(f"cannot read GraphItem file {str(path)!r}: {e}") from e
        return cls.deserialize(data, source=f"GraphItem file {str(path)!r}")

    def summary(self) -> str:
        """A table of the variables: name, shape, dtype, bytes, sparse, axes, slots."""
        rows = [("name", "shape", "dtype", "bytes", "sparse", "axes", "slots")]
        for v in self._proto.variables:
            rows.append((v.name, "x".join(str(d) for d in v.shape) or "scalar", v.dtype,
                         f"{v.byte_size:,}", "yes" if v.sparse_gradient else "no",
                         ",".join(str(a) for a in v.partitionable_axes) or "-",
                         ",".join(v.slots) or "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        opt = self._proto.optimizer
        hp = ", ".join(f"{k}={v:g}" for k, v in sorted(opt.hyperparameters.items()))
        if opt.HasField("learning_rate_schedule"):
            hp = f"learning_rate={opt.learning_rate_schedule.class_name}(step), " + hp
        phases: dict[str, int] = {}
        for op in self._proto.ops:
            phases[op.phase] = phases.get(op.phase, 0) + 1
        header = [
            f"GraphItem {self.name!r} (captured from {self.source}), "
            f"fingerprint {self.fingerprint}",
            f"  variables: {len(self._proto.variables)} trainable, "
            f"{self.num_parameters:,} parameters, {self.total_variable_bytes:,} bytes; "
            f"{len(self._proto.state_variables)} state variables",
            f"  optimizer: {opt.class_name} ({opt.family} {opt.algorithm}) {hp}",
            f"  ops: {len(self._proto.ops)} "
            f"({', '.join(f'{k} {v}' for k, v in sorted(phases.items()))}), "
            f"{self.total_flops / 1e9:.3f} GFLOP per step "
            f"at batch {self._proto.estimate_batch_size}",
            "  inputs: " + ", ".join(f"{t.name}{list(t.shape)}:{t.dtype}"
                                     for t in self._proto.inputs),
        ]
        constrained = [f"{v.name} {v.constraint.class_name}" for v in self._proto.variables
                       if v.HasField("constraint")]
        if constrained:
            header.append("  constraints: " + ", ".join(constrained))
        header.append("")
        return "\n".join(header + lines)

    def to_text(self, include_graph: bool = False) -> str:
        """Text form of the proto; the GraphDef bytes are left out unless asked."""
        proto = graph_item_pb2.GraphItem()
        proto.CopyFrom(self._proto)
        if not include_graph:
            proto.ClearField("graph_def")
            proto.ClearField("ops")
            for v in proto.variables:
                if v.HasField("constraint"):
                    v.constraint.ClearField("graph_def")
        return text_format.MessageToString(proto)

    def __iter__(self) -> Iterator[VariableInfo]:
        return iter(self._proto.variables)

    def __len__(self) -> int:
        return len(self._proto.variables)

    def __repr__(self) -> str:
        return (f"GraphItem(name={self.name!r}, variables={len(self)}, "
                f"parameters={self.num_parameters:,}, ops={len(self._proto.ops)})")


# Keras' gradient clipping options, in the order Keras checks them.
CLIPPING_OPTIONS = ("clipnorm", "global_clipnorm", "clipvalue")
# The scalar input of a captured step whose loss the optimizer scales dynamically
# (`OptimizerInfo.loss_scale`): the step differentiates its loss times it (1 unless fed).
LOSS_SCALE_INPUT = "autodist_loss_scale"
# The scalar input of a captured Keras step that is its part of the global batch's
# examples (1 unless fed): Keras' per-output loss trackers count each batch once,
# so each replica's or virtual node's update of them counts this part of one.
BATCH_PART_INPUT = "autodist_batch_part"


def optimizer_squares_gradient(info: graph_item_pb2.OptimizerInfo) -> bool:
    """Whether the update needs the squared gradient of a sparse gradient.

    For a sparse gradient Keras squares each looked-up row before summing
    repeats (in Adam-like updates, and in the norm `clipnorm` and
    `global_clipnorm` clip by), so whoever aggregates such a gradient must
    carry those squares.
    """
    if info.family != "keras":
        return False
    clipping = gradient_clipping(info.hyperparameters)
    return info.algorithm in ("adam", "adamw", "adagrad", "rmsprop") or \
        (clipping is not None and clipping[0] != "clipvalue")


def gradient_clipping(hyperparameters: Mapping[str, float]) -> tuple[str, float] | None:
    """The clipping Keras applies with these hyper-parameters: (option, value) or None.

    As in Keras, an option counts only when it is positive, and `clipnorm`
    wins over `global_clipnorm`, which wins over `clipvalue`.
    """
    for option in CLIPPING_OPTIONS:
        value = hyperparameters.get(option, 0.0)
        if value and value > 0:
            return option, float(value)
    return None
