"""Storage variables behave as tf.compat.v1.Variable where the passes rely on it.

In-process graph sessions with two logical CPU devices; sharing across task
processes is exercised by the cluster tests (tests/runtime).
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from autodist.kernels.variables import StorageVariable, VariableSpec, create_variable, \
    create_variables

CPU0, CPU1 = "/device:CPU:0", "/device:CPU:1"


def _session(graph: tf.Graph) -> tf.compat.v1.Session:
    config = tf.compat.v1.ConfigProto(device_count={"CPU": 2}, allow_soft_placement=False)
    return tf.compat.v1.Session(graph=graph, config=config)


def test_initial_values_shapes_and_devices():
    graph = tf.Graph()
    specs = [VariableSpec("autodist/vars/a", (2, 3), tf.float32, CPU1),
             VariableSpec("autodist/vars/a/slot/acc", (2, 3), tf.float32, CPU1, 0.1),
             VariableSpec("autodist/vars/b", (2, 3), tf.float32, CPU0),
             VariableSpec("autodist/step", (), tf.int64, CPU0),
             VariableSpec("autodist/stash", None, tf.float32, CPU0, initial_shape=(0,))]
    variables = create_variables(graph, specs)
    assert [v.op.name for v in variables] == [s.name for s in specs]
    for var, spec in zip(variables, specs):
        assert isinstance(var, StorageVariable)
        assert var.op.type == "VarHandleOp"
        assert var.op.get_attr("shared_name") == spec.name.encode()
        assert var.device == spec.device
        assert var.dtype == spec.dtype
    assert variables[0].shape == tf.TensorShape([2, 3])
    assert variables[4].shape.rank is None
    with graph.as_default():
        reads = [v.read_value() for v in variables]
    with _session(graph) as session:
        session.run([v.initializer for v in variables])
        a, acc, b, step, stash = session.run(reads)
    np.testing.assert_array_equal(a, np.zeros((2, 3), np.float32))
    np.testing.assert_allclose(acc, np.full((2, 3), 0.1, np.float32))
    np.testing.assert_array_equal(b, np.zeros((2, 3), np.float32))
    assert step == 0 and step.dtype == np.int64
    assert stash.shape == (0,)


def test_assign_returns_the_new_value_or_the_op():
    graph = tf.Graph()
    var = create_variable(graph, VariableSpec("v", (2,), tf.float32, CPU0, 1.0))
    with graph.as_default():
        added = var.assign_add([1.0, 2.0])
        subtracted = var.assign_sub([0.5, 0.5], read_value=False)
        assigned = var.assign([7.0, 8.0], read_value=False)
    assert isinstance(subtracted, tf.Operation) and isinstance(assigned, tf.Operation)
    with _session(graph) as session:
        session.run(var.initializer)
        np.testing.assert_allclose(session.run(added), [2.0, 3.0])
        session.run(subtracted)
        np.testing.assert_allclose(session.run(var.read_value()), [1.5, 2.5])
        session.run(assigned)
        np.testing.assert_allclose(session.run(var.read_value()), [7.0, 8.0])


def test_same_name_shares_the_resource_as_tf_variables_do():
    # A tf.compat.v1.Variable's shared name is its name: a storage variable of
    # that name on the same device is the same resource (the node is renamed).
    graph = tf.Graph()
    with graph.as_default(), tf.device(CPU1):
        keras_free = tf.compat.v1.Variable(tf.fill([3], 5.0), name="autodist/vars/w",
                                           trainable=False, use_resource=True)
    var = create_variable(graph, VariableSpec("autodist/vars/w", (3,), tf.float32, CPU1))
    assert var.op.name != "autodist/vars/w"
    assert var.op.get_attr("shared_name") == keras_free.handle.op.get_attr("shared_name")
    with graph.as_default():
        update = var.assign_add([1.0, 1.0, 1.0], read_value=False)
    with _session(graph) as session:
        session.run(keras_free.initializer)
        session.run(update)
        np.testing.assert_allclose(session.run(keras_free.read_value()), [6.0, 6.0, 6.0])


def test_caller_device_scope_applies_and_control_dependencies_do_not():
    graph = tf.Graph()
    with graph.as_default():
        gate = tf.no_op(name="gate")
        with tf.device("/job:localhost/replica:0/task:0" + CPU1), \
                tf.control_dependencies([gate]):
            var = create_variable(graph, VariableSpec("scoped", (1,), tf.float32, ""))
    assert var.device == "/job:localhost/replica:0/task:0" + CPU1
    assert gate not in var.initializer.control_inputs
    assert not var.op.control_inputs


def test_bad_specs_are_named():
    with pytest.raises(ValueError, match=r"'v' needs a fully defined shape.*\[2, None\]"):
        VariableSpec("v", (2, None), tf.float32, CPU0)
    spec = VariableSpec("v", (2,), tf.float32, CPU0)
    with pytest.raises(ValueError, match=r"unique.*\['v'\]"):
        create_variables(tf.Graph(), [spec, spec])
