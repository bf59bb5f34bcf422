"""Example models, compiled and ready to capture, and their registry.

Used by the demo, the tests, the CLI (`MODEL` names), `autodist bench` and
the benchmarks. Each function builds a fresh compiled Keras 3 model; `seed`
fixes its initial weights. Sizes are small by default so a step takes
milliseconds on a CPU. `REGISTRY` is the one table of example models: per
name, its factory and the sizes the benchmarks measure it at
(`build_bench`: `autodist bench`, the trial data set and the benchmark
scripts all use these).

Example:
    >>> from autodist import models
    >>> model = models.build("mlp")              # doctest: +SKIP
    >>> big = models.build_bench("ncf")          # doctest: +SKIP
    >>> gi = autodist.capture(model)             # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from autodist.ir.deprecation import renamed_names
from autodist.ir.errors import InvalidArgumentError


def mlp(input_dim: int = 784, hidden: tuple[int, ...] = (256, 256), classes: int = 10,
        seed: int = 0, optimizer: Any = "sgd"):
    """A multi-layer perceptron for classification (sparse integer labels)."""
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((input_dim,), name="features")
    h = inputs
    for i, width in enumerate(hidden):
        h = keras.layers.Dense(width, activation="relu", name=f"dense_{i}")(h)
    outputs = keras.layers.Dense(classes, name="logits")(h)
    model = keras.Model(inputs, outputs, name="mlp")
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def cnn(image_size: int = 32, channels: int = 3, classes: int = 10, seed: int = 0,
        optimizer: Any = "sgd"):
    """A small ResNet-style CNN with batch normalization and a residual block."""
    import keras
    from keras import layers

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((image_size, image_size, channels), name="image")
    h = layers.Conv2D(16, 3, padding="same", use_bias=False, name="stem_conv")(inputs)
    h = layers.BatchNormalization(name="stem_bn")(h)
    h = layers.ReLU()(h)
    shortcut = h
    h = layers.Conv2D(16, 3, padding="same", use_bias=False, name="block_conv1")(h)
    h = layers.BatchNormalization(name="block_bn1")(h)
    h = layers.ReLU()(h)
    h = layers.Conv2D(16, 3, padding="same", use_bias=False, name="block_conv2")(h)
    h = layers.BatchNormalization(name="block_bn2")(h)
    h = layers.ReLU()(layers.Add()([h, shortcut]))
    h = layers.Conv2D(32, 3, strides=2, padding="same", name="down_conv")(h)
    h = layers.GlobalAveragePooling2D()(h)
    outputs = layers.Dense(classes, name="logits")(h)
    model = keras.Model(inputs, outputs, name="cnn")
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def embedding_model(num_users: int = 1000, num_items: int = 2000, dim: int = 16,
                    seed: int = 0, optimizer: Any = "adam"):
    """A neural collaborative-filtering model with two embedding tables.

    Inputs are integer user and item ids; the output is a click logit. Both
    embedding tables get sparse (IndexedSlices) gradients.
    """
    import keras
    from keras import layers

    keras.utils.set_random_seed(seed)
    user = keras.Input((1,), dtype="int32", name="user")
    item = keras.Input((1,), dtype="int32", name="item")
    u = layers.Flatten()(layers.Embedding(num_users, dim, name="user_embedding")(user))
    v = layers.Flatten()(layers.Embedding(num_items, dim, name="item_embedding")(item))
    h = layers.Concatenate()([u, v, layers.Multiply()([u, v])])
    h = layers.Dense(32, activation="relu", name="mlp_hidden")(h)
    outputs = layers.Dense(1, name="logit")(h)
    model = keras.Model([user, item], outputs, name="ncf")
    model.compile(optimizer=optimizer,
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def ctr_model(num_users: int = 100_000, num_categories: int = 500, history_len: int = 50,
              dim: int = 32, hidden: int = 64, seed: int = 0, optimizer: Any = "adam"):
    """A click-through-rate model: a user id and the categories of recent items.

    The user id looks up one row of a large table; the history looks up
    `history_len` rows of a small category table (a vocabulary smaller than
    a batch's lookups) and averages them. Both get sparse (IndexedSlices)
    gradients, at the two ends of the trade-off: a few rows of a big table
    move cheaply as rows, while the many rows of the small one cost more than
    the table itself.
    """
    import keras
    from keras import layers

    keras.utils.set_random_seed(seed)
    user = keras.Input((1,), dtype="int32", name="user")
    history = keras.Input((history_len,), dtype="int32", name="history")
    u = layers.Flatten()(layers.Embedding(num_users, dim, name="user_embedding")(user))
    c = layers.GlobalAveragePooling1D()(
        layers.Embedding(num_categories, dim, name="category_embedding")(history))
    h = layers.Dense(hidden, activation="relu", name="mlp_hidden")(
        layers.Concatenate()([u, c, layers.Multiply()([u, c])]))
    outputs = layers.Dense(1, name="logit")(h)
    model = keras.Model([user, history], outputs, name="ctr")
    model.compile(optimizer=optimizer,
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def transformer(vocab_size: int = 1000, seq_len: int = 16, dim: int = 32, heads: int = 2,
                layers_count: int = 2, classes: int = 2, seed: int = 0,
                optimizer: Any = "adam"):
    """A small Transformer encoder classifier (token + position embeddings)."""
    import keras
    from keras import layers

    keras.utils.set_random_seed(seed)
    tokens = keras.Input((seq_len,), dtype="int32", name="tokens")
    h = layers.Embedding(vocab_size, dim, name="token_embedding")(tokens)
    h = _position_embedding_layer()(seq_len, dim, name="position_embedding")(h)
    for i in range(layers_count):
        attn = layers.MultiHeadAttention(heads, dim // heads, name=f"attention_{i}")(h, h)
        h = layers.LayerNormalization(name=f"norm_{i}a")(h + attn)
        ff = layers.Dense(dim * 2, activation="gelu", name=f"ffn_{i}_in")(h)
        ff = layers.Dense(dim, name=f"ffn_{i}_out")(ff)
        h = layers.LayerNormalization(name=f"norm_{i}b")(h + ff)
    h = layers.GlobalAveragePooling1D()(h)
    outputs = layers.Dense(classes, name="logits")(h)
    model = keras.Model(tokens, outputs, name="transformer")
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _position_embedding_layer():
    """A layer adding a learned (seq_len, dim) position table to its input."""
    import keras

    class PositionEmbedding(keras.layers.Layer):
        def __init__(self, seq_len: int, dim: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.table = self.add_weight(shape=(seq_len, dim), name="embeddings",
                                         initializer="random_normal")

        def call(self, inputs):
            return inputs + self.table[None, :, :]

    return PositionEmbedding


def language_model(vocab_size: int = 20000, seq_len: int = 8, dim: int = 32,
                   seed: int = 0, optimizer: Any = "sgd"):
    """A next-token language model with a large vocabulary.

    Token ids -> Embedding(vocab_size, dim) -> mean over the context -> a
    small dense mixing layer -> Dense softmax logits over the whole
    vocabulary (sparse integer labels). The input table gets sparse
    (IndexedSlices) gradients; the output projection, as large, dense ones:
    the two ends of the strategy choice for big tables.
    """
    import keras
    from keras import layers

    keras.utils.set_random_seed(seed)
    tokens = keras.Input((seq_len,), dtype="int32", name="tokens")
    h = layers.Embedding(vocab_size, dim, name="token_embedding")(tokens)
    h = layers.GlobalAveragePooling1D()(h)
    h = layers.Dense(dim, activation="relu", name="mix")(h)
    outputs = layers.Dense(vocab_size, name="softmax")(h)
    model = keras.Model(tokens, outputs, name="lm")
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def resnet50(image_size: int = 64, classes: int = 1000, seed: int = 0,
             optimizer: Any = "sgd"):
    """Keras' ResNet50 (about 25M parameters), untrained, at a small image size."""
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.applications.ResNet50(weights=None, input_shape=(image_size, image_size, 3),
                                        classes=classes)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=False))
    return model


@dataclasses.dataclass(frozen=True)
class ExampleModel:
    """One example model of the registry.

    Attributes:
        factory: Builds the compiled model; its defaults are the small sizes
            of the demo, the tests and the CLI.
        description: What the model is, in a line.
        bench_kwargs: The factory's arguments at the sizes the benchmarks
            measure (`autodist bench`, the trial data set, benchmarks/):
            chosen so a measured strategy takes seconds on a 2-core machine.
            None: the model is not benchmarked.
    """

    factory: Callable[..., Any]
    description: str
    bench_kwargs: Mapping[str, Any] | None = None


# The example models, in the order reports list them.
REGISTRY: dict[str, ExampleModel] = {
    "mlp": ExampleModel(mlp, "multi-layer perceptron (dense gradients)",
                        dict(hidden=(256, 256))),
    "cnn": ExampleModel(cnn, "small ResNet-style CNN with batch normalization (compute-bound)",
                        {}),
    # Two large embedding tables (sparse gradients); SGD touches only looked-up rows.
    "ncf": ExampleModel(embedding_model, "collaborative filtering, two embedding tables",
                        dict(num_users=50_000, num_items=20_000, dim=16, optimizer="sgd")),
    # A large user table (one row per example) and a small category table looked up
    # 50 times per example: rows vs densified tables.
    "ctr": ExampleModel(ctr_model, "click-through rate: a large and a small, often looked-up "
                                   "table",
                        dict(num_users=100_000, num_categories=500, history_len=50, dim=32,
                             optimizer="sgd")),
    # Large vocabulary: a sparse input table and an as large dense softmax projection.
    "lm": ExampleModel(language_model, "language model with a large vocabulary",
                       dict(vocab_size=10_000, seq_len=8, dim=32)),
    # A small BERT-style encoder.
    "transformer": ExampleModel(transformer, "small Transformer encoder",
                                dict(vocab_size=2000, seq_len=16, dim=32, layers_count=2)),
    "resnet50": ExampleModel(resnet50, "Keras ResNet50 at 64x64 (25.6M parameters)"),
}

# Name -> factory, as before the registry (`build(name, **kwargs)` calls it).
MODEL_FACTORIES: dict[str, Callable[..., Any]] = {name: e.factory for name, e in REGISTRY.items()}
# The models the benchmarks measure, in report order.
BENCH_MODELS: tuple[str, ...] = tuple(name for name, e in REGISTRY.items()
                                      if e.bench_kwargs is not None)


def single_device_twin(model):
    """An independent copy of a compiled model: same weights, loss, fresh optimizer.

    The reference a distributed run is checked against: train the twin with
    Keras `fit` on one device and compare weights.
    """
    import keras

    twin = keras.models.clone_model(model)
    twin.set_weights(model.get_weights())
    compiled = getattr(model, "_compile_config", None)
    loss_weights = compiled.config.get("loss_weights") if compiled is not None else None
    twin.compile(optimizer=model.optimizer.__class__.from_config(model.optimizer.get_config()),
                 loss=model.loss, loss_weights=loss_weights)
    return twin


def synthetic_data(model, num_examples: int, seed: int = 0):
    """Random inputs and targets shaped for `model` (for demos and benchmarks).

    Integer inputs (ids) are drawn below the size of the embedding they feed,
    read from the model's Embedding layers in order.
    """
    import keras
    import numpy as np

    rng = np.random.default_rng(seed)
    vocab = [layer.input_dim for layer in model.layers
             if isinstance(layer, keras.layers.Embedding)]
    xs = []
    for i, tensor in enumerate(model.inputs):
        shape = (num_examples,) + tuple(tensor.shape[1:])
        if "int" in str(tensor.dtype):
            high = vocab[i] if i < len(vocab) else 2
            xs.append(rng.integers(0, high, shape).astype("int32"))
        else:
            xs.append(rng.normal(size=shape).astype("float32"))
    out = model.outputs[0]
    classes = int(out.shape[-1])
    if classes == 1:
        y = rng.integers(0, 2, (num_examples, 1)).astype("float32")
    else:
        y = rng.integers(0, classes, num_examples).astype("int32")
    return (xs[0] if len(xs) == 1 else xs), y


def build(name: str, **kwargs: Any):
    """Builds the example model called `name` (a key of `REGISTRY`), default sizes."""
    return _entry(name).factory(**kwargs)


def bench_kwargs(name: str) -> dict[str, Any]:
    """The factory arguments of `name` at the benchmarks' sizes.

    Raises:
        ValueError: `name` is unknown or not benchmarked.
    """
    entry = _entry(name)
    if entry.bench_kwargs is None:
        raise InvalidArgumentError(f"example model {name!r} has no benchmark size; benchmarked: "
                                   f"{list(BENCH_MODELS)}")
    return dict(entry.bench_kwargs)


def build_bench(name: str, **overrides: Any):
    """Builds `name` at the benchmarks' sizes (`bench_kwargs`), with `overrides` applied."""
    return _entry(name).factory(**{**bench_kwargs(name), **overrides})


def _entry(name: str) -> ExampleModel:
    try:
        return REGISTRY[name]
    except KeyError:
        raise InvalidArgumentError(f"unknown example model {name!r}; known: "
                                   f"{sorted(REGISTRY)}") from None


# Old names, kept working with a DeprecationWarning that names the new one.
__getattr__ = renamed_names(__name__, globals(), {"BUILDERS": "MODEL_FACTORIES"})
