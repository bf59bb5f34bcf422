"""A Keras learning-rate schedule traced into a graph of the step, checked
against the schedule itself."""
from __future__ import annotations

import json
import math

import numpy as np
import tensorflow as tf

from autodist.ir.capture import user_function
from autodist.ir.errors import CaptureError
from autodist.proto import graph_item_pb2


# Steps at which a traced schedule must equal the schedule itself.
_SCHEDULE_CHECK_STEPS = (0, 1, 2, 3, 7, 10, 99, 100, 101, 1000, 12345, 1000000)


def trace_schedule(schedule) -> graph_item_pb2.LearningRateSchedule:
    """Traces a Keras LearningRateSchedule into a graph of the step.

    The graph is checked against the schedule at a few steps, so a schedule
    whose value depends on Python state rather than on the step is refused.
    """
    import keras

    name = type(schedule).__name__
    concrete = user_function.trace(lambda step: tf.convert_to_tensor(schedule(step)),
                                   tf.TensorSpec([], tf.int64, name="step"),
                                   f"the learning-rate schedule {name}", "the step")
    rate = concrete.structured_outputs
    if rate.shape.rank != 0 or not rate.dtype.is_floating:
        raise CaptureError(f"the learning-rate schedule {name} must return a float scalar. "
                           f"Received: {rate.dtype.name} of shape {rate.shape}")
    wants = {step: float(np.asarray(schedule(tf.constant(step, tf.int64))))
             for step in _SCHEDULE_CHECK_STEPS}
    # Eager float32 ops and the graph's (which Keras' fit runs, as the run does) round
    # apart where terms cancel: keras-io's WarmUpCosine near the cosine's end differs by
    # 1.8e-6 relative. What depends on other state differs by far more.
    floor = 1e-6 * max(abs(w) for w in wants.values())
    for step, want in wants.items():
        got = float(concrete(tf.constant(step, tf.int64)))
        if not math.isclose(got, want, rel_tol=1e-5, abs_tol=max(floor, 1e-12)):
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
        graph_def=user_function.serialized_graph(concrete),
        step_tensor=concrete.inputs[0].name, learning_rate_tensor=rate.name)

