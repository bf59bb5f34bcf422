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

Modules: `dispatch` (the entry point), `keras_model`, `function` and
`v1_graph` (one per source; `keras_train_step` for a model's own `train_step`,
with `step_logs` and `step_parts`), `keras_specs`, `keras_loss`, `keras_metrics` and
`added_losses` (a Keras model's parts), `traced_function`, `graph_cleanup`
and `assemble` (a traced graph to a GraphItem), `example_runs` (the step run
on random examples), `draw_rows` (which rows of a random draw are whose
example), `optimizer` and `schedule` (the optimizer as data),
`names`.
"""
from autodist.ir.capture.added_losses import ADDED_LOSS_SCALE
from autodist.ir.capture.dispatch import DEFAULT_ESTIMATE_BATCH_SIZE, capture
from autodist.ir.capture.keras_metrics import keras_metric_variables
from autodist.ir.capture.names import keras_variable_names, unique_names
from autodist.ir.capture.optimizer import describe_optimizer, slot_names
from autodist.ir.capture.step_logs import import_step_logs

# The names tests import from before the split into a package.
_optimizer_info = describe_optimizer
_slot_names = slot_names

__all__ = ["ADDED_LOSS_SCALE", "DEFAULT_ESTIMATE_BATCH_SIZE", "capture", "describe_optimizer",
           "import_step_logs", "keras_metric_variables", "keras_variable_names", "slot_names",
           "unique_names"]
