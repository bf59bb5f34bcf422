"""The optimizer recorded as data (`OptimizerInfo`): algorithm,
hyper-parameters, slots, loss scaling."""
from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from autodist.ir.capture.schedule import trace_schedule
from autodist.ir.errors import CaptureError
from autodist.proto import graph_item_pb2


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


# Methods a subclass of a supported Keras optimizer may define without changing its
# update: construction and config, and `get_gradients` (Keras 2's; Keras 3's fit never
# calls it: keras-io's gradient centralization overrides it and trains as RMSprop).
_HARMLESS_OVERRIDES = frozenset({"__init__", "get_config", "from_config", "get_gradients"})


def _keras_base_name(optimizer) -> str:
    """The name of the supported Keras optimizer class `optimizer` is, or subclasses
    without changing its update (its own class name where it is none of them).

    Raises:
        CaptureError: a subclass, or the instance itself, redefines a method of the
            optimizer (`apply_gradients`, `update_step`, ...): the run would build
            the plain optimizer's update and train something else than Keras fit.
    """
    import inspect

    import keras

    mro = type(optimizer).__mro__
    base = next((k for k in mro if k.__name__ in _KERAS_ALGORITHMS and
                 getattr(keras.optimizers, k.__name__, None) is k), None)
    if base is None:
        return type(optimizer).__name__
    overridden = sorted({name for klass in mro[:mro.index(base)] for name in vars(klass)
                         if name not in _HARMLESS_OVERRIDES and callable(getattr(base, name,
                                                                                 None))})
    patched = sorted(name for name, value in vars(optimizer).items()
                     if callable(value) and inspect.isfunction(getattr(base, name, None)))
    if overridden or patched:
        where = (f"{type(optimizer).__qualname__} overrides {overridden}" if overridden else
                 f"the instance's {patched} replace keras.optimizers.{base.__name__}'s")
        raise CaptureError(
            f"the model's optimizer is a keras.optimizers.{base.__name__} whose update is "
            f"changed ({where}): autodist builds {base.__name__}'s update from its config on "
            "every task, so the change would not run and the run would train something "
            "else than Keras fit. Change the gradients in the model's own train_step "
            f"(compute them, change them, then self.optimizer.apply(...) of a plain "
            f"{base.__name__}), or train this model with Keras' fit on one device")
    return base.__name__


def describe_optimizer(optimizer, variables,
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
        class_name = _keras_base_name(optimizer)
        algorithm = _KERAS_ALGORITHMS.get(class_name)
        if algorithm is None:
            raise CaptureError(
                f"unsupported Keras optimizer {type(optimizer).__name__}; supported: "
                f"{sorted(_KERAS_ALGORITHMS)} (autodist builds their updates from the "
                "optimizer's config on every task). Another update can run in the model's "
                "own train_step only as one of these")
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
            info.learning_rate_schedule.CopyFrom(trace_schedule(rate))
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
    info = describe_optimizer(inner, variables, names)
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


def _describe(value) -> str:
    return getattr(value, "__qualname__", None) or type(value).__name__


def slot_names(info: graph_item_pb2.OptimizerInfo, var_name: str) -> list[str]:
    """The optimizer's slots of one variable, as the kernels name them."""
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
