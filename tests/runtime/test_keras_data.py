"""fit's x, y and sample weights taken as Keras' data adapters take them (no cluster)."""
from __future__ import annotations

import numpy as np
import pytest

import keras
from autodist.ir.capture import capture
from autodist.runtime import keras_data, targets
from autodist.runtime.keras_data import DataError


def _dict_model():
    """Inputs named out of sorted order, a dict of inputs, an (N, 1) output."""
    zeta = keras.Input((1,), name="zeta")
    alpha = keras.Input((2,), name="alpha", dtype="int32")
    out = keras.layers.Dense(1)(keras.layers.Concatenate()([zeta, keras.ops.cast(alpha,
                                                                                 "float32")]))
    model = keras.Model({"zeta": zeta, "alpha": alpha}, out)
    model.compile("sgd", "mse")
    return model


@pytest.fixture(scope="module")
def dict_item():
    return capture(_dict_model())


def test_a_dict_of_inputs_is_captured_by_name_and_read_by_key(dict_item):
    assert [(i.name, i.dtype) for i in dict_item.model_inputs] == [("alpha", "int32"),
                                                                   ("zeta", "float32")]
    x = {"zeta": np.arange(4.0)[:, None], "alpha": np.ones((4, 2), np.int64)}
    data = keras_data.fit_arrays(x, np.arange(4.0), None, dict_item)
    assert [a.dtype for a in data.inputs] == [np.int32, np.float32]
    np.testing.assert_array_equal(data.inputs[1][:, 0], np.arange(4.0))
    # A 1-D target for the (N, 1) output, float64 read as float32 as Keras does.
    assert data.targets[0].shape == (4, 1) and data.targets[0].dtype == np.float32


def test_missing_and_misshapen_inputs_are_named_as_the_user_named_them(dict_item):
    with pytest.raises(DataError, match=r"without the model's input\(s\) \['zeta'\].*x's keys: "
                                        r"\['alpha', 'zeta2'\]"):
        keras_data.fit_arrays({"alpha": np.ones((4, 2)), "zeta2": np.ones((4, 1))},
                              np.ones(4), None, dict_item)
    with pytest.raises(DataError,
                       match=r"input 'alpha' needs an array of shape \(N, 2\).*\(4, 3\)"):
        keras_data.fit_arrays({"alpha": np.ones((4, 3)), "zeta": np.ones((4, 1))},
                              np.ones(4), None, dict_item)
    with pytest.raises(DataError, match="same number of examples"):
        keras_data.fit_arrays({"alpha": np.ones((4, 2)), "zeta": np.ones((5, 1))},
                              np.ones(4), None, dict_item)


def test_targets_shaped_unlike_the_output_name_how_to_capture_them():
    """keras-io's supervised contrastive learning: (N, 1) class ids for a (N, 16)
    projection; without example targets the capture takes the output's shape."""
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(16)(inputs))
    model.compile("sgd", "mse")
    with pytest.raises(DataError, match=r"needs an array of shape \(N, 16\).*\(4, 1\).*"
                                        r"optimize\(model, spec, x=\.\.\., y=\.\.\.\)"):
        keras_data.fit_arrays(np.ones((4, 4)), np.ones((4, 1)), None, capture(model))


def test_unnamed_inputs_are_numbered_not_named_after_keras_tensors():
    a, b = keras.Input((2,)), keras.Input((3,))
    model = keras.Model([a, b], keras.layers.Dense(1)(keras.layers.Concatenate()([a, b])))
    model.compile("sgd", "mse")
    assert [i.name for i in capture(model).model_inputs] == ["input_0", "input_1"]


def test_variable_length_inputs_and_time_axis_targets():
    inputs = keras.Input((None,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(10, 4)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(7)(h))
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    item = capture(model)
    assert [list(i.shape) for i in item.inputs] == [[-1, -1], [-1, -1], [-1, -1]]
    assert [i.role for i in item.inputs] == ["x", "y", "sample_weight"]
    x, y = np.ones((6, 5), np.int64), np.ones((6, 5), np.int64)
    data = keras_data.fit_arrays(x, y, np.ones((6, 5)), item)
    assert data.targets[0].dtype == np.int32 and data.weights.shape == (6, 5)
    # One weight per example for a loss per timestep: Keras fails on it too.
    with pytest.raises(DataError,
                       match=r"sample_weight needs an array of shape \(N, None\).*\(6,\)"):
        keras_data.fit_arrays(x, y, np.ones(6), item)


def test_strings_and_objects():
    inputs = keras.Input((1,), dtype="string", name="city")
    lookup = keras.layers.StringLookup(vocabulary=["a", "b"])(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.ops.cast(lookup, "float32")))
    model.compile("sgd", "mse")
    info = model.inputs[0]
    assert info.dtype == "string"
    array = keras_data.to_array(np.array([["a"], ["b"]], dtype=object), "x")
    assert array.dtype.kind == "S" and array.tolist() == [[b"a"], [b"b"]]
    with pytest.raises(DataError, match="neither numbers nor strings.*None"):
        keras_data.to_array(np.array([[None], [1.0]], dtype=object), "x")
    assert keras_data.to_array([[1, 2], [3, 4]], "x").dtype == np.int64
    assert keras_data.to_array(np.ones(3), "x").dtype == np.float32


def test_per_output_sample_weights_pack_and_unpack():
    cls = np.arange(4, dtype=np.int32)
    reg = np.ones((4, 2), np.float32)
    shared = np.full(4, 2.0, np.float32)
    packed = targets.pack([cls, reg], shared)
    rows = packed[[1, 3]]
    arrays, weights = targets.unpack(rows, 2)
    np.testing.assert_array_equal(arrays[0], [1, 3])
    assert [w.tolist() for w in weights] == [[2.0, 2.0], [2.0, 2.0]]
    packed = targets.pack([cls, reg], [shared, np.ones((4,), np.float32)])
    _, weights = targets.unpack(packed[:2], 2)
    assert [w.tolist() for w in weights] == [[2.0, 2.0], [1.0, 1.0]]
    single, none = targets.unpack(targets.pack([cls]), 1)
    assert none is None and single[0] is not None


def test_multi_output_targets_and_weights_by_name():
    inputs = keras.Input((3,), name="features")
    model = keras.Model(inputs, {"cls": keras.layers.Dense(4, name="cls")(inputs),
                                 "reg": keras.layers.Dense(1, name="reg")(inputs)})
    model.compile("sgd", {"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          "reg": "mse"})
    item = capture(model)
    assert [i.name for i in item.sample_weight_inputs] == ["sample_weight/cls",
                                                          "sample_weight/reg"]
    x = np.ones((5, 3))
    y = {"reg": np.zeros(5), "cls": np.arange(5) % 4}
    data = keras_data.fit_arrays(x, y, {"cls": np.ones(5), "reg": np.full(5, 3.0)}, item)
    assert [t.shape for t in data.targets] == [(5,), (5, 1)]
    assert [w.tolist()[0] for w in data.weights] == [1.0, 3.0]
    with pytest.raises(DataError, match=r"without targets for output\(s\) \['cls'\]"):
        keras_data.fit_arrays(x, {"reg": np.zeros(5)}, None, item)
    with pytest.raises(DataError, match="0 examples"):
        keras_data.fit_arrays(np.ones((0, 3)), [np.zeros(0), np.zeros(0)], None, item)
