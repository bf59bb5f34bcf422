"""Storage variables: plain resource variables, created in bulk from NodeDefs.

A program holds hundreds of variables (shards, their optimizer slots, local
copies, batch-norm statistics). Creating each as a ``tf.compat.v1.Variable``
costs several milliseconds of Python (about ten ops built one by one, name
scopes, an eager read); a ResNet50 program spent over a second there. Here a
variable is what TensorFlow's runtime needs and no more: a ``VarHandleOp``
whose ``shared_name`` is the variable's name (so every task that creates a
variable of that name on the same device shares one resource, as with
``tf.compat.v1.Variable``), and an initializer ``AssignVariableOp`` of a
constant fill. The nodes of many variables are written as one GraphDef and
imported at once.

`StorageVariable` offers the part of ``tf.Variable``'s interface the passes
and the runtime use (``handle``, ``initializer``, ``read_value``, ``assign*``,
``dtype``, ``shape``, ``device``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import tensorflow as tf

from autodist.ir.errors import InvalidArgumentError
from autodist.kernels.program import StorageRole


@dataclasses.dataclass(frozen=True)
class VariableSpec:
    """One variable to create.

    Attributes:
        name: Its node name and shared name: every task's program that
            creates a variable of this name on the same device shares it.
        shape: Its shape; None for a variable whose shape may change (its
            value then starts with `initial_shape`).
        dtype: Its dtype.
        device: Where it lives (applied as ``tf.device(device)`` would be,
            within the caller's device scope).
        initial: The value every element starts at.
        initial_shape: Shape of the initial value of a variable of any shape.
        role: What it holds (recorded in `Program.roles` by the pass that
            creates it).
    """

    name: str
    shape: tuple[int, ...] | None
    dtype: tf.DType
    device: str
    initial: float | int | bool = 0
    initial_shape: tuple[int, ...] = ()
    role: StorageRole | None = None

    def __post_init__(self) -> None:
        if self.shape is not None and any(d is None or d < 0 for d in self.shape):
            raise InvalidArgumentError(f"variable {self.name!r} needs a fully defined shape or "
                                       "None. "
                                       f"Received shape {list(self.shape)}")


class StorageVariable:
    """A resource variable built by `create_variables`.

    Args:
        handle: The ``VarHandleOp`` output.
        initializer: The op giving it its initial value.
        dtype: Its dtype.
        shape: Its shape (unknown for a variable of any shape).
    """

    def __init__(self, handle: tf.Tensor, initializer: tf.Operation, dtype: tf.DType,
                 shape: tf.TensorShape) -> None:
        self._handle = handle
        self._initializer = initializer
        self._dtype = dtype
        self._shape = shape

    @property
    def handle(self) -> tf.Tensor:
        """The resource handle."""
        return self._handle

    @property
    def initializer(self) -> tf.Operation:
        """The op that sets the initial value."""
        return self._initializer

    @property
    def op(self) -> tf.Operation:
        """The ``VarHandleOp``."""
        return self._handle.op

    @property
    def name(self) -> str:
        """Name of the handle tensor, as ``tf.Variable.name``."""
        return self._handle.name

    @property
    def dtype(self) -> tf.DType:
        return self._dtype

    @property
    def shape(self) -> tf.TensorShape:
        return self._shape

    @property
    def device(self) -> str:
        return self._handle.device

    @property
    def graph(self) -> tf.Graph:
        return self._handle.graph

    def read_value(self) -> tf.Tensor:
        """A new read (placed by the caller's device scope, as ``tf.Variable``'s)."""
        return tf.raw_ops.ReadVariableOp(resource=self._handle, dtype=self._dtype)

    def assign(self, value: Any, read_value: bool = True) -> tf.Tensor | tf.Operation:
        """Assigns `value`; returns the value read after it, or the op."""
        return self._write(tf.raw_ops.AssignVariableOp, value, read_value)

    def assign_add(self, delta: Any, read_value: bool = True) -> tf.Tensor | tf.Operation:
        """Adds `delta`; returns the value read after it, or the op."""
        return self._write(tf.raw_ops.AssignAddVariableOp, delta, read_value)

    def assign_sub(self, delta: Any, read_value: bool = True) -> tf.Tensor | tf.Operation:
        """Subtracts `delta`; returns the value read after it, or the op."""
        return self._write(tf.raw_ops.AssignSubVariableOp, delta, read_value)

    def _write(self, raw_op, value: Any, read_value: bool) -> tf.Tensor | tf.Operation:
        op = raw_op(resource=self._handle, value=tf.convert_to_tensor(value, dtype=self._dtype))
        if not read_value:
            return op
        with tf.control_dependencies([op]):
            return tf.raw_ops.ReadVariableOp(resource=self._handle, dtype=self._dtype)

    def __repr__(self) -> str:
        return (f"<StorageVariable {self.op.name!r} shape={self._shape} "
                f"dtype={self._dtype.name} device={self.device!r}>")


def create_variables(graph: tf.Graph, specs: Sequence[VariableSpec]) -> list[StorageVariable]:
    """Creates the variables of `specs` in `graph`, one GraphDef import per device.

    As for ``tf.compat.v1.Variable``, the caller's control dependencies do not
    apply to them and its device scope does. A node name already taken in
    the graph gets a suffix; the shared name stays the spec's name.

    Returns:
        The variables, in the order of `specs`.
    """
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        raise InvalidArgumentError("variable names must be unique. Received duplicates "
                                   f"{duplicates}")
    by_device: dict[str, list[int]] = {}
    for i, spec in enumerate(specs):
        by_device.setdefault(spec.device, []).append(i)
    out: list[StorageVariable | None] = [None] * len(specs)
    with graph.as_default(), tf.control_dependencies(None):
        for device, indices in by_device.items():
            group = [specs[i] for i in indices]
            graph_def = _graph_def(group)
            returned = [e for s in group for e in (f"{s.name}:0", f"{s.name}/Assign")]
            with tf.device(device):
                elements = tf.graph_util.import_graph_def(graph_def, return_elements=returned,
                                                          name="")
            for k, (i, spec) in enumerate(zip(indices, group)):
                shape = tf.TensorShape(spec.shape) if spec.shape is not None \
                    else tf.TensorShape(None)
                out[i] = StorageVariable(elements[2 * k], elements[2 * k + 1], spec.dtype, shape)
    return out  # type: ignore[return-value]


def create_variable(graph: tf.Graph, spec: VariableSpec) -> StorageVariable:
    """Creates one variable (see `create_variables`)."""
    return create_variables(graph, [spec])[0]


def _graph_def(specs: Sequence[VariableSpec]) -> tf.compat.v1.GraphDef:
    """Handle and assign nodes per variable; initial values shared within the GraphDef.

    Variables of one shape, dtype and initial value are assigned from one
    ``Fill`` (its nodes sit under the first variable that needs them).
    """
    graph_def = tf.compat.v1.GraphDef()
    constants: dict[tuple, str] = {}

    def constant(key: tuple, owner: str, value, dtype: tf.DType) -> str:
        if key not in constants:
            name = f"{owner}/Initializer/{'dims' if key[0] == 'dims' else 'value'}"
            node = graph_def.node.add(name=name, op="Const")
            node.attr["dtype"].type = dtype.as_datatype_enum
            node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value, dtype=dtype))
            constants[key] = name
        return constants[key]

    for spec in specs:
        dtype = spec.dtype
        handle = graph_def.node.add(name=spec.name, op="VarHandleOp")
        handle.attr["dtype"].type = dtype.as_datatype_enum
        shape = tf.TensorShape(spec.shape) if spec.shape is not None else tf.TensorShape(None)
        handle.attr["shape"].shape.CopyFrom(shape.as_proto())
        handle.attr["shared_name"].s = spec.name.encode()
        handle.attr["container"].s = b""
        value_shape = list(spec.shape) if spec.shape is not None else list(spec.initial_shape)
        fill_key = ("fill", tuple(value_shape), dtype, spec.initial)
        if fill_key not in constants:
            dims = constant(("dims", tuple(value_shape)), spec.name, value_shape, tf.int64)
            value = constant(("value", dtype, spec.initial), spec.name, spec.initial, dtype)
            fill = graph_def.node.add(name=f"{spec.name}/Initializer/fill", op="Fill",
                                      input=[dims, value])
            fill.attr["T"].type = dtype.as_datatype_enum
            fill.attr["index_type"].type = tf.int64.as_datatype_enum
            constants[fill_key] = fill.name
        assign = graph_def.node.add(name=f"{spec.name}/Assign", op="AssignVariableOp",
                                    input=[spec.name, constants[fill_key]])
        assign.attr["dtype"].type = dtype.as_datatype_enum
    return graph_def
