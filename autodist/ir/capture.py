"""Capture a training step into a GraphItem.

Three sources are supported, all lowered to the same IR:

* a compiled Keras 3 model (functional, Sequential, or subclassed once built);
  loss and optimizer come from ``model.compile``;
* a user function computing the loss from its inputs, with explicit variables
  and an optimizer;
* a ``tf.compat.v1`` graph: a loss tensor and a ``tf.compat.v1.train``
  optimizer.

The traced step computes the loss and returns the gradient of every trainable
variable, so the gradient of each variable is known by construction. The
optimizer update is not traced: the optimizer is recorded as data
(`OptimizerInfo`) and the kernels build its update where the strategy says.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import re
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from autodist.ir.errors import CaptureError
from autodist.ir import batch_norms, loss_masks, random_ops
from autodist.ir.batch_shapes import graph_at_batch
from autodist.ir.graph_item import LOSS_SCALE_INPUT, GraphItem
from autodist.ir.op_costs import estimate_ops
from autodist.proto import graph_item_pb2

logger = logging.getLogger(__name__)

DEFAULT_ESTIMATE_BATCH_SIZE = 32


@dataclasses.dataclass
class _TracedVariable:
    name: str
    handle_node: str
    dtype: tf.DType
    shape: list[int]
    gradient: Any  # tf.Tensor, tf.IndexedSlices or None


def capture(target: Any, *, x: Any = None, y: Any = None,
            input_signature: Sequence[tf.TensorSpec] | None = None,
            variables: Sequence[Any] | None = None,
            optimizer: Any = None, name: str | None = None,
            estimate_batch_size: int = DEFAULT_ESTIMATE_BATCH_SIZE) -> GraphItem:
    """Traces one training step of `target` into a GraphItem.

    Args:
        target: A compiled `keras.Model`; or a callable computing a scalar loss
            from its inputs (then `variables`, `input_signature` and
            `optimizer` are required); or a scalar loss `tf.Tensor` of a
            `tf.compat.v1` graph (then `optimizer` is a `tf.compat.v1.train`
            optimizer).
        x: Keras only: an example batch of inputs (or a TensorSpec structure);
            needed for subclassed models, otherwise taken from `model.inputs`.
        y: Keras only: an example batch of targets (or a TensorSpec); by
            default inferred from the model output and the loss.
        input_signature: Function only: TensorSpecs of the inputs.
        variables: Function: the trainable variables. v1 graph: optional
            subset of the trainable variables.
        optimizer: Function or v1 graph: the optimizer.
        name: Name of the GraphItem (default: model or function name).
        estimate_batch_size: Batch size used for per-op FLOP/byte estimates.

    Returns:
        The GraphItem.

    Raises:
        CaptureError: naming what is missing or unsupported.
    """
    import keras

    if estimate_batch_size < 1:
        raise CaptureError(f"estimate_batch_size must be >= 1. Received: {estimate_batch_size!r}")
    if isinstance(target, keras.Model):
        if variables is not None or input_signature is not None or optimizer is not None:
            raise CaptureError("a Keras model takes its variables, inputs and optimizer from "
                               "the model and its compile(); pass x=/y= examples instead")
        return _capture_keras(target, x, y, name, estimate_batch_size)
    if isinstance(target, tf.Tensor):
        if tf.is_symbolic_tensor(target) and not isinstance(target.graph, _func_graph_type()):
            return _capture_v1(target, optimizer, variables, name, estimate_batch_size)
        raise CaptureError("a tensor passed to capture() must be the loss of a "
                           f"tf.compat.v1 graph. Received: {target!r}")
    if callable(target):
        return _capture_function(target, variables, input_signature, optimizer, name,
                                 estimate_batch_size)
    raise CaptureError("capture() takes a compiled keras.Model, a loss function, or a "
                       f"tf.compat.v1 loss tensor. Received: {type(target).__name__}")


def _func_graph_type() -> type:
    from tensorflow.python.framework import func_graph
    return func_graph.FuncGraph


# --------------------------------------------------------------------- Keras
def _capture_keras(model, x, y, name, batch_size) -> GraphItem:
    if getattr(model, "optimizer", None) is None or not getattr(model, "compiled", False):
        raise CaptureError(f"model {model.name!r} is not compiled: call "
                           "model.compile(optimizer=..., loss=...) before capture")
    if getattr(model, "loss", None) is None:
        raise CaptureError(f"model {model.name!r} was compiled without a loss")
    _check_keras_train_step(model)
    x_spec = _keras_input_spec(model, x)
    if not model.built and x is not None and not any(
            isinstance(v, tf.TensorSpec) for v in tf.nest.flatten(x)):
        # As Keras' fit does: build the model by calling it on the example batch.
        model(tf.nest.map_structure(lambda v: tf.convert_to_tensor(
            np.asarray(v)[:1], _spec_of(v).dtype), x))
    if not model.built:
        raise CaptureError(f"model {model.name!r} is not built: call it on a batch, or pass "
                           "capture(model, x=example_batch)")
    y_spec = _keras_target_spec(model, x_spec, y)
    trainable = list(model.trainable_variables)
    if not trainable:
        raise CaptureError(f"model {model.name!r} has no trainable variables")
    _check_keras_losses(model)
    _check_keras_constraints(model, trainable)

    _build_keras_metrics(model, x_spec, y_spec)
    metric_variables = keras_metric_variables(model)
    optimizer_info = _optimizer_info(model.optimizer, trainable,
                                     unique_names([v.path for v in trainable]))
    loss_scaling = optimizer_info.HasField("loss_scale")

    def step(inputs, targets, sample_weight):
        # Keras' TensorFlow train step, without the optimizer.
        with tf.GradientTape() as tape:
            if getattr(model, "_call_has_training_arg", True):
                predictions = model(inputs, training=True)
            else:
                predictions = model(inputs)
            terms = _added_loss_terms(model)
            with _scaled_added_losses(model, terms):
                loss = _keras_compute_loss(model, inputs, targets, predictions, sample_weight)
            # Keras tracks the loss, and differentiates it times the dynamic loss
            # scale (`LOSS_SCALE_INPUT`, 1 unless fed) under a LossScaleOptimizer.
            scaled = loss * tf.cast(tf.compat.v1.placeholder_with_default(
                1.0, [], name=LOSS_SCALE_INPUT), loss.dtype) if loss_scaling else loss
        grads = _rows_per_example(tape.gradient(scaled, [v.value for v in trainable]), inputs)
        return (loss, grads, _metric_contributions(model, metric_variables, inputs, targets,
                                                   predictions, sample_weight, loss), terms)

    target_names = _keras_target_names(model, y_spec)
    weight_spec = _sample_weight_spec(model, x_spec, y_spec)
    concrete = tf.function(step, autograph=False).get_concrete_function(x_spec, y_spec,
                                                                         weight_spec)
    names = unique_names([v.path for v in trainable])
    state = [v for v in model.variables if not v.trainable]
    input_names = _keras_input_names(model, x_spec)
    input_infos = [(n, "x") for n in input_names] + \
        [(n, "y") for n in target_names] + \
        [(_weight_name(n), "sample_weight") for n in target_names]
    item = _from_concrete_function(
        concrete, trainable, names, state, unique_names([v.path for v in state]),
        input_infos, optimizer_info,
        "keras", name or model.name, batch_size,
        metric_names=unique_names([v.path for v in metric_variables]),
        tables=_keras_lookup_tables(model))
    _infer_draw_shapes(item, model)
    _classify_added_losses(item, model)
    # Keras resolves jit_compile="auto" when compiling: True where XLA serves the model.
    item.proto.jit_compile = getattr(model, "jit_compile", False) is True
    return item


def _rows_per_example(gradients: list, inputs) -> list:
    """Sparse gradients whose rows are lookups of the examples, as they are; the others
    (rows looked up at indices that do not depend on the batch, e.g. a position
    embedding's `arange`, each row summed over the batch) as dense tensors.

    A replica's sparse gradient holds its examples' rows; Keras' optimizers square
    each row of the batch's gradient (Adam's second moment), which the replicas'
    rows reproduce only when each row is one example's lookup. Rows summed over the
    batch are summed over the replicas first, as a dense gradient is, which is what
    Keras computes from unique rows.
    """
    sources = {t.op for t in tf.nest.flatten(inputs)}
    out = []
    for grad in gradients:
        if isinstance(grad, tf.IndexedSlices) and not _reads_any(grad.indices, sources):
            grad = tf.convert_to_tensor(grad)
        out.append(grad)
    return out


# Ops whose outputs depend on their input's shape, not its values.
_SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})


def _reads_any(tensor, sources: set) -> bool:
    """Whether `tensor` is computed from the values of any of the ops `sources` (a
    position embedding's `arange` over a variable length reads only their shape)."""
    seen, todo = set(), [tensor.op]
    while todo:
        op = todo.pop()
        if op in sources:
            return True
        if op in seen or op.type in _SHAPE_OPS:
            continue
        seen.add(op)
        todo.extend(t.op for t in op.inputs)
    return False


def _added_loss_terms(model) -> list:
    """The terms the model's layers added to the loss in this call (`add_loss`, activity
    regularizers; weight regularizers, which do not depend on the batch, aside)."""
    flatten = getattr(model, "_flatten_layers", None)
    layers = list(flatten(include_self=True)) if flatten else [model]
    return [t for layer in layers for t in layer._get_own_losses()]  # noqa: SLF001


ADDED_LOSS_SCALE = "autodist_added_loss_scale"


@contextlib.contextmanager
def _scaled_added_losses(model, terms: list):
    """Within: the model's losses are its added terms each times a scalar input of the
    step (`ADDED_LOSS_SCALE`_i, 1 unless fed), then its weight regularizers, as Keras
    lists them (`Layer.losses`). Keras' own override of the list
    (`_losses_override`, as its stateless trainers use) is restored after."""
    if not terms:
        yield
        return
    scaled = [t * tf.compat.v1.placeholder_with_default(
        tf.constant(1.0, t.dtype), [], name=f"{ADDED_LOSS_SCALE}_{i}")
        for i, t in enumerate(terms)]
    previous = model._losses_override  # noqa: SLF001
    model._losses_override = scaled + model._get_regularization_losses()  # noqa: SLF001
    try:
        yield
    finally:
        model._losses_override = previous  # noqa: SLF001


def _example_batch(item: GraphItem, size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random examples for the step's inputs: normal floats (unit sample weights), zero
    ids, empty strings; unknown dimensions of length 3."""
    rng = np.random.default_rng(seed)
    out = {}
    for info in item.inputs:
        shape = [size] + [3 if d < 0 else d for d in info.shape[1:]]
        dtype = tf.as_dtype(info.dtype)
        if dtype == tf.string:
            out[info.tensor] = np.full(shape, b"")
        elif info.role == "sample_weight":
            out[info.tensor] = np.ones(shape, dtype.as_numpy_dtype)
        elif dtype.is_floating:
            out[info.tensor] = rng.normal(size=shape).astype(dtype.as_numpy_dtype)
        else:
            out[info.tensor] = np.zeros(shape, dtype.as_numpy_dtype)
    return out


def _infer_draw_shapes(item: GraphItem, model) -> None:
    """The batch axis of random draws whose shape static inference could not tell (after
    ops of unknown shapes, such as TextVectorization's): their shape inputs evaluated
    on random examples at two batch sizes (`random_ops.batch_axis`)."""
    unknown = [op for op in item.proto.random_ops
               if not op.reproducible and op.reason == random_ops.UNINFERRED]
    if not unknown:
        return
    graph_def = item.graph_def()
    nodes = {n.name: n for n in graph_def.node}
    shapes = {op.node: _tensor_name(nodes[op.node].input[op.shape_input]) for op in unknown}
    state = [(v, np.array(v.numpy())) for v in model.variables if not v.trainable]
    handles = _variable_handles(item, model)
    try:
        small, large = (
            _run_terms(graph_def, handles, _example_batch(item, size), list(item.random_ops),
                       list(shapes.values()), item.tables)
            for size in random_ops.TRIAL_BATCHES)
    except Exception:  # noqa: BLE001  # examples that do not suit the model
        return
    finally:
        for variable, value in state:
            variable.assign(value)
    for op, a, b in zip(unknown, small, large):
        random_ops.set_batch_axis(op, [int(d) for d in a], [int(d) for d in b])


def _tensor_name(input_name: str) -> str:
    return input_name if ":" in input_name else f"{input_name}:0"


def _classify_added_losses(item: GraphItem, model) -> None:
    """Finds how each added loss term depends on the batch, and drops the constant ones
    (`AddedLossInfo.kind`).

    The captured step runs on random examples (4, and each half), its random
    draws fixed (uniform ones just under 1, normal ones 0: every row alike), so a
    term that is a sum over examples is the halves' sum and a mean their mean.
    The step's state updates (moving statistics, seed generators) are undone.
    """
    terms = list(item.proto.added_losses)
    if not terms:
        return
    variables = list(model.trainable_variables) + [v for v in model.variables
                                                    if not v.trainable]
    state = [(v, np.array(v.numpy())) for v in variables if not v.trainable]
    handles = _variable_handles(item, model)
    full = _example_batch(item, 4)
    batches = [full, {k: v[:2] for k, v in full.items()}, {k: v[2:] for k, v in full.items()}]
    graph_def = item.graph_def()
    draws = list(item.random_ops)
    try:
        values = [_run_terms(graph_def, handles, batch, draws, [t.tensor for t in terms],
                             item.tables)
                  for batch in batches]
    except Exception:  # noqa: BLE001  # examples that do not suit the model
        values = None
    finally:
        for variable, value in state:
            variable.assign(value)
    kept = []
    for i, term in enumerate(terms):
        kind = "other" if values is None else _kind(*(float(v[i]) for v in values))
        if kind != "constant":
            kept.append(graph_item_pb2.AddedLossInfo(tensor=term.tensor, layer=term.layer,
                                                     kind=kind, scale=term.scale))
    del item.proto.added_losses[:]
    item.proto.added_losses.extend(kept)


def _kind(whole: float, a: float, b: float) -> str:
    """How a term of a batch relates to its two halves' terms."""
    close = lambda u, v: math.isclose(u, v, rel_tol=1e-4, abs_tol=1e-7)  # noqa: E731
    if close(whole, a) and close(a, b):
        return "constant"
    if close(whole, a + b):
        return "sum"
    if close(whole, (a + b) / 2):
        return "mean"
    return "other"


def _variable_handles(item: GraphItem, model) -> dict[str, Any]:
    """The step's variable placeholders -> the model's variables' handles."""
    trainable, state = keras_variable_names(model)
    by_name = dict(zip(trainable, model.trainable_variables))
    by_name.update(zip(state, [v for v in model.variables if not v.trainable]))
    out = {}
    for info in list(item.variables) + list(item.state_variables):
        variable = by_name.get(info.name)
        if variable is not None and info.handle_node:
            tf_var = variable.value if isinstance(getattr(variable, "value", None),
                                                  tf.Variable) else variable
            out[f"{info.handle_node}:0"] = tf_var.handle
    return out


def _filled_tables(tables) -> dict[str, Any]:
    """A copy of each captured lookup table, filled, by its placeholder (in a graph)."""
    from tensorflow.core.framework import tensor_pb2

    def value(data: bytes):
        proto = tensor_pb2.TensorProto()
        proto.ParseFromString(data)
        return tf.constant(tf.make_ndarray(proto))

    out = {}
    for info in tables:
        handle = tf.raw_ops.AnonymousHashTable(key_dtype=tf.as_dtype(info.key_dtype),
                                               value_dtype=tf.as_dtype(info.value_dtype))
        with tf.control_dependencies([tf.raw_ops.LookupTableImportV2(
                table_handle=handle, keys=value(info.keys), values=value(info.values))]):
            out[f"{info.placeholder}:0"] = tf.identity(handle)
    return out


def _run_terms(graph_def, handles, batch, draws, fetches, tables=()) -> list:
    """The step's `fetches` on one batch, its random draws fixed (see
    `_classify_added_losses`)."""
    fixed = _fixed_draws(graph_def, draws)

    def run():
        # Identities capture the eager handles into the function's graph.
        input_map = {name: tf.identity(handle) for name, handle in handles.items()}
        input_map.update({name: tf.constant(value) for name, value in batch.items()})
        input_map.update(_filled_tables(tables))
        return tf.graph_util.import_graph_def(fixed, input_map=input_map,
                                              return_elements=fetches, name="terms")
    return [np.asarray(v) for v in tf.function(run, autograph=False)()]


def _fixed_draws(graph_def, draws):
    """`graph_def` with each random op a Fill of its shape: uniform draws just under 1
    (every Dropout keeps everything), others 0."""
    if not draws:
        return graph_def
    out = tf.compat.v1.GraphDef()
    out.CopyFrom(graph_def)
    names = {d.node for d in draws}
    for node in out.node:
        if node.name not in names:
            continue
        dtype = node.attr["dtype"].type
        index_type = next((node.attr[k].type for k in ("Tshape", "T", "S") if k in node.attr),
                          tf.int32.as_datatype_enum)
        value = out.node.add(name=f"{node.name}/fixed_value", op="Const")
        value.attr["dtype"].type = dtype
        value.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(
            0.999 if "Uniform" in node.op else 0.0, tf.as_dtype(dtype)))
        shape = node.input[0]
        attrs = {"T": dtype, "index_type": index_type}
        node.ClearField("input")
        node.ClearField("attr")
        node.op = "Fill"
        node.input.extend([shape, value.name])
        for key, enum in attrs.items():
            node.attr[key].type = enum
    return out


def _scope_of(node_name: str) -> str:
    parts = node_name.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else "/".join(parts[:-1]) or node_name


def _build_keras_metrics(model, x_spec, y_spec) -> None:
    """Builds the compiled metrics (as Keras' fit does) and checks they can be summed.

    The distributed step returns each batch's contribution to every metric's
    state, and the run sums them over replicas and steps. That is exact for
    state that is a sum over examples, as it is for every Keras metric (sums
    and counts, confusion counts); a metric of another kind is refused.
    """
    import keras

    compiled = model._compile_metrics  # noqa: SLF001
    compile_loss = model._compile_loss  # noqa: SLF001
    # The compiled loss makes its per-output trackers when built: build it (and the
    # metrics) now, so the trace does not create metric state the capture never lists.
    if any(part is not None and not part.built for part in (compiled, compile_loss)):
        model._symbolic_build(data_batch=(x_spec, y_spec))  # noqa: SLF001
    known = [model._loss_tracker, compiled]  # noqa: SLF001
    known += list(compile_loss.metrics) if compile_loss is not None else []
    for metric in model.metrics:
        if not any(metric is k for k in known):
            raise CaptureError(
                f"model {model.name!r} has metric {metric.name!r} ({type(metric).__name__}) "
                "outside compile(metrics=...): a layer's or the model's own metric is updated "
                "where the distributed step cannot gather it. Pass it to compile(metrics=...)")
    for metric in compiled.metrics if compiled is not None else []:
        if not type(metric).__module__.startswith("keras.") and \
                not isinstance(metric, (keras.metrics.Mean, keras.metrics.Sum)):
            _check_additive(metric, model.name)


def _check_additive(metric, model_name: str) -> None:
    """Refuses a metric whose state on two batches is not the sum of its state on each.

    Checked on random values of the metric's own shapes (as built by compile).
    """
    variables = metric.variables
    if any(np.any(np.asarray(v.numpy()) != 0) for v in variables):
        metric.reset_state()
    rng = np.random.default_rng(0)
    zeros = [tf.zeros(v.shape, v.dtype) for v in variables]

    def contribution(y_true, y_pred):
        return [np.asarray(t) for t in metric.stateless_update_state(zeros, y_true, y_pred)]

    try:
        y_pred = rng.uniform(0.05, 0.95, size=(8, 4)).astype("float32")
        y_true = rng.integers(0, 2, size=(8, 4)).astype("float32")
        both = contribution(y_true, y_pred)
        halves = [contribution(y_true[:4], y_pred[:4]), contribution(y_true[4:], y_pred[4:])]
    except Exception as e:
        raise CaptureError(
            f"cannot check that metric {metric.name!r} ({type(metric).__name__}) of model "
            f"{model_name!r} sums over batches ({type(e).__name__}: {e}); the distributed run "
            "sums each batch's metric state over replicas and steps") from e
    for a, b, whole in zip(*halves, both):
        if not np.allclose(a + b, whole, rtol=1e-5, atol=1e-6):
            raise CaptureError(
                f"metric {metric.name!r} ({type(metric).__name__}) of model {model_name!r} "
                "keeps state that is not a sum over examples; the distributed run sums each "
                "batch's metric state over replicas and steps, which would report another "
                "value. Use a metric whose state is sums and counts (e.g. a "
                "keras.metrics.Mean subclass)")


def _metric_contributions(model, metric_variables, inputs, targets, predictions,
                          sample_weight, loss) -> list:
    """Each metric variable's contribution of the batch: the metrics updated from zero.

    What Keras' train step updates (the loss tracker, the per-output loss
    trackers of `compile(loss=...)`, the compiled metrics), in a stateless
    scope where every metric variable starts at zero.
    """
    import keras

    zeros = [tf.zeros(v.shape, v.dtype) for v in metric_variables]
    with keras.StatelessScope(state_mapping=list(zip(metric_variables, zeros))) as scope:
        compile_loss = model._compile_loss  # noqa: SLF001
        if compile_loss is not None and compile_loss.metrics:
            # Its per-output trackers.
            compile_loss(targets, predictions, _loss_weights_structure(model, sample_weight))
        if model._loss_tracker is not None:  # noqa: SLF001
            model._loss_tracker.update_state(  # noqa: SLF001
                loss, sample_weight=tf.shape(tf.nest.flatten(inputs)[0])[0])
        model.compute_metrics(inputs, targets, predictions, sample_weight=sample_weight)
    states = []
    for v, zero in zip(metric_variables, zeros):
        value = scope.get_current_value(v)
        states.append(tf.identity(zero if value is None else value))
    return states


def keras_metric_variables(model) -> list:
    """The variables of `model.metrics` (loss tracker, compiled metrics, ...), in the order
    of a capture's `metric_states`."""
    seen, out = set(), []
    for metric in model.metrics:
        for v in metric.variables:
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out


def _loss_weights_structure(model, sample_weight):
    """Per-output sample weights in the structure Keras' compiled loss resolves its
    losses' paths in (`CompileLoss`: integer paths into a list of outputs, or output
    names; Keras converts the targets to it, not the sample weights)."""
    if not isinstance(sample_weight, (list, tuple, dict)):
        return sample_weight
    compile_loss = getattr(model, "_compile_loss", None)
    losses = getattr(compile_loss, "_flat_losses", None) or []
    paths = [loss.path[0] for loss in losses if loss.path]
    count = len(sample_weight)
    names = _output_names(model, count)
    if paths and all(isinstance(p, int) for p in paths) and isinstance(sample_weight, dict):
        return [sample_weight[n] for n in names]
    if paths and all(isinstance(p, str) for p in paths) and \
            isinstance(sample_weight, (list, tuple)):
        return dict(zip(names, sample_weight))
    if not paths and isinstance(sample_weight, (list, tuple)) and isinstance(model.loss, dict):
        return dict(zip(names, sample_weight))
    return sample_weight


def _keras_compute_loss(model, inputs, targets, predictions, sample_weight=None):
    """The loss as Keras' train step computes it (a `compute_loss` override included)."""
    sample_weight = _loss_weights_structure(model, sample_weight)
    if hasattr(model, "_compute_loss"):  # handles overrides without a `training` argument
        return model._compute_loss(x=inputs, y=targets, y_pred=predictions,  # noqa: SLF001
                                   sample_weight=sample_weight, training=True)
    return model.compute_loss(x=inputs, y=targets, y_pred=predictions,
                              sample_weight=sample_weight, training=True)


def _check_keras_train_step(model) -> None:
    """A `train_step` of the user's own is not the step capture traces: refuse it."""
    for klass in type(model).__mro__:
        if "train_step" in vars(klass):
            if not klass.__module__.startswith("keras."):
                raise CaptureError(
                    f"model {model.name!r} overrides train_step (in {klass.__qualname__}); "
                    "autodist captures Keras' standard step (forward pass, compute_loss, "
                    "gradients, optimizer) and cannot reproduce a custom one. Move the loss "
                    "into compute_loss (or add_loss) and keep Keras' train_step")
            return


def _check_keras_losses(model) -> None:
    """Refuses losses summed over the batch: a data-parallel step needs batch means.

    Each replica's loss is weighted by its share of the global batch, which
    reproduces a mean over the batch exactly, not a sum.
    """
    losses = model.loss
    if isinstance(losses, dict):
        losses = list(losses.values())
    elif not isinstance(losses, (list, tuple)):
        losses = [losses]
    for loss in losses:
        reduction = getattr(loss, "reduction", None)
        if reduction == "sum":
            raise CaptureError(
                f"loss {getattr(loss, 'name', type(loss).__name__)!r} of model {model.name!r} "
                f"uses reduction={reduction!r}; distributed training weights each replica's "
                "loss by its share of the batch, which equals Keras only for a mean over the "
                "batch: use reduction='sum_over_batch_size' (the default)")


def _check_keras_constraints(model, trainable) -> None:
    for v in trainable:
        constraint = getattr(v, "constraint", None)
        if constraint is not None:
            raise CaptureError(
                f"variable {v.path!r} of model {model.name!r} has a constraint "
                f"({type(constraint).__name__}), which Keras applies after each update; the "
                "distributed runtime does not apply constraints: remove it")


def keras_variable_names(model) -> tuple[list[str], list[str]]:
    """Names capture gives a Keras model's (trainable, non-trainable) variables, in order."""
    return (unique_names([v.path for v in model.trainable_variables]),
            unique_names([v.path for v in model.variables if not v.trainable]))


def _keras_input_spec(model, x):
    """The step's input specs, in the structure the model is called with.

    A functional model built on a dict of inputs is called with a dict (its
    keys name the inputs); otherwise a list in `model.inputs` order, or the
    structure of the example `x`.
    """
    if x is not None:
        if isinstance(x, dict):
            return {key: _named(_spec_of(value), str(key)) for key, value in x.items()}
        return tf.nest.map_structure(_spec_of, x)
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        inputs = None
    if inputs:
        struct = getattr(model, "_inputs_struct", None)
        if isinstance(struct, dict) and all(not tf.nest.is_nested(t) for t in struct.values()):
            return {key: tf.TensorSpec(_batch_free(t.shape), tf.as_dtype(t.dtype),
                                       name=_clean(str(key)))
                    for key, t in struct.items()}
        specs = [tf.TensorSpec(_batch_free(t.shape), tf.as_dtype(t.dtype),
                               name=_input_name(getattr(t, "name", None), i))
                 for i, t in enumerate(inputs)]
        return specs[0] if len(specs) == 1 else specs
    raise CaptureError(f"cannot infer the input shape of model {model.name!r} "
                       "(a subclassed model): pass capture(model, x=example_batch)")


# What Keras names an `Input` the user did not name.
_KERAS_AUTO_NAME = re.compile(r"keras_tensor(_\d+)?")


def _input_name(name: str | None, index: int) -> str:
    """An input's name as the user gave it (`Input(name=...)`), else ``input_<i>``."""
    if not name or _KERAS_AUTO_NAME.fullmatch(name.split(":")[0]):
        return f"input_{index}"
    return _clean(name)


def _named(spec: tf.TensorSpec, name: str) -> tf.TensorSpec:
    return tf.TensorSpec(spec.shape, spec.dtype, name=_clean(name))


def _keras_input_names(model, x_spec) -> list[str]:
    flat = tf.nest.flatten(x_spec)
    names = [s.name or f"input_{i}" for i, s in enumerate(flat)]
    return unique_names(names) if len(flat) > 1 else [names[0] or "x"]


def _weight_name(target_name: str) -> str:
    """The sample-weight input of a target: "sample_weight", or "sample_weight/<output>"."""
    return "sample_weight" if target_name == "y" else "sample_weight" + target_name[1:]


def _sample_weight_spec(model, x_spec, y_spec):
    """Per target, the spec of its sample weights, in the targets' structure.

    A weight multiplies each value of the output's unreduced loss (Keras'
    `reduce_weighted_values`), so its shape is that of the loss values: one
    per example, or one per example and timestep for a loss over a sequence
    (a `(N, T)` target of a `(N, T, V)` output, a `(N, T, F)` sequence).
    """
    losses = _losses_by_target(model, y_spec)
    try:
        outputs = model.compute_output_spec(tf.nest.map_structure(_symbolic, x_spec))
    except Exception:  # noqa: BLE001  # Keras raises many types here
        outputs = None
    flat_y = tf.nest.flatten(y_spec)
    flat_out = tf.nest.flatten(outputs) if outputs is not None else []
    specs = []
    for i, target in enumerate(flat_y):
        output = flat_out[i] if len(flat_out) == len(flat_y) else None
        shape = _loss_values_shape(losses[i] if i < len(losses) else None, target, output)
        specs.append(tf.TensorSpec(shape, tf.float32))
    return tf.nest.pack_sequence_as(y_spec, specs)


def _losses_by_target(model, y_spec) -> list:
    """The compiled loss of each target, in the flat order of `y_spec` (None: none)."""
    flat_y = tf.nest.flatten(y_spec)
    if isinstance(y_spec, tf.TensorSpec):
        return [model.loss]
    names = _keras_target_names(model, y_spec)
    out = []
    for i, name in enumerate(names):
        try:
            out.append(_loss_of(model, name[len("y/"):], i))
        except CaptureError:
            out.append(None)
    return out + [None] * (len(flat_y) - len(out))


def _loss_values_shape(loss, target: tf.TensorSpec, output) -> list[int | None]:
    """The shape of a loss's values before reduction (`Loss.call`), batch unknown;
    one value per example where it cannot be traced."""
    import keras
    from keras.src.trainers import compile_utils

    if loss is None or output is None:
        return [None]
    y_pred = tf.TensorSpec(_batch_free(output.shape), tf.as_dtype(output.dtype))
    try:
        resolved = compile_utils.get_loss(loss, _symbolic(target), _symbolic(y_pred))
        if not isinstance(resolved, keras.losses.Loss):
            return [None]
        values = tf.function(lambda t, p: resolved.call(t, p), autograph=False) \
            .get_concrete_function(target, y_pred).structured_outputs
    except Exception:  # noqa: BLE001  # a user's loss may raise anything
        return [None]
    if not isinstance(values, tf.Tensor) or values.shape.rank in (None, 0):
        return [None]
    return _batch_free(values.shape)


def _keras_target_spec(model, x_spec, y):
    if y is not None:
        spec = tf.nest.map_structure(_spec_of, y)
        if isinstance(spec, tuple):
            spec = list(spec)
        return spec
    try:
        out = model.compute_output_spec(
            tf.nest.map_structure(lambda s: _symbolic(s), x_spec))
    except Exception as e:  # Keras raises many types here
        raise CaptureError(f"cannot infer the output of model {model.name!r} ({e}); "
                           "pass capture(model, x=..., y=example_targets)") from e
    if isinstance(out, dict):
        return {key: _target_spec_for(out[key], _loss_of(model, key, None)) for key in out}
    if isinstance(out, (list, tuple)):
        names = _output_names(model, len(out))
        return [_target_spec_for(o, _loss_of(model, n, i))
                for i, (o, n) in enumerate(zip(out, names))]
    return _target_spec_for(out, model.loss)


def _target_spec_for(output, loss) -> tf.TensorSpec:
    shape = _batch_free(output.shape)
    if _is_sparse_categorical(loss):
        return tf.TensorSpec(shape[:-1], tf.int32)
    dtype = tf.as_dtype(output.dtype)
    if dtype in (tf.float16, tf.bfloat16):
        dtype = tf.float32  # targets stay float32 under mixed precision, as Keras' losses take them
    return tf.TensorSpec(shape, dtype)


def _output_names(model, count: int) -> list[str]:
    names = list(getattr(model, "output_names", None) or [])
    return names if len(names) == count else [f"output_{i}" for i in range(count)]


def _loss_of(model, output_name: str, index: int | None):
    """The loss compiled for one output (a single loss applies to every output)."""
    loss = model.loss
    if isinstance(loss, dict):
        if output_name not in loss:
            raise CaptureError(f"model {model.name!r} has no loss for output "
                               f"{output_name!r} (losses for {sorted(loss)}); pass y=")
        return loss[output_name]
    if isinstance(loss, (list, tuple)):
        if index is None or index >= len(loss):
            raise CaptureError(f"cannot match the {len(loss)} losses of model "
                               f"{model.name!r} to its outputs; pass y=")
        return loss[index]
    return loss


def _keras_target_names(model, y_spec) -> list[str]:
    """Names of the targets, in the step's input order: "y", or "y/<output>" per output."""
    if isinstance(y_spec, tf.TensorSpec):
        return ["y"]
    if isinstance(y_spec, dict):
        names = [str(k) for k in sorted(y_spec)]
    else:
        flat = tf.nest.flatten(y_spec)
        names = _output_names(model, len(flat)) if len(flat) == len(y_spec) else \
            [f"output_{i}" for i in range(len(flat))]
    return unique_names([f"y/{_clean(n)}" for n in names])


def _symbolic(spec: tf.TensorSpec):
    import keras
    return keras.KerasTensor(spec.shape, dtype=spec.dtype.name)


def _is_sparse_categorical(loss) -> bool:
    text = loss if isinstance(loss, str) else getattr(loss, "name", "") or ""
    fn = getattr(loss, "fn", None)
    if fn is not None:
        text += " " + getattr(fn, "__name__", "")
    if not isinstance(loss, str):
        text += " " + type(loss).__name__
    return "sparse_categorical" in text.lower() or "sparsecategorical" in text.lower()


def _spec_of(value) -> tf.TensorSpec:
    if isinstance(value, tf.TensorSpec):
        return value
    arr = np.asarray(value) if not isinstance(value, tf.Tensor) else value
    dtype = tf.as_dtype(arr.dtype)
    if dtype == tf.float64:
        dtype = tf.float32
    if dtype == tf.int64:
        dtype = tf.int32
    return tf.TensorSpec([None] + list(arr.shape[1:]), dtype)


def _batch_free(shape) -> list[int | None]:
    dims = list(shape)
    return [None] + [None if d is None else int(d) for d in dims[1:]]


def _clean(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", name.split(":")[0]) or "input"


# ------------------------------------------------------------------ function
def _capture_function(fn, variables, input_signature, optimizer, name, batch_size) -> GraphItem:
    missing = [arg for arg, value in (("variables", variables),
                                      ("input_signature", input_signature),
                                      ("optimizer", optimizer)) if value is None]
    if missing:
        raise CaptureError(f"capturing a loss function needs {', '.join(missing)}: "
                           "capture(loss_fn, variables=[...], "
                           "input_signature=[tf.TensorSpec(...)], optimizer=...)")
    variables = list(variables)
    if not variables:
        raise CaptureError("capture(loss_fn, variables=...) received an empty variable list")
    tf_vars = [_tf_variable(v, i) for i, v in enumerate(variables)]
    python_fn = getattr(fn, "python_function", fn)
    specs = [s if isinstance(s, tf.TensorSpec) else _spec_of(s) for s in input_signature]

    def step(*args):
        with tf.GradientTape() as tape:
            loss = python_fn(*args)
        grads = tape.gradient(loss, tf_vars)
        return loss, grads

    concrete = tf.function(step, autograph=True).get_concrete_function(*specs)
    names = unique_names([_variable_name(v) for v in variables])
    input_infos = [(s.name or f"input_{i}", "") for i, s in enumerate(specs)]
    return _from_concrete_function(
        concrete, variables, names, [], [], input_infos,
        _optimizer_info(optimizer, variables, names),
        "function", name or getattr(python_fn, "__name__", "step"), batch_size)


def _tf_variable(v, index):
    inner = getattr(v, "value", None)
    if isinstance(v, tf.Variable):
        return v
    if isinstance(inner, tf.Variable):
        return inner
    raise CaptureError(f"variables[{index}] is not a tf.Variable or keras.Variable. "
                       f"Received: {type(v).__name__}")


def _variable_name(v) -> str:
    path = getattr(v, "path", None)
    if isinstance(path, str) and path:
        return path
    return v.name.split(":")[0]


def _from_concrete_function(concrete, trainable, names, state, state_names, input_infos,
                            optimizer_info, source, name, batch_size,
                            metric_names: Sequence[str] = (),
                            tables: Sequence[tuple[str, Any]] = ()) -> GraphItem:
    graph = concrete.graph
    loss, grads, *rest = concrete.structured_outputs
    metric_states = list(rest[0]) if rest else []
    # A traced function's outputs are Identities of what the step computes.
    terms = [t.op.inputs[0] if t.op.type == "Identity" else t
             for t in (rest[1] if len(rest) > 1 else [])]
    added = [graph_item_pb2.AddedLossInfo(tensor=t.name, layer=_scope_of(t.op.name),
                                          kind="other", scale=f"{ADDED_LOSS_SCALE}_{i}")
             for i, t in enumerate(terms)]
    if loss.shape.rank not in (0, None):
        raise CaptureError(f"the loss must be a scalar. Received shape {loss.shape}")
    captured = {id(external): internal for external, internal in graph.captures}
    handle_of = {}
    for v in list(trainable) + list(state):
        tf_var = v.value if isinstance(getattr(v, "value", None), tf.Variable) else v
        internal = captured.get(id(tf_var.handle))
        if internal is not None:
            handle_of[id(v)] = internal.op.name

    traced = []
    for v, var_name, grad in zip(trainable, names, grads):
        if id(v) not in handle_of:
            logger.warning("variable %s is not used by the step; it gets no gradient", var_name)
        traced.append(_TracedVariable(var_name, handle_of.get(id(v), ""), tf.as_dtype(v.dtype),
                                      [int(d) for d in v.shape], grad))
    known_handles = set(handle_of.values())
    table_infos = []
    for layer_name, table in tables:
        internal = captured.get(id(table.resource_handle))
        if internal is not None:
            table_infos.append(_table_info(internal.op.name, layer_name, table))
    known_handles |= {t.placeholder for t in table_infos}

    graph_def = graph.as_graph_def()
    dropped = _drop_foreign_state(graph, graph_def, known_handles,
                                  [loss] + [g for g in grads if g is not None] + metric_states)
    _inline_constant_captures(graph, graph_def, known_handles | dropped)

    num_inputs = len(input_infos)
    inputs = []
    flat_inputs = concrete.inputs[:len(tf.nest.flatten(concrete.structured_input_signature))]
    if len(flat_inputs) != num_inputs:
        input_infos = [(t.op.name, "") for t in flat_inputs]
    for (in_name, role), tensor in zip(input_infos, flat_inputs):
        inputs.append(graph_item_pb2.TensorInfo(
            name=in_name, tensor=tensor.name, dtype=tensor.dtype.name,
            shape=_proto_shape(tensor.shape), role=role))

    states = []
    for v, var_name in zip(state, state_names):
        node = handle_of.get(id(v))
        if node is None:
            continue
        updates = _update_ops(graph, node)
        states.append(_state_info(var_name, node, tf.as_dtype(v.dtype), list(v.shape), updates))
    metrics = [graph_item_pb2.TensorInfo(name=metric_name, tensor=t.name, dtype=t.dtype.name,
                                         shape=_proto_shape(t.shape))
               for metric_name, t in zip(metric_names, metric_states)]
    item = _assemble(graph, graph_def, source, name, inputs, loss, traced, states,
                     optimizer_info, batch_size, dropped, metrics, table_infos)
    item.proto.added_losses.extend(added)
    return item


def _keras_lookup_tables(model) -> list[tuple[str, Any]]:
    """(layer name, table) of every lookup table the model's layers hold (StringLookup,
    IntegerLookup, TextVectorization's)."""
    out, seen = [], set()
    flatten = getattr(model, "_flatten_layers", None)
    for layer in (flatten(include_self=False) if flatten else []):
        for value in list(vars(layer).values()):
            if hasattr(value, "resource_handle") and hasattr(value, "export") and \
                    hasattr(value, "key_dtype") and id(value) not in seen:
                seen.add(id(value))
                out.append((layer.name, value))
    return out


def _table_info(placeholder: str, layer_name: str, table) -> graph_item_pb2.TableInfo:
    """A lookup table's contents, as every task rebuilds it."""
    keys, values = table.export()
    default = getattr(table, "default_value", None)
    if default is None:
        raise CaptureError(f"layer {layer_name!r} holds a lookup table without a default value "
                           f"({type(table).__name__}); only static tables can be rebuilt on "
                           "the workers")
    return graph_item_pb2.TableInfo(
        placeholder=placeholder, key_dtype=table.key_dtype.name,
        value_dtype=table.value_dtype.name, layer=layer_name,
        keys=tf.make_tensor_proto(keys.numpy()).SerializeToString(),
        values=tf.make_tensor_proto(values.numpy()).SerializeToString(),
        default_value=tf.make_tensor_proto(np.asarray(default)).SerializeToString())


def _drop_foreign_state(graph, graph_def, variable_handles: set[str], outputs) -> set[str]:
    """Removes what the step does to resources that are not the model's variables.

    Keras' loss of a model with several outputs updates a loss-tracking
    metric per output while it computes the loss; the updates are side
    effects (control inputs of the step's outputs), not part of the loss or
    the gradients, and they would read resources the distributed program does
    not have. They are removed, with every op fed by such a resource.

    Returns:
        The names of the removed nodes.

    Raises:
        CaptureError: the loss or a gradient depends on such a resource.
    """
    foreign = {internal.op.name for _, internal in graph.captures
               if internal.dtype == tf.resource and internal.op.name not in variable_handles}
    if not foreign:
        return set()
    consumers: dict[str, list[str]] = {}
    for node in graph_def.node:
        for inp in node.input:
            if not inp.startswith("^"):
                consumers.setdefault(inp.split(":")[0], []).append(node.name)
    dropped = set(foreign)
    stack = list(foreign)
    while stack:
        for consumer in consumers.get(stack.pop(), []):
            if consumer not in dropped:
                dropped.add(consumer)
                stack.append(consumer)
    needed = _data_ancestors(graph_def, [t.op.name for t in _flat_tensors(outputs)])
    reached = sorted(needed & foreign)
    if reached:
        raise CaptureError(f"the loss or a gradient reads {reached[0]!r}, a resource that is "
                           "not one of the model's variables; only variables may be read")
    kept = [n for n in graph_def.node if n.name not in dropped]
    for node in kept:
        inputs = [i for i in node.input if not (i.startswith("^") and i[1:] in dropped)]
        del node.input[:]
        node.input.extend(inputs)
    del graph_def.node[:]
    graph_def.node.extend(kept)
    return dropped


def _flat_tensors(values) -> list:
    out = []
    for v in values:
        out += [v.values, v.indices] if isinstance(v, tf.IndexedSlices) else [v]
    return out


def _data_ancestors(graph_def, names: list[str]) -> set[str]:
    """Nodes the given nodes read data from, through data edges only (and themselves)."""
    by_name = {n.name: n for n in graph_def.node}
    seen: set[str] = set()
    stack = list(names)
    while stack:
        name = stack.pop()
        if name in seen or name not in by_name:
            continue
        seen.add(name)
        stack.extend(i.split(":")[0] for i in by_name[name].input if not i.startswith("^"))
    return seen


def _inline_constant_captures(graph, graph_def, variable_handles: set[str]) -> None:
    """Replaces placeholders of captured eager tensors by constants.

    Resource captures must be the model's variables; anything else a traced
    step captured from Python (an eager tensor) becomes a Const node so that
    the GraphDef is self-contained.
    """
    nodes = {n.name: n for n in graph_def.node}
    for external, internal in graph.captures:
        node_name = internal.op.name
        if node_name in variable_handles:
            continue
        if internal.dtype == tf.resource:
            raise CaptureError(
                f"the step reads a resource ({node_name}) that is not one of the "
                "model's variables; only variables may be captured")
        value = tf.get_static_value(external)
        if value is None:
            raise CaptureError(f"the step captures a tensor ({node_name}) whose value is "
                               "not known at trace time")
        const = tf.compat.v1.NodeDef(name=node_name, op="Const")
        const.attr["dtype"].type = internal.dtype.as_datatype_enum
        const.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value))
        nodes[node_name].CopyFrom(const)


def _update_ops(graph, handle_node: str) -> list[str]:
    out = []
    for op in graph.get_operations():
        if op.type in ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp") \
                and op.inputs[0].op.name == handle_node:
            out.append(op.name)
    return out


# ------------------------------------------------------------------ v1 graph
def _capture_v1(loss, optimizer, variables, name, batch_size) -> GraphItem:
    if optimizer is None or not isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise CaptureError("capturing a tf.compat.v1 graph needs optimizer= a "
                           "tf.compat.v1.train optimizer. Received: "
                           f"{type(optimizer).__name__}")
    graph = loss.graph
    with graph.as_default():
        var_list = list(variables) if variables is not None else \
            tf.compat.v1.trainable_variables()
        if not var_list:
            raise CaptureError("the v1 graph has no trainable variables")
        for v in var_list:
            if not isinstance(v, tf.Variable) or v.op.type != "VarHandleOp":
                raise CaptureError(
                    f"variable {getattr(v, 'name', v)!r} is a reference variable; create it "
                    "with use_resource=True (or tf.compat.v1.enable_resource_variables())")
        grads_and_vars = optimizer.compute_gradients(loss, var_list=var_list)
    names = unique_names([v.op.name for v in var_list])
    traced = [_TracedVariable(n, v.op.name, v.dtype.base_dtype, [int(d) for d in v.shape], g)
              for n, (g, v) in zip(names, grads_and_vars)]
    inputs = [graph_item_pb2.TensorInfo(name=op.name, tensor=op.outputs[0].name,
                                        dtype=op.outputs[0].dtype.name,
                                        shape=_proto_shape(op.outputs[0].shape))
              for op in graph.get_operations() if op.type == "Placeholder"]
    trainable_handles = {v.op.name for v in var_list}
    states = []
    for v in tf.compat.v1.global_variables() if graph is tf.compat.v1.get_default_graph() \
            else graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES):
        if v.op.name in trainable_handles or v.op.type != "VarHandleOp":
            continue
        updates = _update_ops(graph, v.op.name)
        if updates:
            states.append(_state_info(v.op.name, v.op.name, v.dtype.base_dtype,
                                      list(v.shape), updates))
    optimizer_info = _optimizer_info(optimizer, var_list)
    return _assemble(graph, graph.as_graph_def(), "v1_graph", name or "v1_graph", inputs, loss,
                     traced, states, optimizer_info, batch_size)


# ------------------------------------------------------------------- shared
def _is_float16_sum(grad: tf.Tensor) -> bool:
    """Whether a dense gradient is a float16 tensor cast to the variable's dtype (a
    layer computing in float16 under 'mixed_float16': its sum over the batch is a
    float16 sum, which overflows where a float32 one would not)."""
    op = grad.op
    while op.type == "Identity":
        op = op.inputs[0].op
    return op.type == "Cast" and op.inputs[0].dtype == tf.float16 and grad.dtype != tf.float16


def _assemble(graph, graph_def, source, name, inputs, loss, traced, states, optimizer_info,
              batch_size, dropped: set[str] = frozenset(),
              metrics: Sequence[graph_item_pb2.TensorInfo] = (),
              tables: Sequence[graph_item_pb2.TableInfo] = ()) -> GraphItem:
    order = {op.name: i for i, op in enumerate(graph.get_operations())}
    fetches = [loss.op] + [op for s in states for op in map(graph.get_operation_by_name,
                                                              s.update_ops)]
    variables = []
    for t in traced:
        info = graph_item_pb2.VariableInfo(
            name=t.name, handle_node=t.handle_node, dtype=t.dtype.name, shape=t.shape,
            byte_size=math.prod(t.shape) * t.dtype.size)
        grad = t.gradient
        if isinstance(grad, tf.IndexedSlices):
            info.sparse_gradient = True
            info.gradient.values = grad.values.name
            info.gradient.indices = grad.indices.name
            if grad.dense_shape is not None:
                info.gradient.dense_shape = grad.dense_shape.name
            producer = grad.values
        elif grad is not None:
            info.gradient.dense = grad.name
            info.gradient.float16_sum = _is_float16_sum(grad)
            producer = grad
        else:
            producer = None
        if producer is not None:
            fetches.append(producer.op)
            info.gradient_order = order.get(_producer(producer.op).name, 0)
        info.partitionable_axes.extend(_partitionable_axes(t.shape, info.sparse_gradient))
        info.slots.extend(_slot_names(optimizer_info, t.name))
        variables.append(info)

    # Shapes at exactly `batch_size` examples where shape inference can tell them (a
    # dimension derived from the batch, e.g. UpSampling2D's gradient reshapes, is then
    # known, not guessed as the batch); the traced graph's otherwise.
    at_batch = graph_at_batch(graph_def, inputs, batch_size, _handles(traced, states))
    ops = estimate_ops(at_batch or graph, batch_size, _producer(loss.op).name,
                       keep=_ancestors(fetches) - dropped)
    if at_batch is not None:
        _count_sparse_rows(at_batch, variables, ops)
    proto = graph_item_pb2.GraphItem(
        graph_def=graph_def.SerializeToString(deterministic=True), source=source, name=name,
        inputs=inputs, loss_tensor=loss.name, variables=variables, state_variables=states,
        optimizer=optimizer_info, ops=ops, estimate_batch_size=batch_size,
        metric_states=metrics,
        batch_norms=batch_norms.analyze(graph_def, {v.handle_node for v in variables}),
        loss_masks=loss_masks.analyze(graph_def),
        random_ops=random_ops.analyze(graph_def, inputs, _handles(traced, states)),
        tables=tables)
    return GraphItem(proto)


def _handles(traced, states) -> dict[str, tuple[str, list[int]]]:
    """The step's variable placeholders -> (dtype, shape) of what they hold."""
    out = {t.handle_node: (t.dtype.name, list(t.shape)) for t in traced if t.handle_node}
    out.update({s.handle_node: (s.dtype, list(s.shape)) for s in states})
    return out


def _producer(op):
    """The op behind Identity wrappers (a traced function's outputs are Identities)."""
    while op.type == "Identity" and op.inputs:
        op = op.inputs[0].op
    return op


def _ancestors(fetch_ops) -> set[str]:
    seen: set[str] = set()
    stack = list(fetch_ops)
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return seen


def _partitionable_axes(shape: list[int], sparse: bool) -> list[int]:
    if sparse:
        # A gather reads rows: only axis 0 can be split.
        return [0] if shape and shape[0] > 1 else []
    return [axis for axis, dim in enumerate(shape) if dim > 1]


def _state_info(name, handle_node, dtype, shape, updates) -> graph_item_pb2.StateInfo:
    shape = [int(d) for d in shape]
    return graph_item_pb2.StateInfo(name=name, handle_node=handle_node, dtype=dtype.name,
                                    shape=shape, byte_size=math.prod(shape) * dtype.size,
                                    update_ops=updates)


def _count_sparse_rows(graph: tf.Graph, variables, ops) -> None:
    """Sets the output bytes of each sparse gradient's values in `graph` (the step at
    the estimate batch, `_graph_at_batch`).

    A lookup of several ids per example flattens them into one unknown
    dimension (batch x ids), which the per-op estimate takes for the batch
    alone. Shape inference on the step whose inputs hold exactly the batch
    gives the real number of rows (one per lookup); where it cannot tell, the
    estimate stays.
    """
    by_name = {op.name: op for op in ops}
    for var in variables:
        if not var.sparse_gradient:
            continue
        op = by_name.get(var.gradient.values.split(":")[0])
        shape = graph.get_tensor_by_name(var.gradient.values).shape
        if op is not None and shape.is_fully_defined():
            op.output_bytes = shape.num_elements() * tf.as_dtype(var.dtype).size


def _proto_shape(shape: tf.TensorShape) -> list[int]:
    if shape.rank is None:
        return []
    return [-1 if d is None else int(d) for d in shape.as_list()]


def unique_names(names: Sequence[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        if n in seen:
            seen[n] += 1
            candidate = f"{n}_{seen[n]}"
            while candidate in seen:
                seen[n] += 1
                candidate = f"{n}_{seen[n]}"
            n = candidate
        seen.setdefault(n, 0)
        out.append(n)
    return out


# ---------------------------------------------------------------- optimizer
_KERAS_ALGORITHMS = {"SGD": "sgd", "Adam": "adam", "AdamW": "adamw", "Adagrad": "adagrad",
                     "RMSprop": "rmsprop"}
_V1_ALGORITHMS = {"GradientDescentOptimizer": "sgd", "MomentumOptimizer": "sgd",
                  "AdamOptimizer": "adam", "AdagradOptimizer": "adagrad",
                  "RMSPropOptimizer": "rmsprop"}
# Attributes of v1 optimizers, as the Keras hyper-parameter they correspond to.
_V1_HYPERPARAMETERS = {"_learning_rate": "learning_rate", "_lr": "learning_rate",
                       "_momentum": "momentum",
                       "_use_nesterov": "nesterov", "_beta1": "beta_1", "_beta2": "beta_2",
                       "_epsilon": "epsilon", "_initial_accumulator_value":
                       "initial_accumulator_value", "_decay": "rho", "_centered": "centered"}


def _optimizer_info(optimizer, variables,
                    names: Sequence[str] | None = None) -> graph_item_pb2.OptimizerInfo:
    """The optimizer as data.

    Args:
        optimizer: A Keras 3 or tf.compat.v1 optimizer.
        variables: The trainable variables it updates.
        names: Their names in the GraphItem (for Keras' weight-decay exclusions).
    """
    import keras

    class_name = type(optimizer).__name__
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        algorithm = _V1_ALGORITHMS.get(class_name)
        if algorithm is None:
            raise CaptureError(f"unsupported tf.compat.v1 optimizer {class_name}; supported: "
                               f"{sorted(_V1_ALGORITHMS)}")
        hyper = {}
        for attr, key in _V1_HYPERPARAMETERS.items():
            value = getattr(optimizer, attr, None)
            if value is None:
                continue
            static = tf.get_static_value(value) if isinstance(value, tf.Tensor) else value
            if static is None or callable(static):
                raise CaptureError(f"{class_name}.{key} must be a number, not a tensor "
                                   f"computed at run time. Received: {value!r}")
            hyper[key] = float(static)
        config = {"class_name": class_name, "config": hyper}
        return graph_item_pb2.OptimizerInfo(algorithm=algorithm, family="v1",
                                            class_name=class_name, hyperparameters=hyper,
                                            config_json=json.dumps(config, sort_keys=True))
    if isinstance(optimizer, keras.optimizers.Optimizer):
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            return _loss_scale_info(optimizer, variables, names)
        algorithm = _KERAS_ALGORITHMS.get(class_name)
        if algorithm is None:
            raise CaptureError(f"unsupported Keras optimizer {class_name}; supported: "
                               f"{sorted(_KERAS_ALGORITHMS)}")
        config = _keras_optimizer_config(optimizer)
        hyper = {}
        for key, value in config.items():
            if isinstance(value, bool):
                hyper[key] = float(value)
            elif isinstance(value, (int, float)) and value is not None:
                hyper[key] = float(value)
        info = graph_item_pb2.OptimizerInfo(algorithm=algorithm, family="keras",
                                            class_name=class_name)
        rate = optimizer._learning_rate  # noqa: SLF001
        if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
            hyper.pop("learning_rate", None)
            info.learning_rate_schedule.CopyFrom(_trace_schedule(rate))
        elif callable(rate) and not isinstance(rate, keras.Variable):
            raise CaptureError(
                f"the learning rate of {class_name} is a callable ({_describe(rate)}), which "
                "Keras calls with no arguments before every update; autodist cannot "
                "evaluate it on the cluster. Use a keras.optimizers.schedules."
                "LearningRateSchedule (a function of the step) or a number")
        elif "learning_rate" not in hyper:
            hyper["learning_rate"] = float(np.asarray(optimizer.learning_rate))
        info.hyperparameters.update(hyper)
        if config.get("weight_decay") is not None and names is not None:
            info.weight_decay_excluded.extend(
                n for v, n in zip(variables, names)
                if not optimizer._use_weight_decay(v))  # noqa: SLF001
        try:
            serialized = keras.optimizers.serialize(optimizer)
        except NotImplementedError:  # a schedule without get_config
            serialized = {"class_name": class_name, "config": config}
        info.config_json = json.dumps(serialized, sort_keys=True, default=str)
        return info
    raise CaptureError("optimizer must be a keras.optimizers.Optimizer or a "
                       f"tf.compat.v1.train.Optimizer. Received: {class_name}")


def _loss_scale_info(optimizer, variables,
                     names: Sequence[str] | None) -> graph_item_pb2.OptimizerInfo:
    """A Keras LossScaleOptimizer (as the 'mixed_float16' policy makes): its inner
    optimizer, with the dynamic loss scaling around it (`OptimizerInfo.loss_scale`)."""
    import keras

    inner = optimizer.inner_optimizer
    if isinstance(inner, keras.optimizers.LossScaleOptimizer):
        raise CaptureError("the optimizer is a LossScaleOptimizer around another "
                           "LossScaleOptimizer; wrap the inner optimizer once")
    scale = float(optimizer.initial_scale)
    growth = int(optimizer.dynamic_growth_steps)
    if not (np.isfinite(scale) and scale > 0) or growth < 1:
        raise CaptureError(f"LossScaleOptimizer needs initial_scale > 0 and "
                           f"dynamic_growth_steps >= 1. Received: initial_scale={scale:g}, "
                           f"dynamic_growth_steps={growth}")
    info = _optimizer_info(inner, variables, names)
    info.loss_scale.initial_scale = scale
    info.loss_scale.dynamic_growth_steps = growth
    return info


def _keras_optimizer_config(optimizer) -> dict[str, Any]:
    """`get_config()`, or, where a schedule without `get_config` makes it fail,
    the constructor's arguments read from the optimizer's attributes of the same
    name (as Keras optimizers keep them)."""
    import inspect

    try:
        return optimizer.get_config()
    except NotImplementedError:
        parameters = inspect.signature(type(optimizer).__init__).parameters
        return {key: getattr(optimizer, key) for key in parameters
                if key not in ("self", "learning_rate", "name", "kwargs")
                and hasattr(optimizer, key)}


# Steps at which a traced schedule must equal the schedule itself.
_SCHEDULE_CHECK_STEPS = (0, 1, 2, 3, 7, 10, 99, 100, 101, 1000, 12345, 1000000)


def _trace_schedule(schedule) -> graph_item_pb2.LearningRateSchedule:
    """Traces a Keras LearningRateSchedule into a graph of the step.

    The graph is checked against the schedule at a few steps, so a schedule
    whose value depends on Python state rather than on the step is refused.
    """
    import keras

    name = type(schedule).__name__
    try:
        concrete = tf.function(lambda step: tf.convert_to_tensor(schedule(step)),
                               autograph=True).get_concrete_function(
                                   tf.TensorSpec([], tf.int64, name="step"))
    except Exception as e:  # whatever the user's schedule raises
        raise CaptureError(f"the learning-rate schedule {name} cannot be traced as a "
                           f"TensorFlow function of the step: {_short(e)}") from e
    rate = concrete.structured_outputs
    if rate.shape.rank != 0 or not rate.dtype.is_floating:
        raise CaptureError(f"the learning-rate schedule {name} must return a float scalar. "
                           f"Received: {rate.dtype.name} of shape {rate.shape}")
    graph = concrete.graph
    if any(internal.dtype == tf.resource for _, internal in graph.captures):
        raise CaptureError(f"the learning-rate schedule {name} reads a variable; its changes "
                           "would not reach the cluster. Make it a function of the step only")
    graph_def = graph.as_graph_def()
    _inline_constant_captures(graph, graph_def, set())
    for step in _SCHEDULE_CHECK_STEPS:
        want = float(np.asarray(schedule(tf.constant(step, tf.int64))))
        got = float(concrete(tf.constant(step, tf.int64)))
        if not math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-12):
            raise CaptureError(f"the learning-rate schedule {name} gives {want!r} at step "
                               f"{step} but its traced graph gives {got!r}: it depends on "
                               "something other than the step")
    try:
        config = json.dumps(keras.optimizers.schedules.serialize(schedule), sort_keys=True,
                            default=str)
    except Exception:  # noqa: BLE001 (a custom schedule without get_config)
        config = ""
    return graph_item_pb2.LearningRateSchedule(
        class_name=name, config_json=config,
        graph_def=graph_def.SerializeToString(deterministic=True),
        step_tensor=concrete.inputs[0].name, learning_rate_tensor=rate.name)


def _describe(value) -> str:
    return getattr(value, "__qualname__", None) or type(value).__name__


def _short(error: Exception, limit: int = 300) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= limit else text[:limit] + " ..."


def _slot_names(info: graph_item_pb2.OptimizerInfo, var_name: str) -> list[str]:
    hp = info.hyperparameters
    algorithm = info.algorithm
    if info.family == "v1":
        if algorithm == "sgd":
            return ["momentum"] if info.class_name == "MomentumOptimizer" else []
        if algorithm == "adam":
            return ["m", "v"]
        if algorithm == "adagrad":
            return ["accumulator"]
        if algorithm == "rmsprop":
            return ["rms", "momentum"] + (["mg"] if hp.get("centered") else [])
    else:
        if algorithm == "sgd":
            return ["momentum"] if hp.get("momentum", 0.0) > 0 else []
        if algorithm in ("adam", "adamw"):
            return ["momentum", "velocity"] + (["velocity_hat"] if hp.get("amsgrad") else [])
        if algorithm == "adagrad":
            return ["accumulator"]
        if algorithm == "rmsprop":
            slots = ["velocity"]
            if hp.get("momentum", 0.0) > 0:
                slots.append("momentum")
            if hp.get("centered"):
                slots.append("average_gradient")
            return slots
    raise CaptureError(f"no slot rule for optimizer {info.class_name} (variable {var_name})")
