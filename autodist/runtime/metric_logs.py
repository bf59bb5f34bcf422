"""Keras' metric logs of a distributed run, from the metrics' summed state.

Every step returns each metric variable's contribution of its batch (the
metric updated from zero, see `GraphItem.metric_states`); summed over
replicas and steps it is the state the metric would have after them. The
driver puts such a sum into the model's own metric objects and asks Keras for
their results, so the logs are Keras' own: the same names (per-output losses
and metrics included) and the same formulas. A model's own `train_step` logs
what it returns: the capture's function of the metrics' state
(`CustomStepInfo.logs_graph_def`), evaluated on the summed state; those logs
are the whole of Keras' logs (`complete`), "loss" included where it logs one.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from autodist.ir.errors import AutodistError
from autodist.ir.graph_item import GraphItem


class MetricLogs:
    """Summed metric states -> Keras' logs (without "loss", which the run computes).

    Args:
        model: The user's Keras model (its metrics as compiled).
        graph_item: Its capture (which metric variables the states are for).

    Raises:
        AutodistError: the model's metrics are not those it was captured with.
    """

    def __init__(self, model, graph_item: GraphItem) -> None:
        from autodist.ir.capture import (keras_metric_variables,
                                         unique_names)

        self.model = model
        self._results = None  # the traced `_assign_and_read`, on first use
        self._custom = graph_item.proto.custom_step if \
            graph_item.proto.HasField("custom_step") else None
        names = [t.name for t in graph_item.metric_states]
        self.variables = keras_metric_variables(model) if names else []
        found = unique_names([v.path for v in self.variables])
        if found != names:
            raise AutodistError(
                f"the model's metrics ({found[:10]}) are not those it was captured with "
                f"({names[:10]}): capture the model again after compile()")

    def reused(self, model, graph_item: GraphItem) -> MetricLogs:
        """This object where `model`'s metric variables are still the same objects (a
        later fit of the same run: its traced function is reused, so repeated fits do not
        retrace, which TensorFlow warns about), else a new one."""
        fresh = MetricLogs(model, graph_item)
        if model is self.model and [id(v) for v in fresh.variables] == \
                [id(v) for v in self.variables]:
            return self
        return fresh

    def __bool__(self) -> bool:
        return bool(self.variables)

    @property
    def complete(self) -> bool:
        """Whether these logs are all of Keras' logs (a model's own train_step's), the
        run's "loss" not among them unless the step logs it."""
        return self._custom is not None

    @property
    def keys(self) -> list[str]:
        """The logs' keys where `complete` (empty otherwise: the compiled metrics')."""
        return [log.name for log in self._custom.logs] if self._custom is not None else []

    def __call__(self, states: Sequence[Any]) -> dict[str, float]:
        """The logs of metrics whose state is `states` (empty without metrics)."""
        if not self.variables or not states:
            return {}
        if self._results is None:
            # One traced function: assigning each variable and asking each metric
            # eagerly costs milliseconds, and a progress bar asks every step.
            self._results = tf.function(self._assign_and_read if self._custom is None
                                        else self._step_logs)
        results = self._results([tf.convert_to_tensor(np.asarray(state, dtype=variable.dtype))
                                 for variable, state in zip(self.variables, states)])
        return {name: float(np.asarray(value)) for name, value in results.items()
                if name != "loss" or self._custom is not None}

    def _step_logs(self, states: list) -> dict[str, Any]:
        """The custom step's logs of the metrics' `states` (its logs graph imported)."""
        from autodist.ir.capture import import_step_logs

        return import_step_logs(self._custom, states)

    def _assign_and_read(self, states: list) -> dict[str, Any]:
        for variable, state in zip(self.variables, states):
            variable.assign(state)
        return self.model.get_metrics_result()
