"""Variable constraints at capture: each constraint traced into a graph that equals Keras'
constraint, a constraint that is not a function of the value refused naming the
variable, and constrained variables kept whole (no partitionable axes, no strategy that
splits them). The numbers on clusters: tests/runtime/test_constraints.py."""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

import keras
from keras import ops
from autodist.ir.capture import capture
from autodist.ir.errors import CaptureError
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.search import builders
from autodist.search.space import SearchSpace

from tests.ir.test_strategy import _partition, assert_invalid


class ClipWeights(keras.constraints.Constraint):
    """The WGAN critic's weight clip."""

    def __init__(self, limit: float) -> None:
        self.limit = limit

    def __call__(self, w):
        return ops.clip(w, -self.limit, self.limit)


CONSTRAINTS = {
    "dense/kernel": keras.constraints.MaxNorm(0.5),
    "dense/bias": keras.constraints.NonNeg(),
    "dense_1/kernel": keras.constraints.UnitNorm(axis=1),
    "dense_1/bias": ClipWeights(0.01),
    "dense_2/kernel": keras.constraints.MinMaxNorm(0.2, 0.4, rate=0.5),
    "embedding/embeddings": keras.constraints.UnitNorm(axis=1),
}


def _model(constraint=None) -> keras.Model:
    """Dense layers and an Embedding with `CONSTRAINTS` (or only `constraint`, on the
    first kernel)."""
    c = (lambda name: CONSTRAINTS[name]) if constraint is None else \
        (lambda name: constraint if name == "dense/kernel" else None)
    x = keras.Input((5,), name="x")
    ids = keras.Input((3,), dtype="int32", name="ids")
    rows = keras.layers.Embedding(11, 4, embeddings_constraint=c("embedding/embeddings"),
                                  name="embedding")(ids)
    h = keras.layers.Dense(6, kernel_constraint=c("dense/kernel"),
                           bias_constraint=c("dense/bias"), name="dense")(x)
    h = keras.layers.Dense(4, kernel_constraint=c("dense_1/kernel"),
                           bias_constraint=c("dense_1/bias"), name="dense_1")(h)
    h = keras.layers.Concatenate()([h, keras.layers.Flatten()(rows)])
    out = keras.layers.Dense(1, kernel_constraint=c("dense_2/kernel"), name="dense_2")(h)
    model = keras.Model([x, ids], out)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


@pytest.fixture(scope="module")
def item() -> GraphItem:
    return capture(_model())


def _traced(info, value: np.ndarray) -> np.ndarray:
    """The captured constraint graph of `info` run on `value`."""
    graph_def = graph_pb2.GraphDef()
    graph_def.ParseFromString(info.constraint.graph_def)
    graph = tf.Graph()
    with graph.as_default():
        feed = tf.compat.v1.placeholder(tf.as_dtype(info.dtype), list(info.shape))
        [out] = tf.import_graph_def(graph_def, {info.constraint.value_tensor: feed},
                                    [info.constraint.constrained_tensor])
        with tf.compat.v1.Session() as session:
            return session.run(out, {feed: value})


def test_every_traced_constraint_equals_keras_on_random_values(item):
    rng = np.random.default_rng(3)
    constrained = {v.name: v for v in item.variables if v.HasField("constraint")}
    assert sorted(constrained) == sorted(CONSTRAINTS)
    for name, info in constrained.items():
        assert info.constraint.class_name == type(CONSTRAINTS[name]).__name__
        for scale in (0.01, 1.0, 30.0):
            value = (scale * rng.normal(size=list(info.shape))).astype(np.float32)
            want = np.asarray(CONSTRAINTS[name](keras.Variable(value)))
            np.testing.assert_allclose(_traced(info, value), want, rtol=1e-6, atol=1e-7,
                                       err_msg=name)


def test_constrained_variables_have_no_partitionable_axes(item):
    for v in item.variables:
        if v.HasField("constraint"):
            assert list(v.partitionable_axes) == [], v.name
    # The others keep theirs; the item survives its serialization checks.
    assert list(item.variable("dense_2/bias").partitionable_axes) == []  # one element
    assert list(GraphItem.deserialize(item.serialize()).variable(
        "embedding/embeddings").partitionable_axes) == []


def test_no_builder_nor_the_search_splits_a_constrained_variable(item):
    spec = ResourceSpec.local(workers=2, ps=2)
    for name, builder in builders.STRATEGY_BUILDERS.items():
        strategy = builder().build(item, spec)
        strategy.validate(item, spec)
        for config in strategy.variables:
            if item.variable(config.var_name).HasField("constraint"):
                assert config.partitioner.num_shards <= 1, (name, config.var_name)
    space = SearchSpace(item, spec)
    for info, options in zip(space.variables, space.options):
        if info.HasField("constraint"):
            assert all(o.partitioner.num_shards <= 1 for o in options), info.name


def test_validation_refuses_a_strategy_that_partitions_a_constrained_variable(item):
    spec = ResourceSpec.local(workers=2, ps=2)
    strategy = builders.PS().build(item, spec)
    _partition(strategy, "embedding/embeddings", 0, 2)
    assert_invalid(strategy, item, spec,
                   r"variable 'embedding/embeddings' has a constraint \(UnitNorm\), which "
                   r"Keras applies to the whole variable after each update: it cannot be "
                   r"partitioned",
                   variable="embedding/embeddings", field="partitioner.num_shards",
                   received=2)


class _NeedsNumpy(keras.constraints.Constraint):
    def __call__(self, w):
        return np.clip(w.numpy(), -1, 1)


class _CountsCalls(keras.constraints.Constraint):
    """Python state: each call scales by another factor."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, w):
        self.calls += 1
        return w * (0.5 ** self.calls)


class _ReadsVariable(keras.constraints.Constraint):
    def __init__(self) -> None:
        self.limit = tf.Variable(1.0)

    def __call__(self, w):
        return ops.clip(w, -self.limit, self.limit)


class _Draws(keras.constraints.Constraint):
    def __call__(self, w):
        return w + tf.random.uniform(tf.shape(w))


class _Reshapes(keras.constraints.Constraint):
    def __call__(self, w):
        return ops.reshape(w, [-1])


@pytest.mark.parametrize("constraint, why", [
    (_NeedsNumpy(), "cannot be traced as a TensorFlow function of the variable's value"),
    (_CountsCalls(), "gives other values than its traced graph"),
    (_ReadsVariable(), "reads a variable"),
    (_Draws(), r"has side effects or random draws \(RandomUniform"),
    (_Reshapes(), r"returns shape \(30,\) for a variable of shape \[5, 6\]"),
], ids=["numpy", "python_state", "variable", "random", "shape"])
def test_a_constraint_that_is_not_a_function_of_the_value_is_refused(constraint, why):
    model = _model(constraint)
    with pytest.raises(CaptureError, match=f"(?s)the constraint {type(constraint).__name__} "
                                           f"of variable 'dense/kernel' .*{why}"):
        capture(model)


def test_a_loss_functions_variable_keeps_its_constraint():
    """A Keras (or tf.compat.v1) optimizer applies a tf.Variable's `constraint` after
    its update: the capture of a loss function records it too."""
    w = tf.Variable(tf.ones([4, 3]), name="w", constraint=keras.constraints.NonNeg())
    b = tf.Variable(tf.zeros([3]), name="b")

    @tf.function
    def loss_fn(x):
        return tf.reduce_mean(tf.square(tf.matmul(x, w) + b))

    gi = capture(loss_fn, variables=[w, b], input_signature=[tf.TensorSpec([None, 4])],
                 optimizer=keras.optimizers.SGD(0.1))
    assert gi.variable("w").constraint.class_name == "NonNeg"
    assert list(gi.variable("w").partitionable_axes) == []
    assert not gi.variable("b").HasField("constraint")
    value = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    np.testing.assert_array_equal(_traced(gi.variable("w"), value), np.maximum(value, 0))


def test_a_v1_graphs_variable_keeps_its_constraint():
    """A tf.compat.v1.train optimizer assigns a variable's `constraint` after its update
    (its `apply_gradients`): the capture of a v1 graph records it (it was dropped)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        w = tf.compat.v1.get_variable("w", [4, 3], use_resource=True,
                                      constraint=lambda v: tf.clip_by_value(v, -0.1, 0.1))
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w)))
        optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    gi = capture(loss, optimizer=optimizer)
    assert list(gi.variable("w").partitionable_axes) == []
    value = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    np.testing.assert_array_equal(_traced(gi.variable("w"), value), np.clip(value, -0.1, 0.1))


def test_the_summary_names_the_constraints_and_the_text_leaves_their_graphs_out(item):
    assert "  constraints: dense/kernel MaxNorm, dense/bias NonNeg, " in item.summary()
    text = item.to_text()
    assert 'class_name: "UnitNorm"' in text and "graph_def" not in text
    assert text.count("constraint {") == len(CONSTRAINTS)
