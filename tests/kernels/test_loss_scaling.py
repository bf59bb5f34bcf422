"""Dynamic loss scaling equals Keras' LossScaleOptimizer, step by step.

Keras' LossScaleOptimizer is given gradients of the scaled loss (some steps
with an infinity or a NaN) through `apply`, as `fit` does; the kernels get
the same gradients, divide them by the scale, gate the update on their
finiteness (`loss_scaling.Gated`) and move the scale (`loss_scaling.advance`).
Weights, slots, the scale, its counter and the update count must agree after
every step, through skipped steps, a doubling and halvings. Strategies where no
one check sees every gradient of a step are refused, and never searched.
"""
from __future__ import annotations

import types

import numpy as np
import pytest
import tensorflow as tf

import keras
from autodist.ir.capture import _optimizer_info, _slot_names, capture
from autodist.ir.errors import CaptureError, StrategyError
from autodist.ir.resource_spec import ResourceSpec
from autodist.kernels import loss_scaling
from autodist.kernels.optimizers import ReducedGradient, Slots, apply_update, clip_gradients
from autodist.kernels.program import Program
from autodist.kernels.variables import VariableSpec, create_variables
from autodist.search import builders
from autodist.search.space import Consistency, SearchSpace, SpaceOptions

SHAPES = {"kernel": (3, 4), "bias": (4,)}
# Finite, finite (the scale doubles after 2), overflow, NaN, finite, finite, finite.
BAD = {2: np.inf, 3: np.nan}
STEPS = 7
# As in test_optimizer_options: Adam's m / sqrt(v) amplifies float32 rounding.
TOLERANCE = 1e-5


def _gradients(rng) -> list[dict[str, np.ndarray]]:
    steps = []
    for i in range(STEPS):
        step = {n: (rng.normal(size=s) * 1000).astype(np.float32) for n, s in SHAPES.items()}
        if i in BAD:
            step["bias"][1] = BAD[i]
        steps.append(step)
    return steps


def _make(inner):
    return keras.optimizers.LossScaleOptimizer(inner(), initial_scale=64.0,
                                               dynamic_growth_steps=2)


def _keras(make, initial, steps):
    variables = {n: keras.Variable(v, name=n) for n, v in initial.items()}
    optimizer = make()
    trace = []

    @tf.function
    def apply(grads):
        optimizer.apply([grads[n] for n in SHAPES], [variables[n] for n in SHAPES])

    for grads in steps:
        apply({n: tf.constant(g) for n, g in grads.items()})
        trace.append(({n: v.numpy() for n, v in variables.items()},
                      float(optimizer.dynamic_scale.numpy()),
                      int(optimizer.step_counter.numpy()), int(optimizer.iterations.numpy())))
    return trace


def _kernels(make, initial, steps):
    info = _optimizer_info(make(), [])
    graph = tf.Graph()
    with graph.as_default():
        # The state's storage needs only the program's graph and optimizer.
        program = Program(types.SimpleNamespace(optimizer=info), None, ("worker", 0),
                          graph=graph)
        state = loss_scaling.create_state(program, "", shared=False)
        feeds = {n: tf.compat.v1.placeholder(tf.float32, s) for n, s in SHAPES.items()}
        inverse = tf.math.reciprocal(state.scale.read_value())
        unscaled = {n: f * inverse for n, f in feeds.items()}
        finite = loss_scaling.all_finite(list(unscaled.values()))
        clipped = clip_gradients(info, [ReducedGradient(n, unscaled[n]) for n in SHAPES])
        specs = [VariableSpec(n, s, tf.float32, "") for n, s in SHAPES.items()]
        weights = dict(zip(SHAPES, create_variables(graph, specs)))
        slot_specs = [VariableSpec(f"{n}/{slot}", SHAPES[n], tf.float32, "")
                      for n in SHAPES for slot in _slot_names(info, n)]
        slot_vars = dict(zip([s.name for s in slot_specs], create_variables(graph, slot_specs)))
        step = state.updates.read_value()
        updates = [apply_update(info, weights[n], g.grad,
                                Slots({s: slot_vars[f"{n}/{s}"] for s in _slot_names(info, n)}),
                                step, finite=finite)
                   for n, g in zip(SHAPES, clipped)]
        advance = loss_scaling.advance(state, info, finite, after=updates)
        with tf.compat.v1.Session() as session:
            session.run([v.initializer for v in list(weights.values()) + list(slot_vars.values())
                         + [state.scale, state.counter, state.updates]])
            session.run([weights[n].assign(initial[n]) for n in SHAPES])
            trace = []
            for grads in steps:
                session.run(updates + advance, {feeds[n]: g for n, g in grads.items()})
                trace.append(({n: session.run(weights[n].read_value()) for n in SHAPES},
                              *[x.item() for x in session.run(
                                  [state.scale.read_value(), state.counter.read_value(),
                                   state.updates.read_value()])]))
    return trace


@pytest.mark.parametrize("inner", [
    lambda: keras.optimizers.Adam(0.1),
    lambda: keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=1.0),
    lambda: keras.optimizers.AdamW(keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5),
                                   weight_decay=0.1),
], ids=["adam", "sgd_momentum_clipped", "adamw_schedule"])
def test_updates_and_scale_equal_keras_loss_scale_optimizer(inner):
    rng = np.random.default_rng(0)
    initial = {n: rng.normal(size=s).astype(np.float32) for n, s in SHAPES.items()}
    steps = _gradients(rng)
    want = _keras(lambda: _make(inner), initial, steps)
    got = _kernels(lambda: _make(inner), initial, steps)
    scales = [w[1] for w in want]
    assert scales == [64.0, 128.0, 64.0, 32.0, 32.0, 64.0, 64.0]  # doubles, halves, doubles
    for k, ((want_w, *want_state), (got_w, *got_state)) in enumerate(zip(want, got)):
        assert got_state == want_state, f"step {k}"
        for n in SHAPES:
            assert np.all(np.isfinite(got_w[n]))
            np.testing.assert_allclose(got_w[n], want_w[n], rtol=TOLERANCE, atol=TOLERANCE,
                                       err_msg=f"{n} after step {k}")


def test_the_capture_keeps_the_inner_optimizer_and_the_scaling():
    info = _optimizer_info(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=8.0, dynamic_growth_steps=5), [])
    assert (info.algorithm, info.class_name) == ("sgd", "SGD")
    assert (info.loss_scale.initial_scale, info.loss_scale.dynamic_growth_steps) == (8.0, 5)
    assert info.hyperparameters["learning_rate"] == pytest.approx(0.1)


def test_nested_loss_scale_optimizers_are_refused():
    inner = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(CaptureError, match="around another LossScaleOptimizer"):
        _optimizer_info(keras.optimizers.LossScaleOptimizer(inner), [])


def _mixed_model() -> keras.Model:
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        ids = keras.Input((3,), dtype="int32", name="ids")
        h = keras.layers.Flatten()(keras.layers.Embedding(50, 4, name="embedding")(ids))
        hidden = keras.layers.Dense(8, name="hidden")(h)
        outputs = keras.layers.Dense(1, dtype="float32", name="out")(hidden)
        model = keras.Model(ids, outputs)
        model.compile(optimizer="adam", loss="mse")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return model


@pytest.fixture(scope="module")
def mixed_item():
    return capture(_mixed_model())


@pytest.mark.parametrize("builder,why", [
    (builders.PS(sync=False), "asynchronous PS"),
    (builders.PS(staleness=2), "asynchronous PS"),
    (builders.Parallax(), "all-reduce and synchronous PS"),
    (builders.AllReduce(compressor="fp16_error_feedback"), "FP16_ERROR_FEEDBACK"),
], ids=["async", "stale", "hybrid", "error_feedback"])
def test_strategies_no_one_check_sees_are_refused(mixed_item, builder, why):
    spec = ResourceSpec.local(workers=2, ps=1)
    with pytest.raises(StrategyError) as raised:  # builders validate what they build
        builder.build(mixed_item, spec).validate(mixed_item, spec)
    assert why in str(raised.value) and "mixed_float16" in str(raised.value)


@pytest.mark.parametrize("builder", [builders.PS(), builders.AllReduce(),
                                     builders.AllReduce(compressor="fp16")],
                         ids=["ps", "all_reduce", "fp16"])
def test_one_kind_of_synchronous_update_is_accepted(mixed_item, builder):
    spec = ResourceSpec.local(workers=2, ps=1)
    builder.build(mixed_item, spec).validate(mixed_item, spec)


def test_the_search_proposes_only_strategies_loss_scaling_admits(mixed_item):
    spec = ResourceSpec.local(workers=2, ps=1)
    space = SearchSpace(mixed_item, spec, SpaceOptions(
        consistency=("sync", "async"), compressors=("none", "fp16_error_feedback")))
    for candidate in space.sample(40, np.random.default_rng(0)):
        space.decode(candidate).validate(mixed_item, spec)
    assert space.consistencies == [Consistency()]   # asynchronous training is not searched


def test_the_capture_marks_gradients_keras_sums_in_float16(mixed_item):
    # The float16 Dense's kernel and bias gradients are float16 sums over the batch;
    # the float32 output layer's are not, nor are the embedding's looked-up rows.
    by_layer = {v.name: v.gradient.float16_sum for v in mixed_item.variables}
    assert by_layer["hidden/kernel"] and by_layer["hidden/bias"]
    assert not by_layer["out/kernel"] and not by_layer["out/bias"], by_layer
    assert not by_layer["embedding/embeddings"]


def test_a_float16_sum_overflows_as_the_whole_batch_sum_does():
    # Two parts' gradients (scaled) each fit in float16; their sum, Keras' one float16
    # sum, does not: the step is not finite where Keras' is not.
    scale = tf.constant(1024.0)
    parts = [tf.constant([40000.0]) / scale, tf.constant([30000.0]) / scale]
    total = parts[0] + parts[1]
    assert bool(loss_scaling.all_finite([total]))   # float32: no overflow
    assert not bool(loss_scaling.all_finite([total], [True], scale))
    assert bool(loss_scaling.all_finite([total], [False], scale))
    assert bool(loss_scaling.all_finite([parts[0]], [True], scale))
    # Just under float16's largest finite value stays finite; a NaN never is.
    assert bool(loss_scaling.all_finite([tf.constant([65504.0]) / scale], [True], scale))
    assert not bool(loss_scaling.all_finite([tf.constant([np.nan])], [True], scale))
