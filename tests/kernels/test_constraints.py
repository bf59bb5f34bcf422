"""A variable's constraint after its update, as Keras' `Optimizer.apply` assigns it: after
every update of the step (dense, a sparse scatter, slots), and not at all on a step a
LossScaleOptimizer skips (Keras then calls no inner `apply`). Checked on the built graph
against Keras' optimizer on the same gradients; the whole lowering on clusters in
tests/runtime/test_constraints.py."""
from __future__ import annotations

import types

import numpy as np
import pytest
import tensorflow as tf

import keras
from autodist.ir.capture import _optimizer_info, _slot_names
from autodist.ir.capture.constraints import trace_constraint
from autodist.kernels import loss_scaling
from autodist.kernels.optimizers import Slots, apply_constraint, apply_update
from autodist.kernels.program import Program
from autodist.kernels.variables import VariableSpec, create_variables

SHAPE = (6, 3)
# As tests/kernels/test_optimizers.py: Adam's formula in another order of float operations.
TOLERANCE = 1e-5


class Shrink(keras.constraints.Constraint):
    """Not idempotent: applied on a skipped step, the weights would differ from Keras'."""

    def __call__(self, w):
        return (w - keras.ops.mean(w, axis=0, keepdims=True)) * 0.9


def _keras(optimizer, constraint, initial, grads):
    variable = keras.Variable(initial)
    variable.constraint = constraint  # as a layer's add_weight(constraint=...) sets it
    trace = []

    @tf.function
    def apply(grad):
        optimizer.apply([grad], [variable])

    for g in grads:
        apply(g)
        trace.append(variable.numpy())
    return trace


def _kernels(optimizer, constraint, initial, grads):
    info = _optimizer_info(optimizer, [])
    traced = trace_constraint(constraint, "v", tf.float32, list(SHAPE))
    graph = tf.Graph()
    with graph.as_default():
        [var] = create_variables(graph, [VariableSpec("v", SHAPE, tf.float32, "")])
        slot_names = _slot_names(info, "v")
        slots = dict(zip(slot_names, create_variables(
            graph, [VariableSpec(f"v/{s}", SHAPE, tf.float32, "") for s in slot_names])))
        feed = _feed(grads[0])
        finite, advance = None, []
        step = tf.compat.v1.placeholder_with_default(tf.constant(0, tf.int64), [])
        if info.HasField("loss_scale"):
            program = Program(types.SimpleNamespace(optimizer=info), None, ("worker", 0),
                              graph=graph)
            state = loss_scaling.create_state(program, "", shared=False)
            grad = _divide(feed, state.scale.read_value())
            finite = loss_scaling.all_finite([grad])
            step = state.updates.read_value()
        else:
            grad, state = feed, None
        update = apply_update(info, var, grad, Slots(slots), step, finite=finite)
        constrained = apply_constraint(traced, var, update, finite)
        if state is not None:
            advance = loss_scaling.advance(state, info, finite, after=[constrained])
        with tf.compat.v1.Session() as session:
            session.run([v.initializer for v in [var, *slots.values()]] +
                        ([] if state is None else
                         [state.scale.initializer, state.counter.initializer,
                          state.updates.initializer]))
            session.run(var.assign(initial))
            trace = []
            for k, g in enumerate(grads):
                feeds = _feed_dict(feed, g)
                if state is None:  # the update count (under loss scaling: its variable)
                    feeds[step] = k
                session.run([constrained] + advance, feeds)
                trace.append(session.run(var.read_value()))
    return trace


def _feed(example):
    if isinstance(example, tf.IndexedSlices):
        return tf.IndexedSlices(tf.compat.v1.placeholder(tf.float32, [None, SHAPE[1]]),
                                tf.compat.v1.placeholder(tf.int64, [None]),
                                tf.constant(SHAPE, tf.int64))
    return tf.compat.v1.placeholder(tf.float32, SHAPE)


def _feed_dict(feed, grad) -> dict:
    if isinstance(feed, tf.IndexedSlices):
        return {feed.values: grad.values.numpy(), feed.indices: grad.indices.numpy()}
    return {feed: grad.numpy()}


def _divide(grad, scale):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / scale, grad.indices, grad.dense_shape)
    return grad / scale


def _gradients(sparse: bool, scale: float = 1.0, bad: tuple[int, ...] = ()):
    rng = np.random.default_rng(0)
    out = []
    for i in range(5):
        if sparse:  # rows 0 and 3 looked up, 3 twice: the other rows change by the constraint
            values = rng.normal(size=(3, SHAPE[1])) * scale
            if i in bad:
                values[0, 0] = np.inf
            out.append(tf.IndexedSlices(tf.constant(values, tf.float32),
                                        tf.constant([0, 3, 3], tf.int64),
                                        tf.constant(SHAPE, tf.int64)))
        else:
            values = rng.normal(size=SHAPE) * scale
            if i in bad:
                values[1, 2] = np.nan
            out.append(tf.constant(values, tf.float32))
    return out


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("optimizer, constraint", [
    (lambda: keras.optimizers.SGD(0.5), lambda: keras.constraints.UnitNorm(axis=1)),
    (lambda: keras.optimizers.Adam(0.3), lambda: keras.constraints.MaxNorm(1.0, axis=0)),
    (lambda: keras.optimizers.SGD(0.5, momentum=0.9), Shrink),
], ids=["sgd_unitnorm", "adam_maxnorm", "momentum_shrink"])
def test_the_constraint_follows_the_update_as_in_keras(optimizer, constraint, sparse):
    initial = np.random.default_rng(1).normal(size=SHAPE).astype(np.float32)
    grads = _gradients(sparse)
    want = _keras(optimizer(), constraint(), initial, grads)
    got = _kernels(optimizer(), constraint(), initial, grads)
    for k, (w, g) in enumerate(zip(want, got)):
        np.testing.assert_allclose(g, w, rtol=TOLERANCE, atol=TOLERANCE, err_msg=f"step {k}")
    assert not np.allclose(want[-1], _keras(optimizer(), None, initial, grads)[-1])


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_a_step_the_loss_scale_skips_applies_no_constraint(sparse):
    def optimizer():
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5),
                                                   initial_scale=8.0, dynamic_growth_steps=2)

    initial = np.random.default_rng(1).normal(size=SHAPE).astype(np.float32)
    grads = _gradients(sparse, scale=8.0, bad=(1, 2))
    want = _keras(optimizer(), Shrink(), initial, grads)
    got = _kernels(optimizer(), Shrink(), initial, grads)
    np.testing.assert_array_equal(want[1], want[0])   # skipped: not even the constraint
    for k, (w, g) in enumerate(zip(want, got)):
        np.testing.assert_allclose(g, w, rtol=TOLERANCE, atol=TOLERANCE, err_msg=f"step {k}")
