"""Capture of a Keras model whose class overrides `train_step`.

The user's step is traced as Keras' fit runs it (not autographed) under a
`keras.StatelessScope` that records what it assigns (`_Recording`): the
optimizer's `apply` assigns each trained variable its gradient itself (the
variables are marked `overwrite_with_gradient` while tracing), so the step's
gradients are known by construction, as in Keras' own step; metric variables
start from zero, so their values are the batch's contributions; other state
(seed generators, batch-norm statistics) is assigned as the step assigns it.

What is taken (step 1 of docs/design_custom_train_step.md): one optimizer, the
model's compiled one, applied once per step to its trainable variables, and
logs that are functions of the metrics' state (`keras.metrics.Mean` trackers,
compiled metrics). What is not is refused before launch, naming what was found.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

from autodist.ir.capture.constraints import attach_constraints
from autodist.ir.capture.example_runs import infer_draw_shapes
from autodist.ir.capture.draw_rows import find_row_blocks
from autodist.ir.capture.fixed_lookups import find_repeated_lookups
from autodist.ir.capture.keras_metrics import (count_batches_once, counts_batches,
                                               keras_metric_variables)
from autodist.ir.capture.keras_model import (check_compiled, check_keras_stateful_layers,
                                             keras_lookup_tables, rows_per_example)
from autodist.ir.capture.keras_specs import (build_model, keras_input_names, keras_input_spec,
                                             keras_target_names, keras_target_spec,
                                             sample_weight_name, sample_weight_spec)
from autodist.ir.capture.names import unique_names
from autodist.ir.capture.optimizer import describe_optimizer
from autodist.ir.capture.step_logs import check_epoch_logs, flat_logs, logs_graph
from autodist.ir.capture.step_parts import check_parts_add_up, parts_checked
from autodist.ir.capture.traced_function import from_concrete_function
from autodist.ir.errors import CaptureError
from autodist.ir.graph_item import GraphItem

# Where the later steps (several optimizers, ordered phases, state after the update)
# are described, for the refusals.
_DESIGN = "docs/design_custom_train_step.md"
# What the refusals offer instead.
_WITHOUT = "train this model with Keras' fit on one device"


def capture_custom_step(model, step_class: type, x, y, name, batch_size,
                        weights=None, targets: bool = True) -> GraphItem:
    """The step of a compiled model whose class `step_class` overrides `train_step`.

    The step takes its data as Keras' fit packs it: `x` alone for a model whose
    step reads no targets (compiled without a loss or metrics, and no example
    `y`), else `(x, y, sample_weight)` with unit weights unless fit passes some,
    or `(x, y)` when the step cannot take three (it then takes no weights).
    `weights`: the specs of the sample weights a dataset gives (else the loss
    values' shape, one per example without a compiled loss). `targets=False`: the
    data has none (a dataset of inputs alone: keras-io's Transformer ASR yields
    dicts of source and target, its step computing the loss from them).

    Raises:
        CaptureError: what the step does that a distributed run cannot (named).
    """
    label = f"the train_step of model {model.name!r} (in {step_class.__qualname__})"
    check_compiled(model)
    _check_supported(model, label)
    check_keras_stateful_layers(model)
    x_spec = keras_input_spec(model, x)
    if not model.built and _has_call(model):
        build_model(model, x, x_spec)  # as the step would on its first call
    reads_targets = y is not None or targets and (
        model.loss is not None or getattr(model, "_compile_metrics", None) is not None)
    y_spec = keras_target_spec(model, x_spec, y) if reads_targets else None
    derived = sample_weight_spec(model, x_spec, y_spec)
    if weights is not None and derived is not None and \
            len(tf.nest.flatten(weights)) == len(tf.nest.flatten(derived)):
        derived = tf.nest.pack_sequence_as(derived, [   # the dataset's (per timestep)
            tf.TensorSpec([None] + w.shape.as_list()[1:], tf.float32)
            for w in tf.nest.flatten(weights)])
    weight_spec = _first_trace(model, x_spec, y_spec, derived, label, x_given=x is not None)
    trainable = list(model.trainable_variables)
    if not trainable:
        raise CaptureError(f"model {model.name!r} has no trainable variables")
    metric_variables = keras_metric_variables(model)
    names = unique_names([v.path for v in trainable])
    traced = _Traced()

    def step(inputs, targets, sample_weight):
        return _recorded_step(model, (inputs, targets, sample_weight), trainable,
                              metric_variables, traced, label)

    concrete = tf.function(step, autograph=False).get_concrete_function(x_spec, y_spec,
                                                                         weight_spec)
    traced.check(model, label)
    _check_optimizer_variables(model, trainable, label)
    state = [v for v in model.variables if not v.trainable]
    target_names = keras_target_names(model, y_spec)
    input_infos = [(n, "x") for n in keras_input_names(model, x_spec)] + \
        [(n, "y") for n in target_names] + \
        [(sample_weight_name(n), "sample_weight") for n in target_names
         if weight_spec is not None]
    item = from_concrete_function(
        concrete, trainable, names, state, unique_names([v.path for v in state]), input_infos,
        describe_optimizer(model.optimizer, trainable, names), "keras", name or model.name,
        batch_size, metric_names=unique_names([v.path for v in metric_variables]),
        tables=keras_lookup_tables(model))
    _backward_phases(item)
    attach_constraints(item, trainable, names)
    infer_draw_shapes(item, model)
    find_row_blocks(item, model)
    find_repeated_lookups(item, model)
    item.proto.jit_compile = getattr(model, "jit_compile", False) is True
    info = item.proto.custom_step
    info.step_class = step_class.__qualname__
    info.data = "x" if y_spec is None else "x,y" if weight_spec is None else "x,y,sample_weight"
    graph_def, info.state_inputs[:] = logs_graph(
        concrete.graph.as_graph_def(), [(k, t.name) for k, t in traced.logs], traced.finals,
        label)
    info.logs_graph_def = graph_def
    for key, tensor in traced.logs:
        info.logs.add(name=key, tensor=tensor.name, dtype="float32")
    check_epoch_logs(model, info, metric_variables, traced.keys, label)
    _check_added_losses(item, label, traced.added_losses)
    check_parts_add_up(item, model, label)
    return item


def _backward_phases(item: GraphItem) -> None:
    """The op estimates' backward pass: from the tape's first gradient op on, as in the
    standard capture (whose loss op ends the forward pass; here `loss_tensor` is a log,
    computed after the apply)."""
    ops = item.proto.ops
    start = next((k for k, op in enumerate(ops) if op.name.startswith("gradient_tape/")), None)
    for op in ops[start:] if start is not None else []:
        if op.phase == "forward":
            op.phase = "backward"


def _has_call(model) -> bool:
    """Whether the model defines its forward pass (keras-io's VAE has none: its step
    calls the encoder and decoder, and the model stays unbuilt, as in Keras' fit)."""
    import keras

    return type(model).call is not keras.Model.call


def _check_supported(model, label: str) -> None:
    """What a custom step may not have yet: dynamic loss scaling."""
    if getattr(model.optimizer, "inner_optimizer", None) is not None:
        raise CaptureError(
            f"{label} runs under a LossScaleOptimizer ('mixed_float16'), which a captured "
            f"custom step does not scale yet; use 'mixed_bfloat16' or float32, or {_WITHOUT}")


def _check_added_losses(item: GraphItem, label: str, added: int) -> None:
    """Layers' added losses (regularizers, `add_loss`) in the step: a weight regularizer
    or a mean over examples adds up over replicas as the loss does, which the parts
    check verifies; where it does not run (a batch normalization whose moments were
    not found, masked losses) they are refused, since a sum over examples would count
    once per replica."""
    if added and not parts_checked(item):
        raise CaptureError(
            f"{label}: the model's layers add {added} loss term(s) (add_loss, regularizers) "
            "next to a batch normalization computed in its own way or a masked loss, "
            "where the capture cannot check "
            "that they add up over replicas (a sum over examples would not); remove them, "
            f"or {_WITHOUT}")


def _first_trace(model, x_spec, y_spec, weight_spec, label: str, x_given: bool):
    """Traces the step once as Keras' fit first does, which builds the optimizer and the
    metrics outside any stateless scope; the weights' spec the step takes (None: it
    cannot take three elements, `x, y = data`)."""
    import keras

    def trace(weights):
        data = keras.utils.pack_x_y_sample_weight(
            *_specs(x_spec, y_spec, weights))
        tf.function(model.train_step, autograph=False).get_concrete_function(data)

    try:
        trace(weight_spec)
        return weight_spec
    except Exception as first:  # the user's step raises anything
        # Without an example, the step was traced with x shaped as the model's inputs.
        shaped = "" if x_given else \
            f"; it was traced with x shaped as the model's inputs ({_shapes(x_spec)}): if " \
            "the step takes data of another structure or shape (pairs of images, a " \
            "zip of datasets), pass an example batch as fit receives it, " \
            "capture(model, x=...) or optimize(model, spec, x=...)"
        if weight_spec is None:
            hint = "" if y_spec is not None else \
                "; it was given x alone (no loss, no compiled metrics): if it reads " \
                "targets, pass capture(model, x=..., y=example_targets)"
            raise CaptureError(f"{label} fails when traced ({type(first).__name__}: "
                               f"{str(first)[:300]}){shaped}{hint}") from first
        try:
            trace(None)
        except Exception as e:  # whatever the step raises
            raise CaptureError(f"{label} fails when traced, with sample weights "
                               f"({type(first).__name__}: {str(first)[:300]}) and without "
                               f"({type(e).__name__}: {str(e)[:300]}){shaped}") from e
        return None


def _shapes(spec) -> str:
    """The shapes of a (nested) spec, e.g. "(None, 32, 32, 3)"."""
    return ", ".join(str(tuple(s.shape.as_list())) for s in tf.nest.flatten(spec))


def _specs(x_spec, y_spec, weight_spec) -> tuple:
    return (x_spec, y_spec, weight_spec) if weight_spec is not None else (x_spec, y_spec)


def _check_optimizer_variables(model, trainable: list, label: str) -> None:
    """The compiled optimizer was built (by the step's apply) for exactly the model's
    trainable variables: the run updates those, and maps the optimizer's slots by them."""
    known = getattr(model.optimizer, "_trainable_variables", None)
    if not getattr(model.optimizer, "built", False) or known is None:
        raise CaptureError(f"{label} never applies the compiled optimizer "
                           "(self.optimizer.apply / apply_gradients)")
    built = {id(v) for v in known}
    missing = [v.path for v in trainable if id(v) not in built]
    extra = [v.path for v in known if id(v) not in {id(t) for t in trainable}]
    if missing or extra:
        raise CaptureError(
            f"{label} applies the optimizer to other variables than the model's trainable "
            f"ones (not applied: {missing[:5]}; applied but not trainable: {extra[:5]}): the "
            "run updates every trainable variable through the one optimizer. Set "
            "trainable=False on what the step does not train (a frozen teacher), and "
            "compile again")


@dataclasses.dataclass
class _Traced:
    """What the recording trace found, for the checks after it."""

    recording: Any = None
    logs: list = dataclasses.field(default_factory=list)
    finals: list = dataclasses.field(default_factory=list)
    data_ops: set = dataclasses.field(default_factory=set)
    outputs: list = dataclasses.field(default_factory=list)
    added_losses: int = 0
    keys: set = dataclasses.field(default_factory=set)   # the logs' own, not flattened

    def check(self, model, label: str) -> None:
        """Refuses what one apply per step cannot describe (see `_Recording`)."""
        self.recording.check(model, label)
        after = {p.op: path for p, path in self.recording.after}
        for tensor in self.outputs:
            found = _reads(tensor, set(after))
            if found is not None:
                raise CaptureError(
                    f"{label} reads {after[found]!r} after the optimizer's apply (a "
                    "forward pass, a metric or a copy of the updated weights): steps in "
                    f"ordered phases are not supported yet ({_DESIGN}, steps 3-4); {_WITHOUT}")
        bn = _moving_statistics(model)
        for variable, value in self.recording.assigned:
            if id(variable) not in bn and _reads(value, self.data_ops) is not None:
                raise CaptureError(
                    f"{label} assigns {variable.path!r} from the batch (state set from a "
                    "batch statistic): replicas would each set it from their part. Only "
                    f"batch normalization's statistics are summed over replicas; {_WITHOUT}")


def _recorded_step(model, args: tuple, trainable: list, metric_variables: list,
                   traced: _Traced, label: str) -> tuple:
    """The user's step traced under a recording scope: (loss, gradients, metric
    contributions, no added-loss terms), the logs and the checks' facts in `traced`."""
    import keras

    inputs, targets, sample_weight = args
    data = keras.utils.pack_x_y_sample_weight(*_specs(inputs, targets, sample_weight))
    recording = _Recording(model, trainable, metric_variables)
    flags = [(v, v.overwrite_with_gradient) for v in trainable]
    for variable in trainable:
        variable.overwrite_with_gradient = True  # apply assigns the gradient itself
    try:
        with recording.scope() as scope:
            logs = model.train_step(data)
    except Exception as e:  # the user's step raises anything
        if not recording.applies:
            raise CaptureError(f"{label} fails when traced under the capture's recording "
                               f"scope ({type(e).__name__}: {str(e)[:300]})") from e
        # Keras' own code trips over a variable read after the apply (a placeholder).
        raise CaptureError(
            f"{label} fails after its optimizer's apply ({type(e).__name__}: "
            f"{str(e)[:200]}): it uses the updated variables again (a second apply, a "
            f"forward pass after the update), which one apply per step cannot describe "
            f"({_DESIGN}, steps 2-4); {_WITHOUT}") from e
    finally:
        for variable, flag in flags:
            variable.overwrite_with_gradient = flag
    traced.recording = recording
    traced.data_ops = {t.op for t in tf.nest.flatten(args) if t is not None}
    traced.finals = [scope.get_current_value(v) for v in metric_variables]
    traced.added_losses = len(scope.losses) + sum(
        getattr(v, "regularizer", None) is not None for v in trainable)
    traced.logs = flat_logs(logs, label)
    traced.keys = set(logs)
    gradients = rows_per_example(recording.gradients(trainable), inputs)
    states = _count_parts_of_batches(model, metric_variables, traced.finals, recording.zeros)
    loss = next((t for key, t in traced.logs if key == "loss"), None)
    loss = tf.constant(0.0, name="no_loss") if loss is None else loss
    traced.outputs = [loss] + [g for g in tf.nest.flatten(gradients, expand_composites=True)
                               if g is not None] + states + [t for _, t in traced.logs] + \
        [value for _, value in recording.assigned]
    return loss, gradients, states, []


class _Recording:
    """What the user's step assigns, sorted (`sort`) inside a StatelessScope (`scope`).

    * a trained variable inside an optimizer's `apply`: its gradient (the step's
      apply, one per optimizer until its update count closes it); from then on
      the variable reads a placeholder, "its value after the apply";
    * an optimizer's update count: closes the apply;
    * a metric variable: its value (from zero: the batch's contribution);
    * a trained variable elsewhere: refused;
    * anything else (seed generators, batch-norm statistics): assigned in the graph,
      as every replica assigns it.
    """

    def __init__(self, model, trainable: list, metric_variables: list) -> None:
        self.model = model
        self.trained = {id(v) for v in trainable}
        self.metric_variables = metric_variables
        self.metric_ids = {id(v) for v in metric_variables}
        self.zeros = [tf.zeros(v.shape, v.dtype) for v in metric_variables]
        self.applies: list[tuple[Any, dict[int, Any]]] = []
        self.open = False
        self.outside: list[str] = []
        self.assigned: list[tuple[Any, Any]] = []
        self.after: list[tuple[Any, str]] = []
        self.graph = tf.compat.v1.get_default_graph()
        self.conditional = False

    def scope(self):
        """A StatelessScope sorting its updates here; metric variables start at 0."""
        import keras

        recording = self

        class RecordingScope(keras.StatelessScope):
            def add_update(self, update):
                recording.sort(self, *update)

            def get_current_value(self, variable):
                value = super().get_current_value(variable)
                if value is None and id(variable) in recording.trained:
                    # Keras' weight regularizers read every variable through the scope
                    # (which maps all of them under JAX): a trained one reads itself.
                    return variable._value  # noqa: SLF001  # the backend's variable
                return value

        # Layers' `add_loss` goes to the scope (else dropped under a StatelessScope), where
        # the model's `losses` finds it, as outside one.
        return RecordingScope(state_mapping=list(zip(self.metric_variables, self.zeros)),
                              collect_losses=True)

    def sort(self, scope, variable, value) -> None:
        """Records one assignment of the step."""
        optimizer = _applying_optimizer()
        if optimizer is not None and id(variable) in self.trained:
            if not self.open or self.applies[-1][0] is not optimizer:
                self.applies.append((optimizer, {}))
                self.open = True
            self.applies[-1][1][id(variable)] = value
            if tf.compat.v1.get_default_graph() is not self.graph:
                self.conditional = True  # inside a tf.cond or loop body's graph
            after = tf.compat.v1.placeholder_with_default(
                tf.zeros(variable.shape, variable.dtype), variable.shape,
                name="autodist_after_apply")
            self.after.append((after, variable.path))
            scope.state_mapping[id(variable)] = after
        elif any(variable is o.iterations for o in self._optimizers()):
            # Apply's update count, after its name scope: the apply ends (one without
            # gradients is an apply too).
            if not self.open:
                self.applies.append((next(o for o in self._optimizers()
                                          if variable is o.iterations), {}))
            self.open = False
        elif id(variable) in self.metric_ids:
            scope.state_mapping[id(variable)] = value
        elif id(variable) in self.trained:
            self.outside.append(variable.path)
        else:
            variable._direct_assign(value)  # noqa: SLF001  # what assign does outside a scope
            self.assigned.append((variable, value))

    def _optimizers(self) -> list:
        return _optimizers_of(self.model) + [o for o, _ in self.applies]

    def gradients(self, trainable: list) -> list:
        """Each trainable variable's gradient in the step's apply (None: not applied)."""
        found = self.applies[0][1] if self.applies else {}
        return [found.get(id(v)) for v in trainable]

    def check(self, model, label: str) -> None:
        """Refuses assignments outside an apply, several applies, another optimizer's,
        and an apply under control flow."""
        if self.outside:
            raise CaptureError(
                f"{label} assigns trained variable(s) {sorted(set(self.outside))[:5]} outside "
                "an optimizer's apply (a manual update, a sharpness-aware step): the run "
                "updates trained variables only through the optimizer's update; apply "
                f"gradients with self.optimizer.apply(...), or {_WITHOUT}")
        if not self.applies:
            raise CaptureError(f"{label} applies no optimizer update "
                               "(self.optimizer.apply / apply_gradients)")
        if len(self.applies) > 1 or self.applies[0][0] is not model.optimizer:
            found = ", ".join(o.name for o, _ in self.applies)
            raise CaptureError(
                f"{label} applies {len(self.applies)} update(s) per step ({found}), not "
                f"the compiled optimizer ({model.optimizer.name!r}) once: several optimizers "
                f"or applies (GANs, CycleGAN) are not supported yet ({_DESIGN}, steps 2-3); "
                f"{_WITHOUT}")
        if self.conditional:
            raise CaptureError(
                    f"{label} applies its update under control flow (tf.cond, a loop): "
                    "the run applies one update every step; apply it unconditionally, or "
                    f"{_WITHOUT}")


def _applying_optimizer():
    """The Keras optimizer whose `apply` is running (its name scope's caller), or None."""
    import keras
    from keras.src.backend.common import global_state

    for entry in reversed(global_state.get_global_attribute("name_scope_stack") or []):
        if isinstance(getattr(entry, "caller", None), keras.optimizers.Optimizer):
            return entry.caller
    return None


def _optimizers_of(model) -> list:
    """The model's optimizers: its compiled one and any it holds as attributes."""
    import keras

    found = [model.optimizer]
    for value in vars(model).values():
        if isinstance(value, keras.optimizers.Optimizer) and all(value is not o for o in found):
            found.append(value)
    return found


def _count_parts_of_batches(model, metric_variables: list, finals: list,
                            zeros: list) -> list:
    """The metric contributions, where a Mean tracker updated with one value per batch
    (`tracker.update_state(loss)`: its count does not read the batch) counts a
    replica's part of one batch with its part's value (`keras_metrics.count_batches_once`,
    as Keras' per-output loss trackers); a tracker the step leaves alone stays zero."""
    values = {id(v): final for v, final in zip(metric_variables, finals)}
    untouched = {id(v) for v, final, zero in zip(metric_variables, finals, zeros)
                 if final is zero}
    count_batches_once([m for m in _all_metrics(model)
                        if id(getattr(m, "count", None)) not in untouched and
                        counts_batches(m, values)], values)
    return [tf.identity(values[id(v)]) for v in metric_variables]


def _all_metrics(model) -> list:
    """The model's metrics, and those a container holds (compiled metrics)."""
    out = []
    for metric in model.metrics:
        out.append(metric)
        out += [m for m in getattr(metric, "metrics", []) or [] if m is not metric]
    return out


def _moving_statistics(model) -> set[int]:
    """The ids of the batch-normalization layers' moving statistics."""
    import keras

    flatten = getattr(model, "_flatten_layers", None)
    return {id(v) for layer in (flatten(include_self=False) if flatten else [])
            if isinstance(layer, keras.layers.BatchNormalization)
            for v in (layer.moving_mean, layer.moving_variance)}


def _reads(tensor, sources: set):
    """The first op of `sources` that `tensor` is computed from, or None."""
    seen, todo = set(), [tensor.op]
    while todo:
        op = todo.pop()
        if op in sources:
            return op
        if op in seen:
            continue
        seen.add(op)
        todo.extend(t.op for t in op.inputs)
    return None
