"""A compiled loss that compares the batch's examples with each other is refused on
replicas, before launch (no cluster).

keras-io's supervised contrastive learning example (examples/vision/
supervised-contrastive-learning.py) trains an encoder with a loss over every
pair of the batch: each replica would compare only its own examples. Trained
on 2 workers (PS and all-reduce) it differed from Keras silently (loss 32% off
after two epochs, weights by 0.066). The usual losses, means or sums of
per-example values, pass the check, whatever the outputs and reductions.
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import keras
from keras import layers, ops
from autodist.ir.capture import capture
from autodist.ir.errors import AutodistError
from autodist.runtime import keras_parity
from autodist.runtime.coupled_examples import coupled_losses, coupled_outputs
from autodist.search import builders
import autodist


class SupervisedContrastiveLoss(keras.losses.Loss):
    """keras-io's loss: a softmax over the cosine similarities of every pair of the batch."""

    def __init__(self, temperature: float = 0.05, name: str | None = None) -> None:
        super().__init__(name=name)
        self.temperature = temperature

    def __call__(self, labels, feature_vectors, sample_weight=None):
        normalized = keras.utils.normalize(feature_vectors, axis=1, order=2)
        logits = ops.matmul(normalized, ops.transpose(normalized)) / self.temperature
        labels = ops.expand_dims(ops.squeeze(labels, axis=-1), -1)
        same = ops.cast(ops.equal(labels, ops.transpose(labels)), logits.dtype)
        same /= ops.sum(same, 1, keepdims=True)
        return ops.mean(ops.categorical_crossentropy(same, logits, from_logits=True))


def _encoder() -> tuple[keras.KerasTensor, keras.KerasTensor]:
    inputs = keras.Input((6,), name="features")
    return inputs, layers.Dense(4, activation="tanh")(inputs)


def _contrastive_model() -> tuple[keras.Model, np.ndarray, np.ndarray]:
    keras.utils.set_random_seed(0)
    inputs, h = _encoder()
    model = keras.Model(inputs, layers.Dense(8, name="projection")(h))
    model.compile("adam", loss=SupervisedContrastiveLoss(name="supcon"))
    rng = np.random.default_rng(0)
    return model, rng.normal(size=(16, 6)), rng.integers(0, 3, (16, 1))


def _strategy(item, virtual_nodes: int | None = None):
    spec = autodist.ResourceSpec.local(workers=2, ps=0)
    strategy = builders.AllReduce().build(item, spec)
    return strategy.with_virtual_nodes(16, virtual_nodes) if virtual_nodes else strategy


def test_a_loss_over_the_batchs_pairs_is_refused_before_launch_naming_it() -> None:
    model, x, y = _contrastive_model()
    item = capture(model, x=x, y=y)
    assert coupled_losses(model, item) == ["supcon (SupervisedContrastiveLoss)"]
    for strategy in (_strategy(item), _strategy(item, virtual_nodes=4)):
        with pytest.raises(AutodistError, match=r"supcon.*neither a mean "
                                                r"nor a sum.*one device"):
            keras_parity.check(model, item, strategy)


def test_one_device_computes_it_as_keras() -> None:
    model, x, y = _contrastive_model()
    item = capture(model, x=x, y=y)
    spec = autodist.ResourceSpec.local(workers=1, ps=0)
    keras_parity.check(model, item, builders.AllReduce().build(item, spec))


def _contrastive(y_true, y_pred):
    """siamese_contrastive's loss: a mean over examples of each pair's own distance."""
    margin = ops.square(ops.maximum(1 - y_pred, 0))
    return ops.mean((1 - y_true) * ops.square(y_pred) + y_true * margin)


@pytest.mark.parametrize("loss", [
    "mse", "binary_crossentropy", keras.losses.MeanSquaredError(reduction="sum"),
    keras.losses.BinaryCrossentropy(reduction="mean_with_sample_weight"),
    keras.losses.Huber(), _contrastive, keras.losses.BinaryFocalCrossentropy(),
    keras.losses.LogCosh(), keras.losses.Hinge(), keras.losses.Poisson(),
    keras.losses.KLDivergence()])
def test_means_and_sums_over_examples_pass(loss) -> None:
    keras.utils.set_random_seed(0)
    inputs, h = _encoder()
    model = keras.Model(inputs, layers.Dense(1, activation="sigmoid")(h))
    model.compile("adam", loss=loss)
    item = capture(model)
    assert coupled_losses(model, item) == []
    keras_parity.check(model, item, _strategy(item))


class NonPaddingTokenLoss(keras.losses.Loss):
    """keras-io's ner_transformers loss: the cross-entropy of the non-padding tokens
    (label 0 is padding), divided by the whole batch's count of them."""

    def call(self, y_true, y_pred):
        values = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=None)(y_true, y_pred)
        mask = ops.cast(y_true > 0, "float32")
        return ops.sum(values * mask) / ops.sum(mask)


def _tagger(loss) -> keras.Model:
    """Token ids of a fixed length of 20 in, 10 tag logits per token out."""
    inputs = keras.Input((20,), dtype="int32")
    h = layers.Embedding(30, 4)(inputs)
    model = keras.Model(inputs, layers.Dense(10)(h))
    model.compile("adam", loss=loss)
    return model


def test_a_loss_over_the_batchs_non_padding_tokens_is_refused_naming_the_alternatives():
    """On halves of balanced random targets such a loss is their mean to 3e-5, so it
    passed (2 workers trained it 1.2e-2 off Keras' weights); parts of 3 and 5 examples
    with unequal counts of padding tell."""
    model = _tagger(NonPaddingTokenLoss(name="ner_loss"))
    item = capture(model, x=np.ones((2, 20), "int32"), y=np.ones((2, 20), "int32"))
    assert coupled_losses(model, item) == ["ner_loss (NonPaddingTokenLoss)"]
    with pytest.raises(AutodistError, match=r"ner_loss.*non-padding tokens.*ignore_class"
                                            r".*mean_with_sample_weight"):
        keras_parity.check(model, item, _strategy(item))


@pytest.mark.parametrize("loss", [
    keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0),
    keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="mean_with_sample_weight")])
def test_token_losses_keras_reduces_pass(loss) -> None:
    """ignore_class divides by the batch's count of other tokens too, but as Keras' mask,
    which the run sums over replicas: not refused."""
    model = _tagger(loss)
    item = capture(model, x=np.ones((2, 20), "int32"), y=np.ones((2, 20), "int32"))
    assert coupled_losses(model, item) == []


def _worst_example(y_true, y_pred):
    """The largest cross-entropy of the batch: a function of the batch, not a mean."""
    return ops.max(keras.losses.sparse_categorical_crossentropy(y_true, y_pred,
                                                                from_logits=True))


def test_several_outputs_each_loss_is_checked_against_its_own_target() -> None:
    """Targets are the step's inputs in sorted output names (dict targets): each output's
    loss gets its own target's shape and dtype (sparse ids for one, (N, 1) for the other)."""
    keras.utils.set_random_seed(0)
    inputs, h = _encoder()
    model = keras.Model(inputs, {"zeta": layers.Dense(3, name="zeta")(h),
                                 "alpha": layers.Dense(8, name="alpha")(h)})
    model.compile("adam", loss={"zeta": _worst_example,
                                "alpha": SupervisedContrastiveLoss(name="supcon")})
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 6))
    y = {"zeta": rng.integers(0, 3, 16), "alpha": rng.integers(0, 3, (16, 1))}
    item = capture(model, x=x, y=y)
    assert sorted(coupled_losses(model, item)) == [
        "_worst_example", "supcon (SupervisedContrastiveLoss)"]
    model.compile("adam", loss={"zeta": keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), "alpha": "mse"})
    assert coupled_losses(model, capture(model, x=x, y=y)) == []


class _SqueezingLoss(SupervisedContrastiveLoss):
    """keras-io's squeeze of the labels, without an axis (unknown rank for any batch)."""

    def __call__(self, labels, feature_vectors, sample_weight=None):
        labels = ops.expand_dims(ops.cast(ops.squeeze(labels), "float32"), -1)
        return ops.mean(ops.sum(labels * 0.0, axis=1)) + ops.mean(feature_vectors)


@pytest.mark.parametrize("fitted_first", [False, True], ids=["fresh", "after-keras-fit"])
def test_a_loss_needing_a_static_batch_size_is_a_capture_error_naming_the_fix(
        fitted_first: bool) -> None:
    """Keras' fit traces with the first batch's size and trains such a loss; the capture
    traces for any size: a CaptureError naming the op's fix, not TensorFlow's ValueError
    (raised by Keras' symbolic build, or by the trace once Keras built the model)."""
    from autodist.ir.errors import CaptureError

    model, x, y = _contrastive_model()
    model.compile("adam", loss=_SqueezingLoss())
    if fitted_first:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    with pytest.raises(CaptureError, match=r"batches of any size.*ops\.squeeze\(labels, "
                                           r"axis=-1\)"):
        capture(model, x=x, y=y)


class Projection(keras.Model):
    """A subclassed encoder (a name Keras can scope: no leading underscore)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = layers.Dense(4, activation="tanh")
        self.out = layers.Dense(8)

    def call(self, x):
        return self.out(self.hidden(x))


@pytest.mark.parametrize("kind", ["sequential", "subclassed"])
def test_sequential_and_subclassed_models_are_checked_too(kind: str) -> None:
    """A Sequential model has outputs but no output names; a subclassed one neither (its
    output inferred from the capture's input spec)."""
    keras.utils.set_random_seed(0)
    if kind == "sequential":
        model = keras.Sequential([keras.Input((6,)), layers.Dense(4, activation="tanh"),
                                  layers.Dense(8)])
    else:
        model = Projection()
        model(keras.Input((6,)))
    model.compile("adam", loss=SupervisedContrastiveLoss(name="supcon"))
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(16, 6)), rng.integers(0, 3, (16, 1))
    item = capture(model, x=x, y=y)
    assert coupled_losses(model, item) == ["supcon (SupervisedContrastiveLoss)"]


class BatchCentering(layers.Layer):
    """Subtracts the batch's mean: each example's output depends on the others."""

    def call(self, x):
        return x - ops.mean(x, axis=0, keepdims=True)


class CapacityRouter(layers.Layer):
    """keras-io's Switch Transformer router, in short: each example goes to its top expert
    while the expert has room, counted over the batch (a cumulative sum along it)."""

    def __init__(self, experts: int, capacity: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.route = layers.Dense(experts)
        self.experts, self.capacity = experts, capacity

    def call(self, x):
        probs = ops.softmax(self.route(x), axis=-1)
        mask = ops.one_hot(ops.argmax(probs, axis=-1), self.experts)
        position = ops.cumsum(mask, axis=0) * mask
        kept = mask * ops.cast(position <= self.capacity, "float32")
        return x * ops.sum(probs * kept, axis=-1, keepdims=True)


@pytest.mark.parametrize("kind", ["functional", "sequential"])
@pytest.mark.parametrize("make", [BatchCentering, lambda: CapacityRouter(2, 2)],
                         ids=["batch-mean", "capacity-router"])
def test_a_layer_mixing_the_batchs_examples_is_refused_before_launch(make, kind: str) -> None:
    keras.utils.set_random_seed(0)
    if kind == "functional":
        inputs, h = _encoder()
        model = keras.Model(inputs, layers.Dense(1)(make()(h)))
    else:   # no `input` structure, its `inputs` instead
        model = keras.Sequential([keras.Input((6,)), layers.Dense(4), make(), layers.Dense(1)])
    model.compile("adam", "mse")
    item = capture(model)
    assert coupled_outputs(model)
    with pytest.raises(AutodistError, match=r"depend on the other examples of its batch, "
                                            r"first after layer '(batch_centering|capacity_"
                                            r"router).*one device"):
        keras_parity.check(model, item, _strategy(item))


class Sampling(layers.Layer):
    """keras-io's VAE sampling: a draw in every call, in inference mode too."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, x):
        return x + keras.random.normal(ops.shape(x), seed=self.seed_generator)


def test_per_example_layers_and_their_state_are_left_as_they_are() -> None:
    """Batch normalization (inference mode), masks, a random layer without a training gate
    (nothing can be told: left alone; its seed generator put back): no refusal, the
    model's variables unchanged."""
    keras.utils.set_random_seed(0)
    ids = keras.Input((None,), dtype="int32", name="ids")
    h = layers.Embedding(5, 4, mask_zero=True)(ids)
    h = layers.GRU(4)(h)
    h = layers.BatchNormalization()(h)
    h = Sampling()(h)
    model = keras.Model(ids, layers.Dense(1)(h))
    model.compile("adam", "mse")
    before = [np.array(v.numpy()) for v in model.variables]
    assert not coupled_outputs(model)
    assert all(np.array_equal(a, np.asarray(v.numpy())) for a, v in zip(before, model.variables))


class FlatTokens(layers.Layer):
    """keras-io's Switch Transformer's reshape: every token of the batch in one matrix,
    its row count fixed to the global batch size the example trains with."""

    def __init__(self, batch_size: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.batch_size = batch_size

    def call(self, inputs):
        flat = tf.reshape(inputs, [self.batch_size * 4, 3])
        return tf.reshape(flat * 2.0, tf.shape(inputs))


def _fixed_batch_model(batch_size: int) -> keras.Model:
    inputs = keras.Input((4, 3))
    h = FlatTokens(batch_size, name="flat_tokens")(inputs)
    outputs = layers.Dense(1)(layers.GlobalAveragePooling1D()(layers.Dense(4)(h)))
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def test_a_shape_fixed_to_the_global_batch_is_refused_before_launch() -> None:
    """It failed on the random batch of the outputs' check, which then let it pass, and
    every worker crashed at its first step; now the fit refuses it naming the op."""
    model = _fixed_batch_model(16)
    item = capture(model)
    strategy = _strategy(item)
    keras_parity.check_batch_parts(item, strategy, 32)   # wrong batch: nothing told
    with pytest.raises(AutodistError, match=r"fixes a shape to the batch size.*global batch "
                                            r"of 16.*\[8\].*flat_tokens.*Reshape"):
        keras_parity.check_batch_parts(item, strategy, 16)
    x = np.zeros((32, 4, 3), "float32")
    run = autodist.distribute(model, strategy, autodist.ResourceSpec.local(workers=2, ps=0))
    with pytest.raises(AutodistError, match=r"fixes a shape to the batch size"):
        run.fit(x, np.zeros((32, 1), "float32"), batch_size=16, verbose=0)


def test_a_step_whose_shapes_follow_the_batch_passes() -> None:
    model, x, y = _contrastive_model()
    item = capture(model, x=x, y=y)
    for strategy in (_strategy(item), _strategy(item, virtual_nodes=4)):
        keras_parity.check_batch_parts(item, strategy, 16)
    keras_parity.check_batch_parts(item, _strategy(item, virtual_nodes=4), 13)
