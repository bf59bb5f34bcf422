"""Example models, compiled and ready to capture.

Used by the demo, the tests and the benchmarks. Each function builds a fresh
compiled Keras 3 model; `seed` fixes its initial weights. Sizes are small by
default so a step takes milliseconds on a CPU.

Example:
    >>> from autodist import models
    >>> model = models.build("mlp")              # doctest: +SKIP
    >>> gi = autodist.capture(model)             # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any, Callable


def mlp(input_dim: int = 784, hidden: tuple[int, ...] = (256, 256), classes: int = 10,
        seed: int = 0, optimizer: Any = "sgd"):
    """A multi-layer perceptron for classification (sparse integer labels)."""
    import keras  # pylint: disable=import-outside-toplevel

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
    import keras  # pylint: disable=import-outside-toplevel
    from keras import layers  # pylint: disable=import-outside-toplevel

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
    import keras  # pylint: disable=import-outside-toplevel
    from keras import layers  # pylint: disable=import-outside-toplevel

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
    import keras  # pylint: disable=import-outside-toplevel
    from keras import layers  # pylint: disable=import-outside-toplevel

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
    import keras  # pylint: disable=import-outside-toplevel
    from keras import layers  # pylint: disable=import-outside-toplevel

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
    import keras  # pylint: disable=import-outside-toplevel

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
    import keras  # pylint: disable=import-outside-toplevel
    from keras import layers  # pylint: disable=import-outside-toplevel

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
    import keras  # pylint: disable=import-outside-toplevel

    keras.utils.set_random_seed(seed)
    model = keras.applications.ResNet50(weights=None, input_shape=(image_size, image_size, 3),
                                        classes=classes)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=False))
    return model


BUILDERS: dict[str, Callable[..., Any]] = {
    "mlp": mlp,
    "cnn": cnn,
    "ncf": embedding_model,
    "ctr": ctr_model,
    "transformer": transformer,
    "lm": language_model,
    "resnet50": resnet50,
}


def single_device_twin(model):
    """An independent copy of a compiled model: same weights, loss, fresh optimizer.

    The reference a distributed run is checked against: train the twin with
    Keras `fit` on one device and compare weights.
    """
    import keras  # pylint: disable=import-outside-toplevel

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
    import keras  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel

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
    """Builds the example model called `name` (one of `BUILDERS`)."""
    try:
        factory = BUILDERS[name]
    except KeyError:
        raise ValueError(f"unknown example model {name!r}; known: {sorted(BUILDERS)}") from None
    return factory(**kwargs)
