"""Capture: variables, gradients, optimizer facts, op estimates, for all three sources."""
from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
import tensorflow as tf

import keras
from autodist import models
from autodist.ir.capture import capture
from autodist.ir.errors import CaptureError
from autodist.ir.graph_item import GraphItem


def _run_captured_step(graph_item: GraphItem, feeds: dict, variables: dict,
                       scalars: dict | None = None) -> dict:
    """Executes the captured GraphDef with real variables; returns loss and gradients.

    Proves the GraphDef is self-contained and that the recorded tensor names
    are the gradients: handles of live variables replace the captured
    placeholders, as the runtime's rewrite will.
    """
    graph_def = graph_item.graph_def()
    fetch_names = [graph_item.loss_tensor]
    for v in graph_item.variables:
        g = v.gradient
        fetch_names += [g.dense] if g.dense else [g.values, g.indices]

    def run():
        input_map = {f"{v.handle_node}:0": tf.identity(variables[v.name].handle)
                     for v in graph_item.variables}
        for state in graph_item.state_variables:
            input_map[f"{state.handle_node}:0"] = tf.identity(variables[state.name].handle)
        for info in graph_item.inputs:
            if info.name not in feeds and info.role == "sample_weight":
                # Unweighted: each example weighs 1.
                batch = len(next(iter(feeds.values())))
                input_map[info.tensor] = tf.ones([batch], tf.float32)
                continue
            input_map[info.tensor] = tf.constant(feeds[info.name])
        for name, value in (scalars or {}).items():  # scalar inputs of the step, by node
            input_map[f"{name}:0"] = tf.constant(value, tf.float32)
        return tf.graph_util.import_graph_def(graph_def, input_map=input_map,
                                              return_elements=fetch_names, name="step")

    outputs = [np.asarray(t) for t in tf.function(run)()]
    result = {"loss": outputs[0]}
    i = 1
    for v in graph_item.variables:
        if v.gradient.dense:
            result[v.name] = outputs[i]
            i += 1
        else:
            dense = np.zeros(v.shape, np.float32)
            np.add.at(dense, outputs[i + 1], outputs[i])
            result[v.name] = dense
            i += 2
    return result


def _reference_gradients(model, x, y) -> tuple[float, dict]:
    with tf.GradientTape() as tape:
        pred = model(x, training=True)
        loss = model.compute_loss(x=x, y=y, y_pred=pred, training=True)
    grads = tape.gradient(loss, [v.value for v in model.trainable_variables])
    out = {}
    for v, g in zip(model.trainable_variables, grads):
        out[v.path] = tf.convert_to_tensor(g).numpy()
    return float(loss), out


def test_mlp_variables_exact(mlp_item):
    gi = mlp_item
    assert gi.source == "keras"
    assert gi.variable_names == ["dense_0/kernel", "dense_0/bias", "dense_1/kernel",
                                 "dense_1/bias", "logits/kernel", "logits/bias"]
    kernel = gi.variable("dense_0/kernel")
    assert list(kernel.shape) == [784, 256]
    assert kernel.byte_size == 784 * 256 * 4
    assert kernel.dtype == "float32"
    assert not kernel.sparse_gradient
    assert list(kernel.partitionable_axes) == [0, 1]
    assert list(gi.variable("logits/bias").partitionable_axes) == [0]
    assert gi.num_parameters == 784 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    assert [i.name for i in gi.inputs] == ["features", "y", "sample_weight"]
    assert [i.role for i in gi.inputs] == ["x", "y", "sample_weight"]
    assert list(gi.inputs[0].shape) == [-1, 784]
    assert gi.inputs[1].dtype == "int32"  # sparse categorical labels
    assert gi.optimizer.algorithm == "sgd"
    assert gi.optimizer.hyperparameters["learning_rate"] == pytest.approx(0.01)
    assert all(not v.slots for v in gi.variables)  # plain SGD has no slots


def test_mlp_matmul_flops_exact(mlp_item):
    batch = mlp_item.proto.estimate_batch_size
    matmuls = [op for op in mlp_item.ops if op.type == "MatMul" and op.phase == "forward"]
    assert sorted(op.flops for op in matmuls) == sorted(
        [2.0 * batch * 784 * 256, 2.0 * batch * 256 * 256, 2.0 * batch * 256 * 10])
    first = next(op for op in matmuls if op.flops == 2.0 * batch * 784 * 256)
    assert first.output_bytes == batch * 256 * 4


def test_mlp_gradients_match_eager_tape(mlp_item):
    model = models.mlp()
    gi = capture(model)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 784)).astype(np.float32)
    y = rng.integers(0, 10, size=(8,)).astype(np.int32)
    got = _run_captured_step(gi, {"features": x, "y": y},
                             {v.path: v.value for v in model.trainable_variables})
    loss, expected = _reference_gradients(model, x, y)
    assert got["loss"] == pytest.approx(loss, rel=1e-6)
    for name, grad in expected.items():
        np.testing.assert_allclose(got[name], grad, rtol=1e-5, atol=1e-7)


def test_cnn_batchnorm_state_and_phases(cnn_item):
    gi = cnn_item
    assert len(gi.variables) == 13
    state = {s.name: s for s in gi.state_variables}
    assert set(state) == {f"{bn}/{stat}" for bn in ("stem_bn", "block_bn1", "block_bn2")
                          for stat in ("moving_mean", "moving_variance")}
    assert all(len(s.update_ops) == 1 for s in state.values())
    assert state["stem_bn/moving_mean"].byte_size == 16 * 4
    conv = gi.variable("stem_conv/kernel")
    assert list(conv.shape) == [3, 3, 3, 16] and conv.byte_size == 3 * 3 * 3 * 16 * 4
    assert list(conv.partitionable_axes) == [0, 1, 2, 3]
    # Forward ops precede backward ops in the recorded topological order.
    phases = [op.phase for op in gi.ops]
    last_forward = max(i for i, p in enumerate(phases) if p == "forward")
    first_backward = min(i for i, p in enumerate(phases) if p == "backward")
    assert last_forward < first_backward
    conv_ops = [op for op in gi.ops if op.type == "Conv2D"]
    batch = gi.proto.estimate_batch_size
    stem = next(op for op in conv_ops if "stem_conv" in op.name)
    assert stem.flops == 2.0 * batch * 32 * 32 * 16 * 3 * 3 * 3
    assert {op.type for op in gi.ops if op.phase == "backward"} >= {
        "Conv2DBackpropInput", "Conv2DBackpropFilter"}


def test_cnn_gradients_match_eager_tape():
    model = models.cnn(image_size=8)
    gi = capture(model)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 8, 8, 3)).astype(np.float32)
    y = rng.integers(0, 10, size=(4,)).astype(np.int32)
    got = _run_captured_step(gi, {"image": x, "y": y},
                             {v.path: v.value for v in model.variables})
    _, expected = _reference_gradients(model, x, y)
    for name, grad in expected.items():
        np.testing.assert_allclose(got[name], grad, rtol=1e-4, atol=1e-6)


def test_two_embedding_tables_are_sparse(ncf_item):
    gi = ncf_item
    sparse = {v.name for v in gi.variables if v.sparse_gradient}
    assert sparse == {"user_embedding/embeddings", "item_embedding/embeddings"}
    item = gi.variable("item_embedding/embeddings")
    assert list(item.shape) == [20011, 64] and item.byte_size == 20011 * 64 * 4
    assert list(item.partitionable_axes) == [0]  # a gather reads rows
    assert item.gradient.values and item.gradient.indices and not item.gradient.dense
    assert list(item.slots) == ["momentum", "velocity"]  # Keras Adam
    dense = gi.variable("mlp_hidden/kernel")
    assert dense.gradient.dense and not dense.gradient.values
    assert gi.optimizer.algorithm == "adam"
    assert gi.optimizer.hyperparameters["beta_2"] == pytest.approx(0.999)


def test_sparse_gradient_rows_count_every_lookup():
    """A history of 7 ids per example puts 7 rows per example in the gradient."""
    from autodist.search.space import lookups_per_example

    model = models.ctr_model(num_users=100, num_categories=10, history_len=7, dim=4)
    gi = capture(model, estimate_batch_size=16)
    assert lookups_per_example(gi) == {"user_embedding/embeddings": pytest.approx(1.0),
                                       "category_embedding/embeddings": pytest.approx(7.0)}


def test_embedding_gradients_match_eager_tape():
    model = models.embedding_model(num_users=50, num_items=70, dim=4)
    gi = capture(model)
    rng = np.random.default_rng(2)
    feeds = {"user": rng.integers(0, 50, (6, 1)).astype(np.int32),
             "item": rng.integers(0, 70, (6, 1)).astype(np.int32),
             "y": rng.integers(0, 2, (6, 1)).astype(np.float32)}
    got = _run_captured_step(gi, feeds, {v.path: v.value for v in model.trainable_variables})
    _, expected = _reference_gradients(model, [feeds["user"], feeds["item"]], feeds["y"])
    for name, grad in expected.items():
        np.testing.assert_allclose(got[name], grad, rtol=1e-5, atol=1e-7)


def test_transformer_capture(transformer_item):
    gi = transformer_item
    assert gi.variable("token_embedding/embeddings").sparse_gradient
    position = gi.variable("position_embedding/embeddings")
    assert not position.sparse_gradient and list(position.shape) == [16, 32]
    assert list(gi.variable("attention_0/query/kernel").shape) == [32, 2, 16]
    assert len(gi.variables) == 36
    assert any(op.type in ("Einsum", "BatchMatMulV2", "BatchMatMulV3") and op.flops > 0
               for op in gi.ops)


def test_language_model_capture():
    model = models.build("lm", vocab_size=500, seq_len=4, dim=8)
    gi = capture(model)
    table = gi.variable("token_embedding/embeddings")
    assert table.sparse_gradient and list(table.shape) == [500, 8]
    assert list(table.partitionable_axes) == [0]
    softmax = gi.variable("softmax/kernel")
    assert not softmax.sparse_gradient and list(softmax.shape) == [8, 500]
    assert sorted(v.name for v in gi.variables) == [
        "mix/bias", "mix/kernel", "softmax/bias", "softmax/kernel", "token_embedding/embeddings"]
    x, y = models.synthetic_data(model, 6)
    assert x.shape == (6, 4) and x.max() < 500 and y.shape == (6,) and y.max() < 500
    rng = np.random.default_rng(3)
    feeds = {"tokens": rng.integers(0, 500, (6, 4)).astype(np.int32),
             "y": rng.integers(0, 500, 6).astype(np.int32)}
    got = _run_captured_step(gi, feeds, {v.path: v.value for v in model.trainable_variables})
    _, expected = _reference_gradients(model, feeds["tokens"], feeds["y"])
    for name, grad in expected.items():
        np.testing.assert_allclose(got[name], grad, rtol=1e-4, atol=1e-6)


def test_op_dag_is_acyclic_and_annotated(mlp_item):
    dag = mlp_item.op_dag()
    assert nx.is_directed_acyclic_graph(dag)
    loss_op = mlp_item.loss_tensor.split(":")[0]
    assert loss_op in dag
    for v in mlp_item.variables:
        grad_op = v.gradient.dense.split(":")[0]
        assert nx.has_path(dag, v.handle_node, grad_op)
    assert sum(d["flops"] for _, d in dag.nodes(data=True)) == pytest.approx(mlp_item.total_flops)


def test_gradient_order_follows_backward_pass(mlp_item):
    order = {v.name: v.gradient_order for v in mlp_item.variables}
    # The last layer's gradient is ready first.
    assert order["logits/kernel"] < order["dense_1/kernel"] < order["dense_0/kernel"]


def test_serialization_round_trip(tmp_path, ncf_item):
    path = tmp_path / "gi.pb"
    ncf_item.save(path)
    loaded = GraphItem.load(path)
    assert loaded.proto == ncf_item.proto
    assert loaded.fingerprint == ncf_item.fingerprint
    assert "item_embedding/embeddings" in loaded.summary()
    bad = tmp_path / "bad.pb"
    bad.write_bytes(b"\xff\xff\xff")
    with pytest.raises(CaptureError, match="not a GraphItem"):
        GraphItem.load(bad)


def test_a_sequential_model_without_input_needs_an_example():
    """keras-io's multi_label_classification: a Sequential without keras.Input, which
    Keras' fit builds on the first batch; the error says how to pass one."""
    model = keras.Sequential([keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)])
    model.compile("adam", "binary_crossentropy")
    with pytest.raises(CaptureError, match=r"a Sequential model without keras.Input.*"
                                           r"optimize\(model, spec, x=\.\.\., y=\.\.\.\)"):
        capture(model)
    x = np.ones((2, 3), np.float32)
    gi = capture(model, x=x, y=np.ones((2, 2), np.float32))
    assert [list(v.shape) for v in gi.variables] == [[3, 4], [4], [4, 2], [2]]


def test_subclassed_model_needs_build_or_example():
    class Tiny(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(4)
            self.out = keras.layers.Dense(1)

        def call(self, x):
            return self.out(self.hidden(x))

    model = Tiny()
    model.compile(optimizer=keras.optimizers.RMSprop(0.01, momentum=0.5), loss="mse")
    x = np.ones((2, 3), np.float32)
    with pytest.raises(CaptureError, match="subclassed"):
        capture(model)
    model(x)
    gi = capture(model, x=x, y=np.ones((2, 1), np.float32))
    assert [list(v.shape) for v in gi.variables] == [[3, 4], [4], [4, 1], [1]]
    assert list(gi.variables[0].slots) == ["velocity", "momentum"]
    assert gi.optimizer.algorithm == "rmsprop"


class GCRMSprop(keras.optimizers.RMSprop):
    """keras-io's gradient centralization: Keras 2's `get_gradients`, which Keras 3's
    fit never calls (it trains as RMSprop)."""
    def get_gradients(self, loss, params):
        return [g - keras.ops.mean(g) for g in super().get_gradients(loss, params)]


class RMSprop(keras.optimizers.RMSprop):
    """A built-in's name whose update is changed (Keras trains the change)."""
    def apply_gradients(self, grads_and_vars):
        return super().apply_gradients([(g * 0.0, v) for g, v in grads_and_vars])


def test_an_optimizer_whose_update_is_changed_is_refused_naming_the_change():
    """Before, the run rebuilt the plain optimizer from its config under the class's
    name: it trained the unchanged update silently (keras-io's gradient centralization
    written for Keras 3: 2e-3 off)."""
    model = models.mlp(input_dim=4, hidden=(2,))
    model.compile(optimizer=RMSprop(0.01), loss="mse")
    with pytest.raises(CaptureError, match=r"RMSprop whose update is changed \(RMSprop "
                                           r"overrides \['apply_gradients'\]\).*train_step"):
        capture(model)
    patched = keras.optimizers.SGD(0.1)
    patched.apply_gradients = lambda grads_and_vars: None
    model.compile(optimizer=patched, loss="mse")
    with pytest.raises(CaptureError, match=r"the instance's \['apply_gradients'\] replace"):
        capture(model)
    model.compile(optimizer=GCRMSprop(0.01), loss="mse")
    assert capture(model).optimizer.algorithm == "rmsprop"


def test_uncompiled_and_unsupported_optimizer_errors():
    model = models.mlp(input_dim=4, hidden=(2,))
    model.compile(optimizer=keras.optimizers.Lion(), loss="mse")
    with pytest.raises(CaptureError, match="unsupported Keras optimizer Lion"):
        capture(model)
    fresh = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    with pytest.raises(CaptureError, match="not compiled"):
        capture(fresh)
    with pytest.raises(CaptureError, match="Received: int"):
        capture(3)


def test_function_capture():
    w = tf.Variable(tf.ones([4, 3]), name="w")
    emb = tf.Variable(tf.ones([10, 4]), name="emb")

    @tf.function
    def loss_fn(ids, y):
        h = tf.nn.embedding_lookup(emb, ids)
        return tf.reduce_mean(tf.square(tf.matmul(h, w) - y))

    gi = capture(loss_fn, variables=[w, emb],
                 input_signature=[tf.TensorSpec([None], tf.int32), tf.TensorSpec([None, 3])],
                 optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
    assert gi.source == "function" and gi.name == "loss_fn"
    assert gi.variable_names == ["w", "emb"]
    assert gi.variable("emb").sparse_gradient and not gi.variable("w").sparse_gradient
    assert list(gi.variable("w").slots) == ["momentum"]
    ids = np.array([1, 3, 3], np.int32)
    y = np.zeros((3, 3), np.float32)
    got = _run_captured_step(gi, {"input_0": ids, "input_1": y}, {"w": w, "emb": emb})
    with tf.GradientTape() as tape:
        loss = loss_fn(ids, y)
    gw, gemb = tape.gradient(loss, [w, emb])
    np.testing.assert_allclose(got["w"], gw.numpy(), rtol=1e-6)
    np.testing.assert_allclose(got["emb"], tf.convert_to_tensor(gemb).numpy(), rtol=1e-6)
    with pytest.raises(CaptureError, match="needs variables, input_signature"):
        capture(loss_fn)


def test_v1_graph_capture():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 5], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
        ids = tf.compat.v1.placeholder(tf.int32, [None], name="ids")
        w = tf.compat.v1.get_variable("W", [5, 1], use_resource=True)
        e = tf.compat.v1.get_variable("E", [7, 1], use_resource=True)
        pred = tf.matmul(x, w) + tf.nn.embedding_lookup(e, ids)[:, None, 0]
        loss = tf.reduce_mean(tf.square(pred - y))
        optimizer = tf.compat.v1.train.MomentumOptimizer(0.05, momentum=0.9, use_nesterov=True)
    gi = capture(loss, optimizer=optimizer)
    assert gi.source == "v1_graph"
    assert gi.variable_names == ["W", "E"]
    assert gi.variable("E").sparse_gradient and gi.variable("E").gradient.indices
    assert gi.variable("W").handle_node == "W"
    assert gi.optimizer.family == "v1" and gi.optimizer.algorithm == "sgd"
    hp = gi.optimizer.hyperparameters
    assert hp["learning_rate"] == pytest.approx(0.05) and hp["momentum"] == pytest.approx(0.9)
    assert hp["nesterov"] == 1.0
    assert list(gi.variable("W").slots) == ["momentum"]
    assert [i.name for i in gi.inputs] == ["x", "y", "ids"]
    assert all(op.phase in ("forward", "backward", "input") for op in gi.ops)

    ref_graph = tf.Graph()
    with ref_graph.as_default():
        tf.compat.v1.disable_resource_variables()
        try:
            v = tf.compat.v1.get_variable("R", [2], use_resource=False)
            ref_loss = tf.reduce_sum(v * tf.compat.v1.placeholder(tf.float32, [2]))
        finally:
            tf.compat.v1.enable_resource_variables()
        opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    with pytest.raises(CaptureError, match="reference variable"):
        capture(ref_loss, optimizer=opt)
    with pytest.raises(CaptureError, match="tf.compat.v1.train optimizer"):
        capture(loss, optimizer=keras.optimizers.SGD())


def test_v1_adam_hyperparameters():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 2])
        w = tf.compat.v1.get_variable("w", [2, 1], use_resource=True)
        loss = tf.reduce_mean(tf.matmul(x, w))
        optimizer = tf.compat.v1.train.AdamOptimizer(0.003, beta1=0.8)
    gi = capture(loss, optimizer=optimizer)
    hp = gi.optimizer.hyperparameters
    assert hp["learning_rate"] == pytest.approx(0.003)
    assert hp["beta_1"] == pytest.approx(0.8)
    assert list(gi.variable("w").slots) == ["m", "v"]


def test_shapes_derived_from_the_batch_are_inferred_not_guessed():
    # UpSampling2D's gradient reshapes to several dimensions derived from the batch; each
    # guessed as the batch made one op 2^52 bytes and optimize predicted 56,000 s a step.
    import keras

    inputs = keras.Input((4, 4, 2))
    h = keras.layers.UpSampling2D()(keras.layers.Conv2D(3, 3, padding="same")(inputs))
    model = keras.Model(inputs, keras.layers.Conv2DTranspose(1, 3, padding="same")(h))
    model.compile(optimizer="adam", loss="mse")
    gi = capture(model, estimate_batch_size=32)
    biggest = max(gi.ops, key=lambda op: op.output_bytes)
    # The largest tensors of the step: 32 x 8 x 8 x 3 floats.
    assert biggest.output_bytes <= 32 * 8 * 8 * 3 * 4, (biggest.name, biggest.output_bytes)
    assert gi.total_flops < 1e8


def test_a_graph_item_read_from_bytes_is_checked_field_by_field(mlp_item, tmp_path):
    from autodist.ir.graph_item import GraphItem

    path = tmp_path / "model.pb"
    mlp_item.save(path)
    assert GraphItem.load(path).fingerprint == mlp_item.fingerprint
    cases = [
        (lambda p: p.variables[0].shape.__setitem__(0, -3), "shape must hold non-negative"),
        (lambda p: setattr(p.variables[0], "byte_size", 7), "byte_size must be its"),
        (lambda p: setattr(p.variables[0], "dtype", "float7"), "dtype must be one of"),
        (lambda p: p.variables[0].partitionable_axes.append(5), "partitionable_axes must be"),
        (lambda p: setattr(p.variables[1], "name", p.variables[0].name), "must be set and unique"),
        (lambda p: setattr(p.ops[0], "flops", float("nan")), "finite FLOPs"),
        (lambda p: setattr(p, "schema_version", 99), "newer than 1"),
        (lambda p: p.optimizer.hyperparameters.__setitem__("learning_rate", float("inf")),
         r"hyperparameters\['learning_rate'\] must be finite"),
        (lambda p: p.loss_reductions.add(reduction="max", node="Sum"),
         r"loss_reductions\[0\] needs reduction 'sum' or 'mean_with_sample_weight'"),
    ]
    for edit, message in cases:
        proto = type(mlp_item.proto)()
        proto.CopyFrom(mlp_item.proto)
        edit(proto)
        path.write_bytes(proto.SerializeToString())
        with pytest.raises(CaptureError, match=message):
            GraphItem.load(path)
    path.write_bytes(b"\x08" + b"\xff" * 40)
    with pytest.raises(CaptureError, match="is not a GraphItem protobuf"):
        GraphItem.load(path)


def test_a_long_traced_error_keeps_its_last_line():
    """TensorFlow puts a traced error's cause last; a cut at 300 characters dropped it
    (keras-io's small-data ViT schedule: "where() got an unexpected keyword argument")."""
    from autodist.ir.capture.user_function import short_error

    error = ValueError("in user code:\n" + "    File ...\n" * 40 + "TypeError: the cause")
    text = short_error(error)
    assert len(text) < 320 and text.startswith("ValueError: in user code") and \
        text.endswith("TypeError: the cause")
