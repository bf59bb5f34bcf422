"""fit on a tf.data.Dataset: the workers read it as Keras' fit does; clear errors otherwise.

The reading order is checked against Keras' own `EpochIterator` (TensorFlow
backend) in this process; the cluster tests train on 2 workers and compare
the weights (and per-epoch losses) with Keras `fit` on the same dataset.
"""
from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import autodist
from autodist import models
from autodist.kernels import global_batch
from autodist.launch.job import DatasetFiles
from autodist.runtime.run_config import RunConfig
from autodist.runtime import checkpoint, datasets, keras_data
from autodist.runtime.batching import dataset_epochs
from autodist.runtime.dataset_graph import DatasetGraphError
from autodist.runtime.dataset_stream import DatasetStream
from autodist.runtime.datasets import DatasetError, is_dataset

TOLERANCE = 2e-5

ONE = global_batch.ANY_BATCH   # `smallest_batch` without batch normalization


@pytest.fixture(scope="module")
def mlp_8():
    """A small MLP (8 features, 3 classes) and its capture."""
    model = models.mlp(input_dim=8, hidden=(16,), classes=3)
    return model, autodist.capture(model)


def _data(n=70):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 8)).astype("float32"), rng.integers(0, 3, n).astype("int32")


def _indexed(n=10, known=True, seed=3, cached=False):
    """Examples whose label is their index, reshuffled each pass, in batches of 4 (with
    `cached`, kept by an in-memory `cache()` once a pass has read to its end)."""
    x = np.repeat(np.arange(n, dtype="float32")[:, None], 8, axis=1)
    ds = tf.data.Dataset.from_tensor_slices((x, np.arange(n, dtype="int32")))
    ds = ds.shuffle(n, seed=seed)
    if not known:
        ds = ds.filter(lambda x, y: True)   # cardinality unknown, as TFRecord files
    ds = ds.batch(4)
    return ds.cache() if cached else ds


def _keras_reads(dataset, steps_per_epoch, epochs):
    """The labels of each batch Keras 3's fit reads, per epoch (its own EpochIterator,
    driven as `fit` drives it; the train step's next() is done here)."""
    from keras.src.backend.tensorflow.trainer import TFEpochIterator

    iterator = TFEpochIterator(x=dataset, steps_per_epoch=steps_per_epoch,
                               distribute_strategy=tf.distribute.get_strategy())
    iterator.reset()
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "Your input ran out of data"
        for _ in range(epochs):
            batches = []
            with iterator.catch_stop_iteration():
                for _, _, it in iterator:
                    batches.append(next(it)[1].numpy().tolist())
            out.append(batches)
    return out


def _stream_reads(streamed, graph_item, steps_per_epoch, epochs):
    stream = DatasetStream(DatasetFiles(streamed.graph, streamed.description.to_json()),
                           RunConfig(global_batch_size=0, epochs=epochs,
                                     steps_per_epoch=steps_per_epoch), graph_item, ONE, None)
    try:
        starts = stream.schedule.starts()
        return [[stream.batch(i).targets.tolist() for i in range(starts[e], starts[e + 1])]
                for e in range(epochs)]
    finally:
        stream.close()


@pytest.mark.parametrize("known", [True, False], ids=["cardinality", "no-cardinality"])
@pytest.mark.parametrize("steps", [None, 2, 4])
def test_workers_read_the_batches_keras_fit_reads(mlp_8, known, steps):
    """Every epoch's batches, reshuffled, equal Keras' (which starts two passes per
    epoch when the cardinality is known, and with steps_per_epoch goes on across
    epochs) on the dataset as the user built it. Preparing starts the first pass on the
    user's dataset (to find where its seeds stand; the fit's first pass)."""
    _, graph_item = mlp_8
    dataset = _indexed(known=known)
    streamed = datasets.prepare(dataset, graph_item, steps_per_epoch=steps, epochs=4,
                                smallest_batch=ONE, fixed_batch=None)
    assert streamed.description.batches == 3 and streamed.description.cardinality_known == known
    assert streamed.probed and streamed.description.passes_before == 0
    assert _stream_reads(streamed, graph_item, steps, 4) == \
        _keras_reads(_indexed(known=known), steps, 4)


@pytest.mark.parametrize("known", [True, False], ids=["cardinality", "no-cardinality"])
def test_a_cached_shuffled_dataset_is_replayed_where_keras_replays_it(mlp_8, known):
    """keras-io's decision forests: shuffle, then cache(). Keras' later epochs replay
    the first's order; where the length is unknown, it is the step that finds the end
    of the first pass that completes the cache. The workers read to the end where Keras
    does (before, they stopped at the last batch, and their second epoch reshuffled:
    4.7e-3 off Keras' loss)."""
    _, graph_item = mlp_8
    streamed = datasets.prepare(_indexed(known=known, cached=True), graph_item,
                                steps_per_epoch=None, epochs=3, smallest_batch=ONE,
                                fixed_batch=None)
    expected = _keras_reads(_indexed(known=known, cached=True), None, 3)
    assert _stream_reads(streamed, graph_item, None, 3) == expected
    assert expected[0] == expected[1] == expected[2]


def test_a_short_batch_inside_a_pass_is_read_with_a_fixed_global_batch(mlp_8):
    """keras-io's traffic forecasting batches, then shuffles the batches: a short batch
    lands inside the pass. Virtual nodes fix the global batch; a smaller batch is split
    over them as a short last batch is (it failed the run at its step)."""
    _, graph_item = mlp_8
    x, y = _data(99)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).shuffle(100, seed=3)
    sizes = [len(b[1]) for b in dataset]
    assert sizes.index(3) < len(sizes) - 1
    streamed = datasets.prepare(dataset, graph_item, steps_per_epoch=None, epochs=1,
                                smallest_batch=ONE, fixed_batch=16)
    stream = DatasetStream(DatasetFiles(streamed.graph, streamed.description.to_json()),
                           RunConfig(global_batch_size=16, epochs=1), graph_item, ONE, 16)
    try:
        read = [stream.batch(i).size for i in range(len(sizes))]
        assert sorted(read) == sorted(sizes) and read[-1] == 16   # 3 inside the pass
    finally:
        stream.close()


def test_an_ordered_dict_of_inputs_out_of_name_order_is_said_to_differ_from_keras():
    """Keras 3 feeds an OrderedDict's values (make_csv_dataset's columns, in file order)
    by position to a dict model's inputs sorted by name: keras-io's decision forests
    then feeds 'workclass' ids to the 'education' embedding. The run feeds by name and
    says so (it trained other numbers silently); a plain dict is fed by name by both."""
    import collections

    from autodist.runtime.keras_parity import ParityWarning

    inputs = {"b_col": keras.Input((1,), name="b_col"), "a_col": keras.Input((1,), name="a_col")}
    out = keras.layers.Dense(1)(keras.layers.Concatenate()([inputs["a_col"], inputs["b_col"]]))
    model = keras.Model(inputs, out)
    model.compile("sgd", "mse")
    item = autodist.capture(model)
    columns = collections.OrderedDict([("b_col", np.ones((8, 1), "float32")),
                                       ("a_col", np.zeros((8, 1), "float32"))])
    ordered = tf.data.Dataset.from_tensor_slices((columns, np.ones((8, 1), "float32"))).batch(4)
    with pytest.warns(ParityWarning, match=r"OrderedDict \(keys in the order \['b_col', "
                                           r"'a_col'\].*feeds each input the column of its name"
                                           r".*Keras fails"):
        datasets.prepare(ordered, item, steps_per_epoch=None, epochs=1, smallest_batch=ONE,
                         fixed_batch=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ParityWarning)
        datasets.prepare(ordered.map(lambda x, y: (dict(x), y)), item, steps_per_epoch=None,
                         epochs=1, smallest_batch=ONE, fixed_batch=None)
        keras_data.flatten_inputs(dict(columns), item.model_inputs)
    with pytest.warns(ParityWarning, match=r"x is an OrderedDict"):   # fit(x=...) too
        keras_data.flatten_inputs(columns, item.model_inputs)


@pytest.mark.parametrize("known", [True, False], ids=["cardinality", "no-cardinality"])
def test_a_dataset_read_before_fit_is_read_on_from_where_keras_would(mlp_8, known):
    """A dataset read before fit outside it (keras-io's FeatureSpace example adapts its
    preprocessing on the training dataset: 12 passes) has its seed generator advanced,
    and Keras' fit reshuffles from there: the workers start as many passes first. Before,
    they started from the first pass (2 workers: loss 13% off Keras after two epochs)."""
    _, graph_item = mlp_8
    theirs, ours = _indexed(known=known), _indexed(known=known)
    for dataset in (theirs, ours):
        for _ in range(5):   # as an adapt() reads it
            list(dataset)
    streamed = datasets.prepare(ours, graph_item, steps_per_epoch=None, epochs=2,
                                smallest_batch=ONE, fixed_batch=None)
    assert streamed.description.passes_before == 5
    assert _stream_reads(streamed, graph_item, None, 2) == _keras_reads(theirs, None, 2)
    # After the fit the user's dataset stands where Keras' fit leaves it.
    datasets.start_passes_like_keras(ours, streamed, None, 2)
    assert [b[1].numpy().tolist() for b in ours] == [b[1].numpy().tolist() for b in theirs]


def test_a_dataset_read_too_often_before_fit_is_refused(mlp_8, monkeypatch):
    monkeypatch.setattr(datasets, "MAX_UNKNOWN_PASSES", 3)
    dataset = _indexed()
    for _ in range(4):
        list(dataset)
    with pytest.raises(datasets.DatasetError, match=r"none of passes 0\.\.2 .*before shuffle"):
        datasets.prepare(dataset, mlp_8[1], steps_per_epoch=None, epochs=1,
                         smallest_batch=ONE, fixed_batch=None)


@pytest.mark.parametrize("known,steps", [(True, None), (False, None), (True, 2), (False, 2)])
def test_after_fit_the_dataset_reshuffles_anew_as_after_keras_fit(mlp_8, known, steps):
    """The passes Keras' fit starts advance the dataset's seed generator: a second fit
    reads new orders. The run's second fit does (its workers start the first fit's passes
    first), and so does Keras' (they are started on the user's dataset after a fit)."""
    model = models.mlp(input_dim=8, hidden=(16,), classes=10)
    theirs, ours = _indexed(known=known), _indexed(known=known)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(theirs, epochs=3, steps_per_epoch=steps, verbose=0, shuffle=False)
    streamed = datasets.prepare(ours, mlp_8[1], steps_per_epoch=steps, epochs=3,
                                smallest_batch=ONE, fixed_batch=None)
    assert streamed.seed_generators and streamed.description.passes_before == 0
    passes = datasets.start_passes_like_keras(ours, streamed, steps, 3)
    # The run's second fit: its workers start the first fit's passes unread.
    second = datasets.prepare(ours, mlp_8[1], steps_per_epoch=steps, epochs=2,
                              smallest_batch=ONE, fixed_batch=None,
                              earlier_passes={streamed.seed_generators: passes})
    assert second.description.passes_before == passes
    assert _stream_reads(second, mlp_8[1], steps, 2) == _keras_reads(theirs, steps, 2)
    # Keras' own next pass over the dataset is the one after Keras' fit.
    datasets.start_passes_like_keras(ours, second, steps, 2)
    assert [b[1].numpy().tolist() for b in ours] == [b[1].numpy().tolist() for b in theirs]


def _autotuned():
    options = tf.data.Options()
    options.autotune.cpu_budget = 1
    return options


@pytest.mark.parametrize("make,relies", [
    (lambda ds: ds.map(lambda x, y: (x * 2, y)).batch(4), False),
    (lambda ds: ds.map(lambda x, y: (x * 2, y), num_parallel_calls=2).prefetch(2), False),
    (lambda ds: ds.map(lambda x, y: (x * 2, y), num_parallel_calls=tf.data.AUTOTUNE), True),
    (lambda ds: ds.batch(4).prefetch(tf.data.AUTOTUNE), True),
    (lambda ds: ds.interleave(lambda x, y: tf.data.Dataset.from_tensors((x, y)),
                              num_parallel_calls=tf.data.AUTOTUNE), True),
    (lambda ds: ds.batch(4).with_options(_autotuned()), True),
])
def test_autotuning_is_kept_only_where_a_dataset_relies_on_it(make, relies):
    """The workers turn tf.data's autotuning off where it tunes nothing: destroying an
    autotuned iterator waits for its tuning thread (seconds, at every pass's end)."""
    from autodist.runtime import dataset_graph

    ds = make(tf.data.Dataset.from_tensor_slices((np.ones((8, 2), "float32"), np.arange(8))))
    assert dataset_graph.relies_on_autotune(dataset_graph.serialize(ds)) == relies
    off = dataset_graph.without_autotune(ds)
    assert off.options().autotune.enabled is False
    assert [b[1].numpy().tolist() for b in off] == [b[1].numpy().tolist() for b in ds]


def test_tfrecord_files_do_not_count_as_autotuned(tmp_path):
    """A TFRecordDataset's buffer_size -1 is its default buffer, not AUTOTUNE."""
    from autodist.runtime import dataset_graph

    path = str(tmp_path / "r.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        writer.write(b"x")
    ds = tf.data.Dataset.from_tensor_slices([path]).interleave(tf.data.TFRecordDataset)
    assert not dataset_graph.relies_on_autotune(dataset_graph.serialize(ds))


def test_an_unknown_length_running_out_at_an_epoch_end_is_refused(mlp_8):
    """Keras then runs an empty epoch (it learns of the end at the next epoch's step)."""
    dataset = _indexed(known=False)
    empty = [len(e) for e in _keras_reads(dataset, 3, 3)]
    assert [e.steps for e in dataset_epochs(3, False, 3, 3)] == empty == [3, 0, 3]
    with pytest.raises(DatasetError, match=r"runs out exactly at the end of epoch 0.*"
                                           r"assert_cardinality\(3\)"):
        datasets.prepare(dataset, mlp_8[1], steps_per_epoch=3, epochs=3,
                         smallest_batch=ONE, fixed_batch=None)
    datasets.prepare(dataset, mlp_8[1], steps_per_epoch=3, epochs=1, smallest_batch=ONE,
                     fixed_batch=None)   # the empty epoch is not reached


def test_keras_counts_a_step_that_finds_the_data_end(mlp_8):
    """What the run reproduces (`autodist.runtime.run_outs`): Keras' TF backend counts one
    optimizer iteration more, and advances every seed generator by a step's draws, each
    time a pass runs out (measured here: 4 per epoch of 3 batches)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4),
                              keras.layers.Dropout(0.5), keras.layers.Dense(10)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    counts = []

    class Counts(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            (seed,) = [v for v in self.model.variables if "seed_generator_state" in v.path]
            counts.append((int(self.model.optimizer.iterations.numpy()),
                           int(seed.numpy()[1])))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(_indexed(known=False), epochs=2, verbose=0, callbacks=[Counts()],
                  shuffle=False)
    assert counts == [(4, 4), (8, 8)]
    plan = dataset_epochs(3, False, None, 2)
    assert [(e.steps, e.runs_out) for e in plan] == [(3, True), (3, True)]
    item = autodist.capture(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # trained as Keras: nothing to warn of
        streamed = datasets.prepare(_indexed(known=False), item, steps_per_epoch=None,
                                    epochs=2, smallest_batch=ONE, fixed_batch=None)
    # compile(steps_per_execution=k > 1): Keras runs no step where the data ended (its
    # loop asks for an optional next element first), so nothing advances there.
    quiet = datasets.prepare(_indexed(known=False), item, steps_per_epoch=None, epochs=2,
                             smallest_batch=ONE, fixed_batch=None, end_step=False)
    ends = []
    for prepared in (streamed, quiet):
        stream = DatasetStream(DatasetFiles(prepared.graph, prepared.description.to_json()),
                               RunConfig(global_batch_size=0, epochs=2), item, ONE, None)
        ends.append(stream.epochs_run_out())
        stream.close()
    assert ends == [[True, True], []]


def test_a_global_seed_makes_a_shuffle_without_seed_reproducible(mlp_8):
    def make():
        tf.random.set_seed(7)
        try:
            x, y = _data()
            return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(70).batch(16)
        finally:
            tf.random.set_seed(None)   # later tests build unseeded shuffles

    streamed = datasets.prepare(make(), mlp_8[1], steps_per_epoch=None, epochs=2,
                                smallest_batch=ONE, fixed_batch=None)
    assert _stream_reads(streamed, mlp_8[1], None, 2) == _keras_reads(make(), None, 2)


def test_elements_are_flattened_and_cast_for_the_model(mlp_8):
    """x as a dict, y as int64, weights as [b, 1]: model order, model dtypes, one weight
    per example packed with the targets; class weights made from y as Keras makes them."""
    x, y = _data()
    w = np.arange(70, dtype="float64")[:, None]
    dataset = tf.data.Dataset.from_tensor_slices(({"features": x}, y.astype("int64"), w))
    streamed = datasets.prepare(dataset.batch(32), mlp_8[1], steps_per_epoch=None, epochs=1,
                                smallest_batch=ONE, fixed_batch=None)
    d = streamed.description
    assert d.dtypes == ("float32", "int32", "float32") and d.weighted and d.num_inputs == 1
    stream = DatasetStream(DatasetFiles(streamed.graph, d.to_json()),
                           RunConfig(global_batch_size=0), mlp_8[1], ONE, None)
    last = [stream.batch(i) for i in range(3)][-1]
    stream.close()
    assert last.size == 6
    np.testing.assert_array_equal(last.inputs[0], x[64:])
    np.testing.assert_array_equal(last.targets["t0"], y[64:])
    np.testing.assert_array_equal(last.targets["w"], np.arange(64, 70))

    weighted = datasets.prepare(tf.data.Dataset.from_tensor_slices((x, y)).batch(70),
                                mlp_8[1], steps_per_epoch=None, epochs=1, smallest_batch=ONE,
                                fixed_batch=None, class_weight={0: 0.5, 2: 3.0})
    stream = DatasetStream(DatasetFiles(weighted.graph, weighted.description.to_json()),
                           RunConfig(global_batch_size=0), mlp_8[1], ONE, None)
    batch = stream.batch(0)
    stream.close()
    np.testing.assert_array_equal(batch.targets["w"],
                                  np.asarray([0.5, 1.0, 3.0], "float32")[y])


def _generator_dataset(x, y):
    def generate():
        yield x[:8], y[:8]

    return tf.data.Dataset.from_generator(generate, output_signature=(
        tf.TensorSpec([None, 8], tf.float32), tf.TensorSpec([None], tf.int32)))


def _noise_in_map(dataset):
    """A Keras layer with a seed generator (a variable) called in a dataset's map."""
    noise = keras.layers.GaussianNoise(0.1, seed=1, name="noise_in_map")
    return dataset.map(lambda x, y: (noise(x, training=True), y))


@tf.function
def _checked_noise(x, y):
    """keras-io's cutmix: a tf.function map body whose image ops assert their arguments."""
    tf.debugging.assert_non_negative(tf.abs(x))
    with tf.name_scope("noise"):
        return x + tf.random.uniform([8]), y


@tf.function
def _checked_clip(x, y):
    tf.debugging.assert_non_negative(tf.abs(x))
    return tf.clip_by_value(x, -1.0, 1.0), y


def test_a_tf_function_map_with_asserts_reads_in_the_workers():
    """TensorFlow's serializer refuses a tf.function map body (a StatefulPartitionedCall)
    whatever it holds: keras-io's cutmix with stateless random ops was refused, telling the
    user to use stateless random ops."""
    from autodist.runtime import dataset_graph

    dataset = tf.data.Dataset.from_tensor_slices(_data()).map(_checked_clip).batch(16)
    graph = dataset_graph.serialize(dataset)
    restored = dataset_graph.restore(graph, dataset.element_spec)
    for (x, y), (x2, y2) in zip(dataset, restored):
        np.testing.assert_array_equal(x, x2)
        np.testing.assert_array_equal(y, y2)


@pytest.mark.parametrize("make,error,message", [
    (lambda d: d.batch(32).map(lambda x, y: (x, y, y, y)), DatasetError,
     r"\(x, y, sample_weight\) batch; received a tuple of 4"),
    (lambda d: d.take(0).batch(4), DatasetError, "empty"),
    (lambda d: d.batch(32).repeat(), DatasetError, "infinite .*give steps_per_epoch"),
    (lambda d: d.map(lambda x, y: ({"other": x}, y)).batch(8), DatasetError,
     r"without the model's inputs \['features'\]"),
    (lambda d: d.map(lambda x, y: (x[:4], y)).batch(8), DatasetError,
     r"'features' needs examples of shape \[8\]; the dataset's batches have shape \[None, 4\]"),
    (lambda d: d.shuffle(70).batch(32), DatasetGraphError,
     r"ShuffleDatasetV3 has no random seed.*shuffle\(buffer_size, seed=1\)"),
    (lambda d: d.batch(32).map(lambda x, y: (x * 2, y), num_parallel_calls=2,
                               deterministic=False), DatasetGraphError,
     "nondeterministic order"),
    (lambda d: d.batch(32).map(lambda x, y: (tf.py_function(lambda a: a, [x], tf.float32), y)),
     DatasetGraphError, "could not serialize it: EagerPyFunc is stateful.*from_generator"),
    (lambda d: d.batch(32).map(lambda x, y: (x + tf.random.uniform([8]), y)),
     DatasetGraphError, "RandomUniform is stateful.*tf.random.stateless_"),
    (lambda d: d.batch(32).map(_checked_noise), DatasetGraphError,
     r"could not serialize it: RandomUniform is stateful \(stateful ops in its functions, "
     r"under 'noise/random_uniform' \(RandomUniform\)\)"),
    (lambda d: _generator_dataset(*_data()), DatasetGraphError, "PyFunc is stateful"),
    (lambda d: _noise_in_map(d.batch(32)), DatasetGraphError,
     r"ReadVariableOp is stateful \(stateful ops in its functions, under 'noise_in_map(_1)?' "
     r"\(AssignVariableOp, ReadVariableOp\)\)\. Keras preprocessing layers .* call them "
     "in the model instead"),
    (lambda d: d.batch(32).cache("/tmp/autodist-test-cache"), DatasetGraphError,
     r"cache writes files \(CacheDatasetV2 with a filename\)"),
    (lambda d: d.filter(lambda x, y: True).batch(32), DatasetError,
     "has a batch of 6 examples, fewer than 8 \\(one for each of the 8 virtual nodes"),
    (lambda d: d.batch(16, drop_remainder=True), DatasetError,
     "fixes the global batch at 32 examples; the dataset's batches have 16"),
])
def test_datasets_fit_cannot_read_as_keras_are_named(mlp_8, make, error, message):
    tf.random.set_seed(None)   # building the fixture's model seeded TensorFlow
    x, y = _data()
    dataset = make(tf.data.Dataset.from_tensor_slices((x, y)))
    fixed = 32 if "fixes" in message else None
    with pytest.raises(error, match=message):
        datasets.prepare(dataset, mlp_8[1], steps_per_epoch=None, epochs=1,
                         smallest_batch=(8, "one for each of the 8 virtual nodes"),
                         fixed_batch=fixed)


def test_fit_refuses_before_launch(mlp_8):
    """Arguments a dataset replaces, and a dataset the workers cannot rebuild: errors
    before any process starts."""
    model, graph_item = mlp_8
    x, y = _data()
    spec = autodist.ResourceSpec.local(workers=2)
    run = autodist.distribute(model, autodist.builders.AllReduce().build(graph_item, spec), spec,
                              graph_item=graph_item)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    assert is_dataset(ds) and not is_dataset(x)
    with pytest.raises(autodist.AutodistError, match="pass neither y nor sample_weight"):
        run.fit(ds, y, batch_size=32, shuffle=False)
    with pytest.raises(DatasetGraphError, match="PyFunc is stateful"):
        run.fit(_generator_dataset(x, y), verbose=0, shuffle=False)
    with pytest.raises(autodist.AutodistError, match="steps_per_epoch must be an integer >= 1"):
        run.fit(ds, steps_per_epoch=0, shuffle=False)
    assert run.last_job_dir is None


# ------------------------------------------------------------------ on clusters
class _EpochWeights(keras.callbacks.Callback):
    """The model's weights at each epoch's end."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = []

    def on_epoch_end(self, epoch, logs=None):
        self.weights.append([w.copy() for w in self.model.get_weights()])


def _assert_weights_equal(got, want):
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=TOLERANCE)


@pytest.mark.cluster
def test_fit_on_a_dataset_equals_keras_fit_on_it():
    model = models.mlp(input_dim=8, hidden=(16,), classes=3, optimizer="adam")
    x, y = _data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)   # 32, 32, 6
    reference = models.single_device_twin(model)
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    strategy = autodist.builders.PSLoadBalancing().build(autodist.capture(model), spec)
    run = autodist.distribute(model, strategy, spec)
    history = run.fit(ds, epochs=2, verbose=0, shuffle=False)
    reference.fit(ds, epochs=2, verbose=0, shuffle=False)
    assert len(history.step_losses) == 6
    _assert_weights_equal(model.get_weights(), reference.get_weights())


@pytest.mark.cluster
def test_a_dataset_reshuffled_each_epoch_trains_as_keras_fit():
    """3 epochs of a seeded reshuffling dataset (a new order each epoch, drawn where Keras
    draws it): each epoch's weights and loss equal Keras fit's, on 2 workers + 1 PS; then a
    second fit of the same run on the same dataset goes on with new orders, as Keras'."""
    model = models.mlp(input_dim=8, hidden=(16,), classes=3, optimizer="adam")
    x, y = _data(80)

    def dataset():   # one for each side: a fit advances its dataset's shuffle
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(80, seed=5).batch(32)

    ds, keras_ds = dataset(), dataset()
    reference = models.single_device_twin(model)
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    strategy = autodist.builders.PS().build(autodist.capture(model), spec)
    ours, theirs = _EpochWeights(), _EpochWeights()
    run = autodist.distribute(model, strategy, spec)
    history = run.fit(ds, epochs=3, verbose=0, callbacks=[ours], shuffle=False)
    expected = reference.fit(keras_ds, epochs=3, verbose=0, callbacks=[theirs], shuffle=False)
    assert len(history.step_losses) == 9
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], atol=TOLERANCE)
    assert len(ours.weights) == 3
    for got, want in zip(ours.weights, theirs.weights):
        _assert_weights_equal(got, want)
    # A second fit: compare its first step's loss (the weights and the batch decide it; the
    # optimizer's state, which carries over in both, does not yet).
    first_losses = []

    class FirstLoss(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                first_losses.append(logs["loss"])

    history = run.fit(ds, epochs=1, verbose=0, shuffle=False)
    reference.fit(keras_ds, epochs=1, verbose=0, callbacks=[FirstLoss()], shuffle=False)
    assert history.step_losses[0] == pytest.approx(first_losses[0], abs=TOLERANCE)
    replayed = models.single_device_twin(reference)   # the first fit's first order again
    replayed.fit(dataset(), epochs=1, verbose=0, callbacks=[FirstLoss()], shuffle=False)
    assert abs(first_losses[1] - first_losses[0]) > 100 * TOLERANCE
    # The epochs did see different orders: one epoch's order repeated would differ.
    first = [b[1].numpy().tolist() for b in dataset().take(1)]
    assert first != [b[1].numpy().tolist() for b in ds.take(1)]


@pytest.mark.cluster
def test_an_infinite_dataset_with_steps_per_epoch_and_sample_weights_trains_as_keras_fit():
    """shuffle(seed).repeat() with (x, y, sample_weight) batches, steps_per_epoch=3 over 2
    epochs (one pass runs on across epochs), 4 virtual nodes on 2 workers (all-reduce)."""
    model = models.mlp(input_dim=8, hidden=(16,), classes=3)
    x, y = _data(40)
    weights = np.linspace(0.5, 2.0, 40).astype("float32")

    def dataset():   # one for each side: a fit advances its dataset's shuffle
        return tf.data.Dataset.from_tensor_slices((x, y, weights)).shuffle(
            40, seed=2).repeat().batch(16)

    reference = models.single_device_twin(model)
    spec = autodist.ResourceSpec.local(workers=2)
    strategy = autodist.builders.AllReduce().build(autodist.capture(model), spec)
    run = autodist.distribute(model, strategy.with_virtual_nodes(16, 4), spec)
    history = run.fit(dataset(), epochs=2, steps_per_epoch=3, verbose=0, shuffle=False)
    expected = reference.fit(dataset(), epochs=2, steps_per_epoch=3, verbose=0, shuffle=False)
    assert len(history.step_losses) == 6
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], atol=TOLERANCE)
    _assert_weights_equal(model.get_weights(), reference.get_weights())


@pytest.mark.cluster
@pytest.mark.parametrize("ps", [0, 1], ids=["all-reduce, 4 virtual nodes", "PS"])
def test_epochs_ending_at_the_data_end_train_as_keras_fit(ps, tmp_path):
    """A dataset of unknown length (a filter), Dropout and Adam, 3 epochs on 2 workers (with
    2 virtual nodes each, or a parameter server): after each epoch Keras' step that finds
    the end advances the Dropout's seed and counts an iteration (Adam's bias correction
    reads it), and so does the run (before, the second epoch's masks were others: a
    similar model 8% off Keras' loss, with SGD too, and no warning). Each epoch's weights,
    the loss, the seed and the iteration count after fit equal Keras'. The checkpoints
    keep the run-outs beside the steps applied, so a fit continued from one counts as
    Keras does (before, it started 3 iterations short)."""
    def build():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dropout(0.5), keras.layers.Dense(3)])
        model.compile(keras.optimizers.Adam(0.01),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    x, y = _data(48)

    def dataset():
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(16).filter(lambda a, b: True)

    model, reference = build(), build()
    spec = autodist.ResourceSpec.local(workers=2, ps=ps)
    builder = autodist.builders.PS() if ps else autodist.builders.AllReduce()
    strategy = builder.build(autodist.capture(model), spec)
    ours, theirs = _EpochWeights(), _EpochWeights()
    run = autodist.distribute(model, strategy if ps else strategy.with_virtual_nodes(16, 4),
                              spec)
    history = run.fit(dataset(), epochs=3, verbose=0, callbacks=[ours], shuffle=False,
                      checkpoint_dir=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # Keras: "Your input ran out of data"
        expected = reference.fit(dataset(), epochs=3, verbose=0, callbacks=[theirs],
                                 shuffle=False)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    for got, want in zip(ours.weights, theirs.weights):
        _assert_weights_equal(got, want)
    seeds = [[v.numpy().tolist() for v in m.variables if "seed_generator_state" in v.path]
             for m in (model, reference)]
    assert seeds[0] == seeds[1] and seeds[0][0][1] == 12   # 9 steps and 3 run-outs
    assert int(model.optimizer.iterations.numpy()) == \
        int(reference.optimizer.iterations.numpy()) == 12
    saved = checkpoint.load(checkpoint.latest(tmp_path))
    assert (int(saved[checkpoint.ITERATIONS]), int(saved[checkpoint.RUN_OUTS])) == (9, 3)
    if ps:   # a fit continued from the checkpoint
        run.fit(dataset(), epochs=1, verbose=0, shuffle=False,
                initial_checkpoint=str(checkpoint.latest(tmp_path)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference.fit(dataset(), epochs=1, verbose=0, shuffle=False)
        assert int(model.optimizer.iterations.numpy()) == 16
        _assert_weights_equal(model.get_weights(), reference.get_weights())


def _write_tfrecords(directory, x, y, files=2):
    paths = []
    for f in range(files):
        path = str(directory / f"part-{f}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for i in range(f, len(y), files):
                example = tf.train.Example(features=tf.train.Features(feature={
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=x[i])),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[y[i]]))}))
                writer.write(example.SerializeToString())
        paths.append(path)
    return paths


def _tfrecord_dataset(paths, seed=4):
    """TFRecord files parsed by a map, shuffled with a seed, batched: cardinality unknown."""
    spec = {"x": tf.io.FixedLenFeature([8], tf.float32), "y": tf.io.FixedLenFeature([], tf.int64)}

    def parse(record):
        example = tf.io.parse_single_example(record, spec)
        return example["x"] * 2.0, example["y"]

    return tf.data.TFRecordDataset(paths).map(parse).shuffle(64, seed=seed).batch(24)


@pytest.mark.cluster
def test_tfrecord_files_with_a_map_train_as_keras_fit(tmp_path):
    """Unknown cardinality (counted by the driver: 3 batches), steps_per_epoch=2 over 3
    epochs: epochs of 2, 1 and 2 steps, a new pass when the files run out; PS on 2 workers.
    Momentum SGD: its update does not depend on Keras' iteration count, which counts the
    step that runs out (see the test of the warning)."""
    model = models.mlp(input_dim=8, hidden=(16,), classes=3,
                       optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
    x, y = _data(60)
    paths = _write_tfrecords(tmp_path, x, y)
    ds = _tfrecord_dataset(paths)
    assert ds.cardinality() == tf.data.UNKNOWN_CARDINALITY
    reference = models.single_device_twin(model)
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    strategy = autodist.builders.PSLoadBalancing().build(autodist.capture(model), spec)
    history = autodist.distribute(model, strategy, spec).fit(ds, epochs=3, steps_per_epoch=2,
                                                             verbose=0, shuffle=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # Keras: "Your input ran out of data"
        expected = reference.fit(_tfrecord_dataset(paths), epochs=3, steps_per_epoch=2,
                                 verbose=0, shuffle=False)
    assert len(history.step_losses) == 5
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], atol=TOLERANCE)
    _assert_weights_equal(model.get_weights(), reference.get_weights())


@pytest.mark.cluster
def test_a_short_batch_found_while_reading_fails_at_its_step():
    """An infinite dataset is not counted: a batch smaller than the virtual nodes (35
    examples in batches of 16: the third has 3, for 4 virtual nodes) where each computes
    its own batch statistics fails the run at that step, naming it."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,), name="features")
    h = keras.layers.BatchNormalization()(keras.layers.Dense(16, activation="relu")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data(35)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat()
    spec = autodist.ResourceSpec.local(workers=2)
    strategy = autodist.builders.AllReduce().build(autodist.capture(model), spec)
    run = autodist.distribute(model, strategy.with_virtual_nodes(16, 4), spec)
    with pytest.raises(autodist.AutodistError, match="step 2: the dataset's batch has 3 "
                                                     "examples, fewer than 4 .one for each"):
        run.fit(ds, epochs=1, steps_per_epoch=4, verbose=0, shuffle=False)


@pytest.mark.cluster
def test_a_dataset_read_across_a_resize_trains_as_keras_fit_and_measures_throughput():
    """A reshuffling dataset on 3 workers with 6 virtual nodes: 3 -> 2 workers at step 2,
    back to 3 at step 5 (a resize hands the workers' read position over with the state:
    each member reads every batch); 2 epochs equal Keras fit. measure_throughput reads the
    same dataset and trains nothing."""
    model = models.mlp(input_dim=8, hidden=(16,), classes=3)
    x, y = _data(48)

    def dataset():
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(48, seed=6).batch(12)

    reference = models.single_device_twin(model)
    spec = autodist.ResourceSpec.local(workers=3)
    strategy = autodist.builders.AllReduce().build(autodist.capture(model), spec)
    run = autodist.distribute(model, strategy.with_virtual_nodes(12, 6), spec)
    before = model.get_weights()
    speeds = run.measure_throughput(dataset(), steps=1)
    assert sorted(speeds) == sorted(strategy.replicas) and min(speeds.values()) > 0
    _assert_weights_equal(model.get_weights(), before)
    history = run.fit(dataset(), epochs=2, verbose=0, resize_at={2: 2, 5: 3}, shuffle=False)
    expected = reference.fit(dataset(), epochs=2, verbose=0, shuffle=False)
    assert [(r.step, r.workers) for r in history.resizes] == [(2, 2), (5, 3)]
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], atol=TOLERANCE)
    _assert_weights_equal(model.get_weights(), reference.get_weights())
