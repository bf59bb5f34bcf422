"""Small models after the public keras-io examples, with data as users pass it to `fit`.

Each builder in `ZOO` seeds Keras, builds and compiles a scaled-down version
of one keras-io example (tiny vocabularies, widths 4-16, one or two layers,
48-160 synthetic examples from `numpy.random.default_rng`) and returns a
`ZooCase`: the model, `x` and `y` exactly as a user hands them to `fit`
(dicts by input name, strings, 1-D targets, int64/float64/uint8 arrays, a
`tf.data.Dataset` of batches with `y` None), and
the `fit` keyword arguments. `keras_reference` trains an independent twin
(the same builder, called again) with single-device Keras `fit`: the numbers
a distributed run must reproduce.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

import keras
from keras import layers, ops

EPOCHS = 2

# The feature classes a case may exercise (`ZooCase.features`).
FEATURES = frozenset({
    "dict_inputs", "variable_length", "1d_targets", "dtypes", "time_targets",
    "preprocessing", "random", "batchnorm", "jit", "mixed_precision", "add_loss",
    "regularizers", "masking", "rnn", "multi_output", "subclassed", "shuffle",
    "sample_weight", "class_weight", "validation", "explicit_mask", "no_targets",
    "soft_labels", "conv_rnn", "dataset",
})


@dataclasses.dataclass
class ZooCase:
    """One model of the zoo with its training data and `fit` arguments.

    Attributes:
        name: The key in `ZOO`.
        source: The keras-io file the model follows.
        features: The feature classes (`FEATURES`) it exercises.
        model: The compiled model.
        x: Inputs exactly as a user passes them to `fit`.
        y: Targets exactly as a user passes them to `fit`.
        fit_kwargs: batch_size, epochs, shuffle and any weights or validation.
        expect_error: A regex of the error autodist should raise before
            launch, or None where the run should equal Keras.
        zero_gradient: Substrings of variable paths whose gradient is zero in
            exact arithmetic (an attention key's bias: softmax ignores a shift
            of a query's logits). Adam turns the float noise in it into steps
            of the learning rate, which no two summation orders share; they
            are compared against that bound only.
        float16: The model computes in float16 ('mixed_float16'): weights and
            History agree to float16 rounding (a replica's float16 sums round
            differently from Keras' one sum), and the run says so.
    """

    name: str
    source: str
    features: tuple[str, ...]
    model: keras.Model
    x: Any
    y: Any
    fit_kwargs: dict[str, Any]
    expect_error: str | None = None
    zero_gradient: tuple[str, ...] = ()
    float16: bool = False


def _fit_kwargs(batch_size: int = 32, shuffle: bool = False, **extra: Any) -> dict[str, Any]:
    return {"batch_size": batch_size, "epochs": EPOCHS, "shuffle": shuffle, **extra}


def _padded(rng: np.random.Generator, n: int, maxlen: int, vocab: int, *,
            pre: bool = False, dtype: str = "int64") -> np.ndarray:
    """Id sequences of random lengths, zero-padded to `maxlen` (as `pad_sequences`)."""
    out = np.zeros((n, maxlen), dtype=dtype)
    lengths = rng.integers(2, maxlen + 1, n)
    for i, length in enumerate(lengths):
        ids = rng.integers(1, vocab, length)
        if pre:
            out[i, maxlen - length:] = ids
        else:
            out[i, :length] = ids
    return out


_WORDS = np.array(["good", "great", "fun", "bad", "awful", "boring",
                   "the", "movie", "plot", "actor", "scene", "a"])


def _reviews(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Short movie reviews from a 12-word vocabulary and their 0/1 sentiment."""
    texts, labels = [], []
    for _ in range(n):
        words = rng.choice(_WORDS, rng.integers(3, 11))
        positive = np.isin(words, _WORDS[:3]).sum()
        negative = np.isin(words, _WORDS[3:6]).sum()
        texts.append(" ".join(words))
        labels.append(int(positive >= negative))
    return np.array(texts, dtype=object), np.array(labels, dtype="int64")


class TokenAndPositionEmbedding(layers.Layer):
    """Token embedding plus a learned position embedding (the keras-io transformer examples)."""

    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.token_emb = layers.Embedding(vocab_size, embed_dim)
        self.pos_emb = layers.Embedding(maxlen, embed_dim)

    def call(self, x):
        positions = ops.arange(0, ops.shape(x)[-1], 1)
        return self.token_emb(x) + self.pos_emb(positions)


class TransformerBlock(layers.Layer):
    """Self-attention and a feed-forward net, each with dropout, a residual and layer norm."""

    def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, rate: float = 0.1,
                 causal: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.causal = causal
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim // num_heads)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"),
                                     layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs, training=None):
        attention = self.att(inputs, inputs, use_causal_mask=self.causal)
        out1 = self.layernorm1(inputs + self.dropout1(attention, training=training))
        ffn = self.dropout2(self.ffn(out1), training=training)
        return self.layernorm2(out1 + ffn)


def heart_disease() -> ZooCase:
    """Heart-disease classifier on a dict of raw columns, encoded inside the model.

    Follows examples/structured_data/structured_data_classification_from_scratch.py:
    IntegerLookup for integer categories, StringLookup for `thal`, an adapted
    Normalization per numeric column, Dense + Dropout(0.5), a sigmoid; the
    columns as 1-D int64/float64/object arrays (as `dict(dataframe)` gives)
    for `Input((1,))`, 1-D int64 labels; the dataset's shuffling as `shuffle=True`.
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    n = 96
    x = {  # the columns of `dict(dataframe)`, in the CSV's order (not sorted)
        "age": rng.integers(29, 78, n),
        "sex": rng.integers(0, 2, n),
        "cp": rng.integers(0, 5, n),
        "chol": rng.normal(245.0, 50.0, n),
        "thal": rng.choice(np.array(["fixed", "normal", "reversible"], dtype=object), n),
    }
    y = ((x["age"] > 55) ^ (rng.random(n) < 0.2)).astype("int64")
    inputs = {"age": keras.Input((1,), name="age"),
              "sex": keras.Input((1,), name="sex", dtype="int64"),
              "cp": keras.Input((1,), name="cp", dtype="int64"),
              "chol": keras.Input((1,), name="chol"),
              "thal": keras.Input((1,), name="thal", dtype="string")}
    encoded = []
    for name in ("age", "chol"):
        normalizer = layers.Normalization()
        normalizer.adapt(x[name][:, None].astype("float32"))
        encoded.append(normalizer(inputs[name]))
    for name, vocabulary in (("sex", [0, 1]), ("cp", [0, 1, 2, 3, 4])):
        encoded.append(layers.IntegerLookup(vocabulary=vocabulary,
                                            output_mode="one_hot")(inputs[name]))
    encoded.append(layers.StringLookup(vocabulary=["fixed", "normal", "reversible"],
                                       output_mode="one_hot")(inputs["thal"]))
    h = layers.Dense(8, activation="relu")(layers.concatenate(encoded))
    h = layers.Dropout(0.5)(h)
    outputs = layers.Dense(1, activation="sigmoid")(h)
    model = keras.Model(inputs, outputs)
    model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
    return ZooCase("heart_disease",
                   "examples/structured_data/structured_data_classification_from_scratch.py",
                   ("dict_inputs", "preprocessing", "random", "dtypes", "1d_targets", "shuffle"),
                   model, x, y, _fit_kwargs(shuffle=True))


def census_deep_cross() -> ZooCase:
    """Deep & Cross network on scalar census columns (strings and numbers).

    Follows examples/structured_data/wide_deep_cross_networks.py: `Input(shape=())`
    per column, StringLookup + Embedding, cross layers `x0 * Dense(x) + x`, a
    Dense/BatchNormalization/ReLU/Dropout tower; with the feature-space
    encodings Hashing, Discretization (adapted) and CategoryEncoding added.
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(1)
    n = 96
    vocabularies = {"workclass": ["private", "self-emp", "gov", "none"],
                    "education": ["hs", "college", "bachelors", "masters"]}
    x = {
        "age": rng.uniform(17.0, 90.0, n),
        "workclass": rng.choice(np.array(vocabularies["workclass"], dtype=object), n),
        "hours_per_week": rng.integers(10, 80, n),
        "education": rng.choice(np.array(vocabularies["education"], dtype=object), n),
        "occupation": rng.choice(np.array(["sales", "tech", "craft", "admin", "farming"],
                                          dtype=object), n),
    }
    y = rng.integers(0, 3, n)
    inputs = {name: keras.Input((), name=name, dtype="float32" if name in
                                ("age", "hours_per_week") else "string") for name in x}
    encoded = []
    for name, vocabulary in vocabularies.items():
        ids = layers.StringLookup(vocabulary=vocabulary, mask_token=None,
                                  num_oov_indices=0)(inputs[name])
        encoded.append(layers.Embedding(len(vocabulary), 2)(ids))
    hashed = layers.Hashing(num_bins=8)(inputs["occupation"])
    encoded.append(layers.CategoryEncoding(num_tokens=8, output_mode="one_hot")(hashed))
    discretizer = layers.Discretization(num_bins=4, epsilon=0.01)
    discretizer.adapt(x["age"])
    encoded.append(layers.CategoryEncoding(num_tokens=4, output_mode="one_hot")(
        discretizer(inputs["age"])))
    encoded.append(layers.Rescaling(0.01)(ops.expand_dims(inputs["hours_per_week"], -1)))
    x0 = layers.concatenate(encoded)
    cross = x0
    for _ in range(2):
        cross = x0 * layers.Dense(x0.shape[-1])(cross) + cross
    cross = layers.BatchNormalization()(cross)
    deep = x0
    for units in (8, 8):
        # No bias before BatchNormalization (it cancels it): its gradient would be
        # float noise, which Adam turns into steps no two runs share.
        deep = layers.Dense(units, use_bias=False)(deep)
        deep = layers.BatchNormalization()(deep)
        deep = layers.ReLU()(deep)
        deep = layers.Dropout(0.2)(deep)
    outputs = layers.Dense(3, activation="softmax")(layers.concatenate([cross, deep]))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(),
                  metrics=[keras.metrics.SparseCategoricalAccuracy()])
    return ZooCase("census_deep_cross", "examples/structured_data/wide_deep_cross_networks.py",
                   ("dict_inputs", "preprocessing", "batchnorm", "random", "dtypes"),
                   model, x, y, _fit_kwargs())


class RecommenderNet(keras.Model):
    """User and movie embeddings (L2-regularized) and biases; a sigmoid of their dot product."""

    def __init__(self, num_users: int, num_movies: int, embedding_size: int,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.user_embedding = layers.Embedding(
            num_users, embedding_size, embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-3))
        self.user_bias = layers.Embedding(num_users, 1)
        self.movie_embedding = layers.Embedding(
            num_movies, embedding_size, embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-3))
        self.movie_bias = layers.Embedding(num_movies, 1)

    def call(self, inputs):
        user_vector = self.user_embedding(inputs[:, 0])
        movie_vector = self.movie_embedding(inputs[:, 1])
        dot = ops.sum(user_vector * movie_vector, axis=1, keepdims=True)
        return ops.sigmoid(dot + self.user_bias(inputs[:, 0]) + self.movie_bias(inputs[:, 1]))


def movielens_recommender() -> ZooCase:
    """Subclassed collaborative-filtering model on (user, movie) id pairs.

    Follows examples/structured_data/collaborative_filtering_movielens.py:
    `x = df[["user", "movie"]].values` (int64, shape (N, 2)), ratings scaled
    to [0, 1] as float64 of shape (N,), embeddings_regularizer (a weight
    term added to the loss), built by calling it on `keras.Input((2,))`.
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(2)
    n = 128
    x = np.stack([rng.integers(0, 12, n), rng.integers(0, 16, n)], axis=1)
    ratings = rng.choice(np.arange(1, 11) * 0.5, n)
    y = (ratings - 0.5) / 4.5
    model = RecommenderNet(12, 16, 4)
    model(keras.Input((2,)))
    model.compile(loss=keras.losses.BinaryCrossentropy(),
                  optimizer=keras.optimizers.Adam(learning_rate=0.01))
    return ZooCase("movielens_recommender",
                   "examples/structured_data/collaborative_filtering_movielens.py",
                   ("subclassed", "regularizers", "add_loss", "dtypes", "1d_targets"),
                   model, x, y, _fit_kwargs())


def text_cnn_strings() -> ZooCase:
    """End-to-end text classifier on raw strings: TextVectorization inside the model.

    Follows examples/nlp/text_classification_from_scratch.py: adapted
    TextVectorization, Embedding, SpatialDropout1D (for its Dropout), Conv1D,
    GlobalMaxPooling1D, Dense + Dropout(0.5), a sigmoid; `validation_split`.
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(3)
    texts, y = _reviews(rng, 128)
    vectorize = layers.TextVectorization(max_tokens=16, output_mode="int",
                                         output_sequence_length=8)
    vectorize.adapt(texts)
    inputs = keras.Input((1,), dtype="string")
    h = layers.Embedding(16, 8)(vectorize(inputs))
    h = layers.SpatialDropout1D(0.2)(h)
    h = layers.Conv1D(8, 3, padding="valid", activation="relu")(h)
    h = layers.GlobalMaxPooling1D()(h)
    h = layers.Dropout(0.5)(layers.Dense(8, activation="relu")(h))
    outputs = layers.Dense(1, activation="sigmoid", name="predictions")(h)
    model = keras.Model(inputs, outputs)
    model.compile(loss="binary_crossentropy", optimizer="adam", metrics=["accuracy"])
    return ZooCase("text_cnn_strings", "examples/nlp/text_classification_from_scratch.py",
                   ("preprocessing", "random", "1d_targets", "validation"),
                   model, texts, y, _fit_kwargs(validation_split=0.25))


def imdb_bidirectional_lstm() -> ZooCase:
    """A Bidirectional LSTM over pre-padded int64 ids of any length.

    Follows examples/nlp/bidirectional_lstm_imdb.py: `Input(shape=(None,),
    dtype="int32")`, Embedding, Bidirectional(LSTM) (one of its two stacked
    layers), a sigmoid; labels of shape (N,).
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(4)
    n = 64
    x = _padded(rng, n, 10, 30, pre=True)
    y = (x[:, -1] % 2).astype("int64")
    inputs = keras.Input(shape=(None,), dtype="int32")
    h = layers.Embedding(30, 8)(inputs)
    h = layers.Bidirectional(layers.LSTM(4))(h)
    outputs = layers.Dense(1, activation="sigmoid")(h)
    model = keras.Model(inputs, outputs)
    model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
    return ZooCase("imdb_bidirectional_lstm", "examples/nlp/bidirectional_lstm_imdb.py",
                   ("variable_length", "rnn", "dtypes", "1d_targets"),
                   model, x, y, _fit_kwargs())


def imdb_masked_lstm() -> ZooCase:
    """Sequential sentiment LSTM over zero-padded ids, the padding masked.

    Follows examples/nlp/imdb_lstm_sentiment.py: Sequential, Embedding (here
    with `mask_zero=True`), LSTM(dropout=0.2), a sigmoid, `validation_split=0.2`;
    the labels imbalanced, balanced with `class_weight`.
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(5)
    n = 80
    x = _padded(rng, n, 12, 30, pre=True, dtype="int32")
    y = (rng.random(n) < 0.3).astype("int64")
    model = keras.Sequential([keras.Input((None,), dtype="int32"),
                              layers.Embedding(30, 8, mask_zero=True),
                              layers.LSTM(8, dropout=0.2),
                              layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    return ZooCase("imdb_masked_lstm", "examples/nlp/imdb_lstm_sentiment.py",
                   ("masking", "rnn", "random", "variable_length", "1d_targets", "class_weight",
                    "validation"),
                   model, x, y, _fit_kwargs(validation_split=0.2, class_weight={0: 0.7, 1: 1.8}))


def ticket_triage() -> ZooCase:
    """Ticket triage: title, body and tags in; priority and department out.

    Follows guides/functional_api.py ("Models with multiple inputs and
    outputs"): variable-length title and body (masked here, the body read by a
    GRU), dict inputs and targets by name (not in sorted order), dict losses,
    `loss_weights` and per-output metrics; priority targets of shape (N,).
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(6)
    n, num_words, num_tags, num_departments = 64, 40, 6, 4
    title_input = keras.Input(shape=(None,), name="title")
    body_input = keras.Input(shape=(None,), name="body")
    tags_input = keras.Input(shape=(num_tags,), name="tags")
    title_features = layers.Embedding(num_words, 8, mask_zero=True)(title_input)
    body_features = layers.Embedding(num_words, 8, mask_zero=True)(body_input)
    title_features = layers.LSTM(8)(title_features)
    body_features = layers.GRU(4)(body_features)
    h = layers.concatenate([title_features, body_features, tags_input])
    priority_pred = layers.Dense(1, name="priority")(h)
    department_pred = layers.Dense(num_departments, name="department")(h)
    model = keras.Model(inputs=[title_input, body_input, tags_input],
                        outputs=[priority_pred, department_pred])
    model.compile(
        optimizer=keras.optimizers.RMSprop(1e-2),
        loss={"priority": keras.losses.BinaryCrossentropy(from_logits=True),
              "department": keras.losses.CategoricalCrossentropy(from_logits=True)},
        loss_weights={"priority": 1.0, "department": 0.2},
        metrics={"priority": ["mae"], "department": ["categorical_accuracy"]})
    x = {"title": _padded(rng, n, 8, num_words),
         "body": _padded(rng, n, 12, num_words),
         "tags": rng.integers(0, 2, (n, num_tags))}
    y = {"priority": rng.random(n),
         "department": np.eye(num_departments, dtype="int64")[rng.integers(0, num_departments, n)]}
    return ZooCase("ticket_triage", "guides/functional_api.py",
                   ("multi_output", "dict_inputs", "variable_length", "masking", "rnn",
                    "1d_targets", "dtypes"),
                   model, x, y, _fit_kwargs())


def char_gpt() -> ZooCase:
    """A miniature causal transformer predicting the next character at every position.

    Follows examples/generative/text_generation_with_miniature_gpt.py, at the
    character level: token + position embedding, one causal TransformerBlock,
    logits over the alphabet of shape (N, T, V); targets the (N, T) next ids.
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(7)
    n, maxlen = 64, 8
    corpus = " ".join(rng.choice(np.array(["hello", "world", "low", "row", "old"]), 200))
    alphabet = sorted(set(corpus))
    ids = np.array([alphabet.index(c) for c in corpus], dtype="int64")
    starts = rng.integers(0, len(ids) - maxlen - 1, n)
    windows = np.stack([ids[s:s + maxlen + 1] for s in starts])
    inputs = keras.Input(shape=(maxlen,), dtype="int32")
    h = TokenAndPositionEmbedding(maxlen, len(alphabet), 8)(inputs)
    h = TransformerBlock(8, 2, 16, causal=True)(h)
    outputs = layers.Dense(len(alphabet))(h)
    model = keras.Model(inputs, outputs)
    model.compile("adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return ZooCase("char_gpt", "examples/generative/text_generation_with_miniature_gpt.py",
                   ("time_targets", "random", "dtypes"),
                   model, windows[:, :-1], windows[:, 1:], _fit_kwargs())


def lstm_seq2seq() -> ZooCase:
    """Character-level encoder-decoder LSTM with teacher forcing and one-hot sequence targets.

    Follows examples/nlp/lstm_seq2seq.py: `Input(shape=(None, tokens))` for
    encoder and decoder, the encoder's states start the decoder, a softmax
    per step; targets (N, T, V); `validation_split=0.2`.
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(8)
    n, enc_tokens, dec_tokens, enc_len, dec_len, latent_dim = 80, 6, 7, 5, 6, 8
    encoder_data = np.eye(enc_tokens, dtype="float32")[rng.integers(0, enc_tokens, (n, enc_len))]
    target_ids = rng.integers(2, dec_tokens, (n, dec_len - 1))
    decoder_in = np.concatenate([np.zeros((n, 1), "int64"), target_ids], axis=1)   # 0: start
    decoder_out = np.concatenate([target_ids, np.ones((n, 1), "int64")], axis=1)  # 1: end
    decoder_input_data = np.eye(dec_tokens, dtype="float32")[decoder_in]
    decoder_target_data = np.eye(dec_tokens, dtype="float32")[decoder_out]
    encoder_inputs = keras.Input(shape=(None, enc_tokens))
    _, state_h, state_c = layers.LSTM(latent_dim, return_state=True)(encoder_inputs)
    decoder_inputs = keras.Input(shape=(None, dec_tokens))
    decoder_outputs, _, _ = layers.LSTM(latent_dim, return_sequences=True, return_state=True)(
        decoder_inputs, initial_state=[state_h, state_c])
    decoder_outputs = layers.Dense(dec_tokens, activation="softmax")(decoder_outputs)
    model = keras.Model([encoder_inputs, decoder_inputs], decoder_outputs)
    model.compile(optimizer="rmsprop", loss="categorical_crossentropy", metrics=["accuracy"])
    return ZooCase("lstm_seq2seq", "examples/nlp/lstm_seq2seq.py",
                   ("time_targets", "rnn", "variable_length", "validation"),
                   model, [encoder_data, decoder_input_data], decoder_target_data,
                   _fit_kwargs(validation_split=0.2))


def ecg_fcn() -> ZooCase:
    """Fully convolutional time-series classifier: Conv1D + BatchNormalization + ReLU blocks.

    Follows examples/timeseries/timeseries_classification_from_scratch.py:
    float64 series reshaped to (N, T, 1), int64 labels of shape (N,), sparse
    categorical cross-entropy, `validation_split=0.2`.
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(9)
    n, steps = 80, 16
    y = rng.integers(0, 2, n)
    t = np.linspace(0.0, 2.0 * np.pi, steps)
    x = (np.sin(t[None, :] * (1 + y[:, None])) + 0.3 * rng.normal(size=(n, steps)))[..., None]
    inputs = keras.Input((steps, 1))
    h = inputs
    for _ in range(2):
        # No bias before BatchNormalization (it cancels it).
        h = layers.Conv1D(filters=8, kernel_size=3, padding="same", use_bias=False)(h)
        h = layers.BatchNormalization()(h)
        h = layers.ReLU()(h)
    h = layers.GlobalAveragePooling1D()(h)
    outputs = layers.Dense(2, activation="softmax")(h)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy"])
    return ZooCase("ecg_fcn", "examples/timeseries/timeseries_classification_from_scratch.py",
                   ("batchnorm", "dtypes", "validation"),
                   model, x, y, _fit_kwargs(validation_split=0.2))


def anomaly_autoencoder() -> ZooCase:
    """Convolutional autoencoder reconstructing its input sequence (targets (N, T, 1)).

    Follows examples/timeseries/timeseries_anomaly_detection.py: Conv1D with
    strides 2, Dropout, Conv1DTranspose back, `fit(x, x, validation_split=0.1)`;
    with GaussianNoise on the input (a denoising variant).
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(10)
    n, steps = 80, 16
    phase = rng.uniform(0.0, np.pi, (n, 1))
    x = (np.sin(np.linspace(0.0, 4.0 * np.pi, steps)[None, :] + phase)
         + 0.1 * rng.normal(size=(n, steps)))[..., None].astype("float32")
    model = keras.Sequential([
        keras.Input(shape=(steps, 1)),
        layers.GaussianNoise(0.05),
        layers.Conv1D(8, 7, padding="same", strides=2, activation="relu"),
        layers.Dropout(rate=0.2),
        layers.Conv1D(4, 7, padding="same", strides=2, activation="relu"),
        layers.Conv1DTranspose(4, 7, padding="same", strides=2, activation="relu"),
        layers.Dropout(rate=0.2),
        layers.Conv1DTranspose(8, 7, padding="same", strides=2, activation="relu"),
        layers.Conv1DTranspose(1, 7, padding="same"),
    ])
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.001), loss="mse")
    return ZooCase("anomaly_autoencoder", "examples/timeseries/timeseries_anomaly_detection.py",
                   ("time_targets", "random", "validation"),
                   model, x, x, _fit_kwargs(validation_split=0.1))


def weather_lstm() -> ZooCase:
    """LSTM forecasting the next temperature from a window of weather readings.

    Follows examples/timeseries/timeseries_weather_forecasting.py: (N, T, F)
    windows, LSTM + Dense(1), mse; the normalization done by an adapted
    Normalization layer inside the model, GaussianNoise, float64 arrays, 1-D
    targets and per-example `sample_weight` (recent windows weigh more).
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(11)
    n, past = 96, 12
    x = np.stack([rng.normal(10.0, 8.0, (n, past)), rng.normal(1000.0, 10.0, (n, past)),
                  rng.normal(60.0, 20.0, (n, past))], axis=-1)
    y = 0.8 * x[:, -1, 0] + 0.01 * (x[:, -1, 1] - 1000.0) + rng.normal(0.0, 0.5, n)
    normalizer = layers.Normalization(axis=-1)
    normalizer.adapt(x)
    inputs = keras.Input(shape=(past, 3))
    h = layers.GaussianNoise(0.1)(normalizer(inputs))
    outputs = layers.Dense(1)(layers.LSTM(8)(h))
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.01), loss="mse")
    weights = np.linspace(0.5, 1.5, n)
    return ZooCase("weather_lstm", "examples/timeseries/timeseries_weather_forecasting.py",
                   ("rnn", "preprocessing", "random", "dtypes", "1d_targets", "sample_weight"),
                   model, x, y, _fit_kwargs(sample_weight=weights))


def mnist_convnet() -> ZooCase:
    """Simple convnet on small digit images.

    Follows examples/vision/mnist_convnet.py: Sequential Conv2D/MaxPooling2D
    twice, Flatten, Dropout(0.5), softmax; one-hot targets from
    `keras.utils.to_categorical`; SpatialDropout2D added between the
    convolutions.
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(12)
    n, num_classes = 80, 4
    x = rng.random((n, 14, 14, 1)).astype("float32")
    labels = rng.integers(0, num_classes, n)
    x[np.arange(n), labels * 3 + 1, :, 0] += 1.0
    y = keras.utils.to_categorical(labels, num_classes)
    model = keras.Sequential([
        keras.Input(shape=(14, 14, 1)),
        layers.Conv2D(4, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.SpatialDropout2D(0.1),
        layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Flatten(),
        layers.Dropout(0.5),
        layers.Dense(num_classes, activation="softmax"),
    ])
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    return ZooCase("mnist_convnet", "examples/vision/mnist_convnet.py",
                   ("random",),
                   model, x, y, _fit_kwargs())


def _xception_entry(h):
    """The keras-io Xception-style entry: a strided convolution, then two separable
    convolutions with batch normalization (no biases: it cancels them) in a residual
    block that halves the resolution."""
    h = layers.Conv2D(8, 3, strides=2, padding="same", use_bias=False)(h)
    h = layers.Activation("relu")(layers.BatchNormalization()(h))
    previous = h
    for _ in range(2):
        h = layers.Activation("relu")(h)
        h = layers.SeparableConv2D(8, 3, padding="same", use_bias=False)(h)
        h = layers.BatchNormalization()(h)
    h = layers.MaxPooling2D(3, strides=2, padding="same")(h)
    return layers.add([h, layers.Conv2D(8, 1, strides=2, padding="same")(previous)])


def augmented_xception() -> ZooCase:
    """Small Xception-style binary image classifier with augmentation inside the model.

    Follows examples/vision/image_classification_from_scratch.py: RandomFlip +
    RandomRotation, Rescaling(1/255) of uint8 images, Conv2D/SeparableConv2D
    with BatchNormalization and a residual, Dropout, one logit; labels (N,).
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(13)
    n = 64
    y = rng.integers(0, 2, n)
    x = rng.integers(0, 256, (n, 16, 16, 3)).astype("uint8")
    x[y == 1, 4:12, 4:12, 0] = 255
    augmentation = [layers.RandomFlip("horizontal"), layers.RandomRotation(0.1)]
    inputs = keras.Input(shape=(16, 16, 3))
    h = inputs
    for layer in augmentation:
        h = layer(h)
    h = layers.Rescaling(1.0 / 255)(h)
    h = _xception_entry(h)
    h = layers.GlobalAveragePooling2D()(h)
    h = layers.Dropout(0.25)(h)
    outputs = layers.Dense(1, activation=None)(h)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[keras.metrics.BinaryAccuracy(name="acc")])
    return ZooCase("augmented_xception", "examples/vision/image_classification_from_scratch.py",
                   ("random", "batchnorm", "dtypes", "1d_targets"),
                   model, x, y, _fit_kwargs())


class Patches(layers.Layer):
    """Splits images into flattened non-overlapping square patches."""

    def __init__(self, patch_size: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.patch_size = patch_size

    def call(self, images):
        batch_size, height, width, channels = (ops.shape(images)[0], *images.shape[1:])
        patches = ops.image.extract_patches(images, size=self.patch_size)
        count = (height // self.patch_size) * (width // self.patch_size)
        return ops.reshape(patches, (batch_size, count, self.patch_size ** 2 * channels))


class PatchEncoder(layers.Layer):
    """A linear projection of each patch plus a learned position embedding."""

    def __init__(self, num_patches: int, projection_dim: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num_patches = num_patches
        self.projection = layers.Dense(units=projection_dim)
        self.position_embedding = layers.Embedding(num_patches, projection_dim)

    def call(self, patch):
        positions = ops.expand_dims(ops.arange(start=0, stop=self.num_patches, step=1), axis=0)
        return self.projection(patch) + self.position_embedding(positions)


def _mlp(h, hidden_units: tuple[int, ...], dropout_rate: float):
    for units in hidden_units:
        h = layers.Dense(units, activation=keras.activations.gelu)(h)
        h = layers.Dropout(dropout_rate)(h)
    return h


def vision_transformer() -> ZooCase:
    """A one-layer ViT with normalization and random augmentation inside the model.

    Follows examples/vision/image_classification_with_vision_transformer.py:
    an adapted Normalization, RandomFlip, RandomRotation, RandomZoom (plus
    RandomTranslation), patches + position embedding, pre-norm attention and
    a gelu MLP with dropout, AdamW, top-k metrics; labels of shape (N, 1).
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(14)
    n, size, patch, dim, num_classes = 80, 8, 4, 8, 5
    x = rng.random((n, size, size, 3)).astype("float32")
    y = rng.integers(0, num_classes, (n, 1))
    augmentation = keras.Sequential([
        layers.Normalization(), layers.RandomFlip("horizontal"),
        layers.RandomRotation(factor=0.02), layers.RandomZoom(height_factor=0.2, width_factor=0.2),
        layers.RandomTranslation(0.1, 0.1)], name="data_augmentation")
    augmentation.layers[0].adapt(x)
    inputs = keras.Input(shape=(size, size, 3))
    num_patches = (size // patch) ** 2
    encoded = PatchEncoder(num_patches, dim)(Patches(patch)(augmentation(inputs)))
    x1 = layers.LayerNormalization(epsilon=1e-6)(encoded)
    attention = layers.MultiHeadAttention(num_heads=2, key_dim=dim, dropout=0.1)(x1, x1)
    x2 = layers.Add()([attention, encoded])
    x3 = _mlp(layers.LayerNormalization(epsilon=1e-6)(x2), (16, dim), 0.1)
    encoded = layers.Add()([x3, x2])
    representation = layers.Flatten()(layers.LayerNormalization(epsilon=1e-6)(encoded))
    features = _mlp(layers.Dropout(0.5)(representation), (8,), 0.5)
    logits = layers.Dense(num_classes)(features)
    model = keras.Model(inputs=inputs, outputs=logits)
    model.compile(
        optimizer=keras.optimizers.AdamW(learning_rate=0.001, weight_decay=0.0001),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy"),
                 keras.metrics.SparseTopKCategoricalAccuracy(3, name="top-3-accuracy")])
    return ZooCase("vision_transformer",
                   "examples/vision/image_classification_with_vision_transformer.py",
                   ("preprocessing", "random"),
                   model, x, y, _fit_kwargs(), zero_gradient=("key/bias",))


def transformer_text_mixed() -> ZooCase:
    """Transformer text classifier built under the mixed_float16 policy.

    Follows examples/nlp/text_classification_with_transformer.py: token +
    position embedding, one TransformerBlock, pooling, Dropout, softmax (kept
    float32, as the mixed-precision guide asks); int32 padded ids.
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(15)
    n, maxlen, vocab_size = 64, 10, 30
    x = _padded(rng, n, maxlen, vocab_size, pre=True, dtype="int32")
    y = (x.sum(axis=1) % 2).astype("int64")
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        inputs = keras.Input(shape=(maxlen,))
        h = TokenAndPositionEmbedding(maxlen, vocab_size, 8)(inputs)
        h = TransformerBlock(8, 2, 8)(h)
        h = layers.GlobalAveragePooling1D()(h)
        h = layers.Dropout(0.1)(h)
        h = layers.Dropout(0.1)(layers.Dense(8, activation="relu")(h))
        outputs = layers.Dense(2, activation="softmax", dtype="float32")(h)
        model = keras.Model(inputs=inputs, outputs=outputs)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # Keras wraps the optimizer in a LossScaleOptimizer (dynamic loss scaling).
    return ZooCase("transformer_text_mixed", "examples/nlp/text_classification_with_transformer.py",
                   ("mixed_precision", "random", "dtypes"),
                   model, x, y, _fit_kwargs(), zero_gradient=("key/bias",), float16=True)


def fraud_class_weight() -> ZooCase:
    """Imbalanced binary classifier trained with `class_weight`, regularized every way.

    Follows examples/structured_data/imbalanced_classification.py: an MLP with
    dropout, confusion-count metrics, Precision and Recall, class weights
    from the label counts (balanced, n / (2 * count)); with kernel, bias and
    activity regularizers, GaussianDropout/AlphaDropout (selu) and
    `jit_compile=True` added.
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(16)
    n = 128
    x = rng.normal(size=(n, 10))
    y = (x[:, 0] + 0.5 * rng.normal(size=n) > 1.2).astype("int64")
    counts = np.bincount(y)
    model = keras.Sequential([
        keras.Input(shape=(10,)),
        layers.Dense(16, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3),
                     bias_regularizer=keras.regularizers.L1(1e-3)),
        layers.GaussianDropout(0.2),
        layers.Dense(16, activation="selu", kernel_initializer="lecun_normal",
                     activity_regularizer=keras.regularizers.L2(1e-3)),
        layers.AlphaDropout(0.1),
        layers.Dense(1, activation="sigmoid"),
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy",
                  metrics=[keras.metrics.FalseNegatives(name="fn"),
                           keras.metrics.FalsePositives(name="fp"),
                           keras.metrics.TrueNegatives(name="tn"),
                           keras.metrics.TruePositives(name="tp"),
                           keras.metrics.Precision(name="precision"),
                           keras.metrics.Recall(name="recall")],
                  jit_compile=True)
    class_weight = {0: n / (2.0 * counts[0]), 1: n / (2.0 * counts[1])}
    return ZooCase("fraud_class_weight", "examples/structured_data/imbalanced_classification.py",
                   ("class_weight", "regularizers", "add_loss", "random", "jit", "dtypes",
                    "1d_targets"),
                   model, x, y, _fit_kwargs(class_weight=class_weight))


class ActivityRegularizationLayer(layers.Layer):
    """Adds a batch-dependent term, the mean square of its inputs, to the loss."""

    def call(self, inputs):
        self.add_loss(0.01 * ops.mean(ops.square(inputs)))
        return inputs


def digits_sample_weight() -> ZooCase:
    """Digit classifier with a custom `add_loss` layer, sample weights and a validation split.

    Follows guides/training_with_built_in_methods.py: the "digits" MLP,
    RMSprop, SparseCategoricalAccuracy, uint8 labels, `sample_weight` doubling
    one class, `validation_split=0.2`, and its ActivityRegularizationLayer.
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(17)
    n = 80
    x = rng.random((n, 12)).astype("float32")
    y = np.argmax(x[:, :5], axis=1).astype("uint8")
    inputs = keras.Input(shape=(12,), name="digits")
    h = layers.Dense(16, activation="relu", name="dense_1")(inputs)
    h = ActivityRegularizationLayer()(h)
    h = layers.Dense(16, activation="relu", name="dense_2")(h)
    outputs = layers.Dense(5, activation="softmax", name="predictions")(h)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer=keras.optimizers.RMSprop(learning_rate=1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(),
                  metrics=[keras.metrics.SparseCategoricalAccuracy()])
    sample_weight = np.ones(shape=(n,))
    sample_weight[y == 3] = 2.0
    return ZooCase("digits_sample_weight", "guides/training_with_built_in_methods.py",
                   ("add_loss", "sample_weight", "validation", "dtypes"),
                   model, x, y, _fit_kwargs(sample_weight=sample_weight, validation_split=0.2))


class _NmtPositionalEmbedding(layers.Layer):
    """Token and position embeddings of a variable-length sequence, with a padding mask."""

    def __init__(self, sequence_length: int, vocab_size: int, embed_dim: int,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.token_embeddings = layers.Embedding(vocab_size, embed_dim)
        self.position_embeddings = layers.Embedding(sequence_length, embed_dim)

    def call(self, inputs):
        # The length is the batch's (Input((None,))): the rows looked up depend on the
        # input's shape, not its values, and each is summed over the batch.
        positions = ops.arange(0, ops.shape(inputs)[-1], 1)
        return self.token_embeddings(inputs) + self.position_embeddings(positions)

    def compute_mask(self, inputs, mask=None):
        return ops.not_equal(inputs, 0)


class _NmtEncoder(layers.Layer):
    def __init__(self, embed_dim: int, dense_dim: int, num_heads: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.attention = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.dense_proj = keras.Sequential([layers.Dense(dense_dim, activation="relu"),
                                            layers.Dense(embed_dim)])
        self.layernorm_1 = layers.LayerNormalization()
        self.layernorm_2 = layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, mask=None):
        padding_mask = None if mask is None else ops.cast(mask[:, None, :], dtype="int32")
        attention = self.attention(query=inputs, value=inputs, key=inputs,
                                   attention_mask=padding_mask)
        projected = self.layernorm_1(inputs + attention)
        return self.layernorm_2(projected + self.dense_proj(projected))


class _NmtDecoder(layers.Layer):
    def __init__(self, embed_dim: int, latent_dim: int, num_heads: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.attention_1 = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.attention_2 = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.dense_proj = keras.Sequential([layers.Dense(latent_dim, activation="relu"),
                                            layers.Dense(embed_dim)])
        self.layernorm_1 = layers.LayerNormalization()
        self.layernorm_2 = layers.LayerNormalization()
        self.layernorm_3 = layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, encoder_outputs, mask=None):
        shape = ops.shape(inputs)
        causal = ops.cast(ops.arange(shape[1])[:, None] >= ops.arange(shape[1]), "int32")
        causal = ops.broadcast_to(ops.reshape(causal, (1, shape[1], shape[1])),
                                  (shape[0], shape[1], shape[1]))
        padding_mask = None
        if mask is not None:
            padding_mask = ops.minimum(ops.cast(mask[:, None, :], dtype="int32"), causal)
        a1 = self.attention_1(query=inputs, value=inputs, key=inputs, attention_mask=causal)
        out_1 = self.layernorm_1(inputs + a1)
        a2 = self.attention_2(query=out_1, value=encoder_outputs, key=encoder_outputs,
                              attention_mask=padding_mask)
        out_2 = self.layernorm_2(out_1 + a2)
        return self.layernorm_3(out_2 + self.dense_proj(out_2))


def nmt_transformer() -> ZooCase:
    """English-to-Spanish style encoder-decoder Transformer on variable-length ids.

    Follows examples/nlp/neural_machine_translation_with_transformer.py:
    Input((None,)) int64 ids by name, a position embedding looked up at
    `arange(length)` of the batch, padding masks from `compute_mask`, a causal
    mask, cross-attention, a nested decoder model, Dropout(0.5), softmax over
    the vocabulary, (N, T) sparse targets, RMSprop (which squares each
    gradient: a position embedding's rows must be summed over the batch first).
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(23)
    vocab, seq_len, embed_dim, dense_dim, heads, n = 20, 8, 8, 16, 2, 64
    encoder_inputs = keras.Input(shape=(None,), dtype="int64", name="encoder_inputs")
    h = _NmtPositionalEmbedding(seq_len, vocab, embed_dim)(encoder_inputs)
    encoder_outputs = _NmtEncoder(embed_dim, dense_dim, heads)(h)
    decoder_inputs = keras.Input(shape=(None,), dtype="int64", name="decoder_inputs")
    encoded = keras.Input(shape=(None, embed_dim), name="decoder_state_inputs")
    h = _NmtPositionalEmbedding(seq_len, vocab, embed_dim)(decoder_inputs)
    h = layers.Dropout(0.5)(_NmtDecoder(embed_dim, dense_dim, heads)(h, encoded))
    decoder = keras.Model([decoder_inputs, encoded], layers.Dense(vocab, activation="softmax")(h))
    outputs = decoder([decoder_inputs, encoder_outputs])
    model = keras.Model([encoder_inputs, decoder_inputs], outputs, name="transformer")
    model.compile("rmsprop", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    source = np.zeros((n, seq_len), dtype="int64")
    for i, length in enumerate(rng.integers(2, seq_len + 1, n)):
        source[i, :length] = rng.integers(3, vocab, length)
    target = np.zeros((n, seq_len + 1), dtype="int64")
    for i, length in enumerate(rng.integers(2, seq_len, n)):
        target[i, 0] = 1                                            # [start]
        target[i, 1:length + 1] = (source[i, :length] * 3) % (vocab - 3) + 3
        target[i, length + 1] = 2                                   # [end]
    x = {"encoder_inputs": source, "decoder_inputs": target[:, :-1]}
    return ZooCase("nmt_transformer",
                   "examples/nlp/neural_machine_translation_with_transformer.py",
                   ("dict_inputs", "variable_length", "time_targets", "masking", "random",
                    "dtypes"),
                   model, x, target[:, 1:], _fit_kwargs(batch_size=16),
                   zero_gradient=("key/bias",))


def siamese_contrastive() -> ZooCase:
    """Siamese network with a contrastive loss, its tower normalizing raw pixels.

    Follows examples/vision/siamese_contrastive.py: a shared tower (a model
    used twice per step) whose first layer is BatchNormalization of the
    model's input (nothing trainable before it), Conv2D/AveragePooling,
    BatchNormalization, a Lambda euclidean distance, BatchNormalization of it,
    a closure loss, RMSprop by name, two image inputs, float32 (N,) labels and
    validation data.
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(29)
    n = 64
    digits = rng.integers(0, 4, n)
    base = rng.random((4, 12, 12, 1)).astype("float32")
    x1 = ((base[digits] + 0.3 * rng.random((n, 12, 12, 1))) * 255).astype("float32")
    pair = np.where(rng.random(n) < 0.5, digits, rng.integers(0, 4, n))
    x2 = ((base[pair] + 0.3 * rng.random((n, 12, 12, 1))) * 255).astype("float32")
    y = (pair == digits).astype("float32")

    def euclidean_distance(vectors):
        a, b = vectors
        squares = ops.sum(ops.square(a - b), axis=1, keepdims=True)
        return ops.sqrt(ops.maximum(squares, keras.config.epsilon()))

    def contrastive_loss(y_true, y_pred):
        margin_square = ops.square(ops.maximum(1 - y_pred, 0))
        return ops.mean((1 - y_true) * ops.square(y_pred) + y_true * margin_square)

    tower_input = layers.Input((12, 12, 1))
    h = layers.BatchNormalization()(tower_input)
    h = layers.AveragePooling2D((2, 2))(layers.Conv2D(4, (3, 3), activation="tanh")(h))
    h = layers.BatchNormalization()(layers.Flatten()(h))
    tower = keras.Model(tower_input, layers.Dense(8, activation="tanh")(h))
    input_1, input_2 = layers.Input((12, 12, 1)), layers.Input((12, 12, 1))
    distance = layers.Lambda(euclidean_distance)([tower(input_1), tower(input_2)])
    outputs = layers.Dense(1, activation="sigmoid")(layers.BatchNormalization()(distance))
    model = keras.Model(inputs=[input_1, input_2], outputs=outputs)
    model.compile(loss=contrastive_loss, optimizer="RMSprop", metrics=["accuracy"])
    validation = ([x1[:16][::-1].copy(), x2[:16].copy()], y[:16][::-1].copy())
    return ZooCase("siamese_contrastive", "examples/vision/siamese_contrastive.py",
                   ("batchnorm", "1d_targets", "validation"),
                   model, [x1, x2], y, _fit_kwargs(batch_size=16, validation_data=validation))


def video_gru_masked() -> ZooCase:
    """CNN-RNN video classifier: a boolean frame mask passed to a GRU as an input.

    Follows examples/vision/video_classification.py: per-frame features
    (N, T, F) float32 and a (N, T) bool mask as two inputs, `GRU(16,
    return_sequences=True)(features, mask=mask)`, a second GRU, Dropout(0.4),
    a softmax; labels from StringLookup(num_oov_indices=0), int64 (N, 1);
    `validation_split=0.3`. With a TimeDistributed(Dense) frame projection
    added (the feature extractor's last layer, trained here).
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(31)
    n, max_frames, num_features, num_classes = 80, 6, 8, 3
    labels = rng.integers(0, num_classes, (n, 1))
    lengths = rng.integers(2, max_frames + 1, n)
    masks = np.arange(max_frames)[None, :] < lengths[:, None]
    features = rng.normal(size=(n, max_frames, num_features)).astype("float32")
    features[:, :, 0] += labels                   # the class shows in every frame
    features[~masks] = 0.0                        # padded frames are zeros
    features_input = keras.Input((max_frames, num_features))
    mask_input = keras.Input((max_frames,), dtype="bool")
    h = layers.TimeDistributed(layers.Dense(8, activation="relu"))(features_input)
    h = layers.GRU(16, return_sequences=True)(h, mask=mask_input)
    h = layers.GRU(8)(h)
    h = layers.Dropout(0.4)(h)
    h = layers.Dense(8, activation="relu")(h)
    outputs = layers.Dense(num_classes, activation="softmax")(h)
    model = keras.Model([features_input, mask_input], outputs)
    model.compile(loss="sparse_categorical_crossentropy", optimizer="adam",
                  metrics=["accuracy"])
    return ZooCase("video_gru_masked", "examples/vision/video_classification.py",
                   ("explicit_mask", "rnn", "random", "dtypes", "validation"),
                   model, [features, masks], labels, _fit_kwargs(validation_split=0.3))


def next_frame_conv_lstm() -> ZooCase:
    """Next-frame prediction with stacked ConvLSTM2D layers over a variable number of frames.

    Follows examples/vision/conv_lstm.py: `Input((None, H, W, 1))`, ConvLSTM2D
    (return_sequences, padding "same", relu) + BatchNormalization twice, a
    sigmoid Conv3D, binary cross-entropy against the frames shifted by one:
    targets (N, T, H, W, 1).
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(37)
    n, frames, size = 32, 5, 8
    # A bright square moving one pixel a frame from a random start.
    video = np.zeros((n, frames + 1, size, size, 1), dtype="float32")
    starts = rng.integers(0, size - 3, (n, 2))
    for i, (row, col) in enumerate(starts):
        for t in range(frames + 1):
            c = min(col + t, size - 3)
            video[i, t, row:row + 3, c:c + 3, 0] = 1.0
    video += 0.05 * rng.random(video.shape).astype("float32")
    inputs = keras.Input(shape=(None, size, size, 1))
    h = layers.ConvLSTM2D(4, (3, 3), padding="same", return_sequences=True,
                          activation="relu")(inputs)
    h = layers.BatchNormalization()(h)
    h = layers.ConvLSTM2D(4, (1, 1), padding="same", return_sequences=True,
                          activation="relu")(h)
    h = layers.BatchNormalization()(h)
    outputs = layers.Conv3D(1, (3, 3, 3), activation="sigmoid", padding="same")(h)
    model = keras.Model(inputs, outputs)
    model.compile(loss=keras.losses.binary_crossentropy, optimizer=keras.optimizers.Adam())
    return ZooCase("next_frame_conv_lstm", "examples/vision/conv_lstm.py",
                   ("conv_rnn", "rnn", "batchnorm", "variable_length", "time_targets"),
                   model, video[:, :-1], video[:, 1:], _fit_kwargs(batch_size=8))


class LogisticEndpoint(layers.Layer):
    """Computes its own loss from targets given as a model input, with `add_loss`."""

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name=name)
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def call(self, logits, targets=None, sample_weight=None):
        if targets is not None:
            self.add_loss(self.loss_fn(targets, logits, sample_weight))
        return ops.sigmoid(logits)


def endpoint_layer() -> ZooCase:
    """A loss computed inside the model from targets and weights fed as inputs; `fit(x)` alone.

    Follows examples/keras_recipes/endpoint_layer_pattern.py: inputs, targets
    and sample weights as a dict of three named inputs, a LogisticEndpoint
    layer that adds BinaryCrossentropy(from_logits=True) of them with
    `add_loss` (its weighted mean over the batch), `compile(optimizer)` with
    no loss and `fit(data)` with no `y`; float64 columns as NumPy gives them.
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(41)
    n, width = 96, 12
    features = rng.random((n, width))
    data = {"inputs": features,
            "targets": (features[:, :1] + 0.3 * rng.random((n, 1)) > 0.6).astype("float64"),
            "sample_weight": rng.random((n, 1))}
    inputs = keras.Input((width,), name="inputs")
    targets = keras.Input((1,), name="targets")
    sample_weight = keras.Input((1,), name="sample_weight")
    logits = layers.Dense(1)(layers.Dense(8, activation="relu")(inputs))
    preds = LogisticEndpoint()(logits, targets, sample_weight)
    model = keras.Model([inputs, targets, sample_weight], preds)
    model.compile(keras.optimizers.Adam(1e-2))
    return ZooCase("endpoint_layer", "examples/keras_recipes/endpoint_layer_pattern.py",
                   ("no_targets", "add_loss", "dict_inputs", "dtypes"),
                   model, data, None, _fit_kwargs(batch_size=16))


def mixup_separable() -> ZooCase:
    """Image classifier trained on MixUp pairs: float soft labels, depthwise-separable blocks.

    Follows examples/vision/mixup.py: two shuffled copies of the data mixed
    with a Beta(0.2, 0.2) draw (images and one-hot labels alike), Conv2D and
    MaxPooling, Dropout(0.2), GlobalAveragePooling2D, a softmax and
    categorical cross-entropy on the mixed float labels; with a MobileNet-style
    block (DepthwiseConv2D, GroupNormalization, a pointwise Conv2D and a
    residual), LayerNormalization and label smoothing added.
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(43)
    n, size, num_classes = 64, 10, 4
    labels = rng.integers(0, num_classes, n)
    images = rng.random((n, size, size, 1)).astype("float32")
    images[np.arange(n), labels * 2 + 1, :, 0] += 1.0
    one_hot = keras.utils.to_categorical(labels, num_classes)
    other = rng.permutation(n)
    mix = rng.beta(0.2, 0.2, (n, 1))
    x = mix[:, :, None, None] * images + (1.0 - mix[:, :, None, None]) * images[other]
    y = mix * one_hot + (1.0 - mix) * one_hot[other]
    inputs = keras.Input((size, size, 1))
    h = layers.Conv2D(8, (3, 3), activation="relu")(inputs)
    h = layers.MaxPooling2D((2, 2))(h)
    block = layers.DepthwiseConv2D((3, 3), padding="same", use_bias=False)(h)
    block = layers.GroupNormalization(groups=4)(block)
    block = layers.Activation("gelu")(block)
    h = layers.add([h, layers.Conv2D(8, (1, 1))(block)])
    h = layers.Dropout(0.2)(h)
    h = layers.LayerNormalization()(layers.GlobalAveragePooling2D()(h))
    h = layers.Dense(16, activation="relu")(h)
    outputs = layers.Dense(num_classes, activation="softmax")(h)
    model = keras.Model(inputs, outputs)
    model.compile(loss=keras.losses.CategoricalCrossentropy(label_smoothing=0.1),
                  optimizer="adam", metrics=["accuracy"])
    return ZooCase("mixup_separable", "examples/vision/mixup.py",
                   ("soft_labels", "random", "dtypes"),
                   model, x, y, _fit_kwargs(batch_size=16))


def oxford_pets_unet() -> ZooCase:
    """U-Net-like segmentation: a class per pixel, upsampled by transposed convolutions.

    Follows examples/vision/oxford_pets_image_segmentation.py: a strided Conv2D
    stem, a downsampling block (SeparableConv2D, BatchNormalization,
    MaxPooling2D and a strided 1x1 residual), upsampling blocks
    (Conv2DTranspose, BatchNormalization, UpSampling2D and an upsampled 1x1
    residual), a per-pixel softmax over 3 classes; uint8 masks (N, H, W, 1)
    with sparse categorical cross-entropy, training and validation as
    `tf.data.Dataset`s of (image, mask) batches. The images are in [0, 1]
    (the example feeds 0-255: its first batch statistics, ~1e3, agree to
    float32's relative 1e-7, more than the zoo's absolute 1e-5).
    """
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(47)
    n, size, num_classes = 48, 16, 3
    masks = np.zeros((n, size, size, 1), dtype="uint8")   # 0 background, 1 pet, 2 outline
    images = rng.random((n, size, size, 3)).astype("float32") * 0.3
    for i, (row, col) in enumerate(rng.integers(2, 9, (n, 2))):
        masks[i, row - 1:row + 7, col - 1:col + 7, 0] = 2
        masks[i, row:row + 6, col:col + 6, 0] = 1
        images[i, row:row + 6, col:col + 6, i % 3] += 0.6
    inputs = keras.Input(shape=(size, size, 3))
    h = _xception_entry(inputs)
    previous = h
    for filters in (8, 4):
        for _ in range(2):
            h = layers.Activation("relu")(h)
            h = layers.Conv2DTranspose(filters, 3, padding="same", use_bias=False)(h)
            h = layers.BatchNormalization()(h)
        h = layers.UpSampling2D(2)(h)
        residual = layers.Conv2D(filters, 1, padding="same")(layers.UpSampling2D(2)(previous))
        h = layers.add([h, residual])
        previous = h
    outputs = layers.Conv2D(num_classes, 3, activation="softmax", padding="same")(h)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy")
    train = tf.data.Dataset.from_tensor_slices((images[:40], masks[:40])).batch(8)
    validation = tf.data.Dataset.from_tensor_slices((images[40:], masks[40:])).batch(8)
    return ZooCase("oxford_pets_unet", "examples/vision/oxford_pets_image_segmentation.py",
                   ("dataset", "batchnorm", "time_targets", "dtypes", "validation"),
                   model, train, None, _fit_kwargs(batch_size=8, validation_data=validation))


class StochasticDepth(layers.Layer):
    """Drops a residual branch for whole examples in training (keras.random, its own seed)."""

    def __init__(self, drop_prob: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.drop_prob = drop_prob
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, x, training=None):
        if training:
            keep_prob = 1 - self.drop_prob
            shape = (ops.shape(x)[0],) + (1,) * (len(x.shape) - 1)
            random_tensor = keep_prob + keras.random.uniform(shape, 0, 1,
                                                             seed=self.seed_generator)
            return (x / keep_prob) * ops.floor(random_tensor)
        return x


class CCTTokenizer(layers.Layer):
    """Convolutions and poolings whose feature map's positions become the tokens."""

    def __init__(self, channels: tuple[int, ...] = (8, 8), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.conv_model = keras.Sequential()
        for width in channels:
            self.conv_model.add(layers.Conv2D(width, 3, 1, padding="valid", use_bias=False,
                                              activation="relu", kernel_initializer="he_normal"))
            self.conv_model.add(layers.ZeroPadding2D(1))
            self.conv_model.add(layers.MaxPooling2D(3, 2, "same"))

    def call(self, images):
        outputs = self.conv_model(images)
        return ops.reshape(outputs, (-1, ops.shape(outputs)[1] * ops.shape(outputs)[2],
                                     ops.shape(outputs)[-1]))


class SequencePooling(layers.Layer):
    """A softmax-weighted mean of the tokens (CCT's attention pooling)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.attention = layers.Dense(1, name="attention_logits")

    def call(self, x):
        weights = ops.transpose(ops.softmax(self.attention(x), axis=1), axes=(0, 2, 1))
        return ops.squeeze(ops.matmul(weights, x), -2)


def cct_stochastic_depth() -> ZooCase:
    """Compact Convolutional Transformer: a custom random layer with a `training` argument.

    Follows examples/vision/cct.py: uint8 images, Rescaling, RandomCrop (to
    the image's size, as the example) and RandomFlip, a convolutional
    tokenizer, a position embedding, transformer layers whose residual
    branches go through StochasticDepth (`keras.random.uniform` of shape
    (batch, 1, 1) from its own SeedGenerator when `training`), attention
    pooling over the tokens, one-hot labels with label smoothing, AdamW,
    top-k accuracy and `validation_split`.
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(53)
    n, size, num_classes, dim = 80, 8, 4, 8
    labels = rng.integers(0, num_classes, (n, 1))
    x = rng.integers(0, 120, (n, size, size, 3)).astype("uint8")
    x[:, :, :, 0] += (labels[:, 0] * 40).astype("uint8")[:, None, None]
    y = keras.utils.to_categorical(labels, num_classes)
    augmentation = keras.Sequential([layers.Rescaling(1.0 / 255), layers.RandomCrop(size, size),
                                     layers.RandomFlip("horizontal")], name="data_augmentation")
    inputs = layers.Input((size, size, 3))
    encoded = CCTTokenizer()(augmentation(inputs))
    length = encoded.shape[1]
    encoded = encoded + layers.Embedding(length, dim)(ops.arange(0, length, 1))
    for rate in np.linspace(0, 0.3, 2):
        x1 = layers.LayerNormalization(epsilon=1e-5)(encoded)
        attention = layers.MultiHeadAttention(num_heads=2, key_dim=dim, dropout=0.1)(x1, x1)
        x2 = layers.Add()([StochasticDepth(float(rate))(attention), encoded])
        x3 = _mlp(layers.LayerNormalization(epsilon=1e-5)(x2), (dim, dim), 0.1)
        encoded = layers.Add()([StochasticDepth(float(rate))(x3), x2])
    representation = layers.LayerNormalization(epsilon=1e-5)(encoded)
    logits = layers.Dense(num_classes)(SequencePooling()(representation))
    model = keras.Model(inputs, logits)
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate=0.001, weight_decay=0.0001),
                  loss=keras.losses.CategoricalCrossentropy(from_logits=True,
                                                            label_smoothing=0.1),
                  metrics=[keras.metrics.CategoricalAccuracy(name="accuracy"),
                           keras.metrics.TopKCategoricalAccuracy(3, name="top-3-accuracy")])
    # The pooling logits' bias, as an attention key's, shifts every token's logit alike.
    return ZooCase("cct_stochastic_depth", "examples/vision/cct.py",
                   ("random", "subclassed", "dtypes", "soft_labels", "validation"),
                   model, x, y, _fit_kwargs(batch_size=16, validation_split=0.1),
                   zero_gradient=("key/bias", "attention_logits/bias"))


def _mbconv(h, filters: int, expand: int, drop_rate: float, name: str):
    """EfficientNet's inverted residual block with squeeze-and-excitation."""
    inputs, width = h, h.shape[-1] * expand
    h = layers.Conv2D(width, 1, padding="same", use_bias=False, name=f"{name}expand_conv")(h)
    h = layers.Activation("swish")(layers.BatchNormalization(name=f"{name}expand_bn")(h))
    h = layers.DepthwiseConv2D(3, padding="same", use_bias=False, name=f"{name}dwconv")(h)
    h = layers.Activation("swish")(layers.BatchNormalization(name=f"{name}bn")(h))
    se = layers.Reshape((1, 1, width))(layers.GlobalAveragePooling2D(name=f"{name}se_squeeze")(h))
    se = layers.Conv2D(max(1, width // 4), 1, activation="swish", name=f"{name}se_reduce")(se)
    se = layers.Conv2D(width, 1, activation="sigmoid", name=f"{name}se_expand")(se)
    h = layers.multiply([h, se])
    h = layers.Conv2D(filters, 1, padding="same", use_bias=False, name=f"{name}project_conv")(h)
    h = layers.BatchNormalization(name=f"{name}project_bn")(h)
    # Drop connect: one draw per example (noise_shape), as keras.applications' EfficientNet.
    h = layers.Dropout(drop_rate, noise_shape=(None, 1, 1, 1), name=f"{name}drop")(h)
    return layers.add([h, inputs])


def efficientnet_se() -> ZooCase:
    """EfficientNet-style classifier trained from scratch with augmentation in the model.

    Follows examples/vision/image_classification_efficientnet_fine_tuning.py
    ("training from scratch"): RandomRotation, RandomTranslation, RandomFlip
    and RandomContrast, then keras.applications' EfficientNet scaled down to
    a stem and two MBConv blocks (Rescaling and a fixed Normalization, 1x1
    expansion, DepthwiseConv2D, BatchNormalization, swish, squeeze-and-
    excitation, drop connect as `Dropout(noise_shape=(None, 1, 1, 1))`), top
    dropout, one-hot labels.
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(67)
    n, size, num_classes = 64, 12, 3
    labels = rng.integers(0, num_classes, n)
    x = rng.integers(0, 200, (n, size, size, 3)).astype("float32")
    x[np.arange(n), 2:10, 2:10, labels] += 55.0
    y = keras.utils.to_categorical(labels, num_classes)
    inputs = keras.Input((size, size, 3))
    h = inputs
    for layer in (layers.RandomRotation(factor=0.15),
                  layers.RandomTranslation(height_factor=0.1, width_factor=0.1),
                  layers.RandomFlip(), layers.RandomContrast(factor=0.1)):
        h = layer(h)
    h = layers.Rescaling(1.0 / 255.0)(h)
    h = layers.Normalization(mean=[0.485, 0.456, 0.406],
                             variance=[0.229 ** 2, 0.224 ** 2, 0.225 ** 2])(h)
    h = layers.Conv2D(8, 3, strides=2, padding="same", use_bias=False, name="stem_conv")(h)
    h = layers.Activation("swish")(layers.BatchNormalization(name="stem_bn")(h))
    h = _mbconv(h, 8, 1, 0.2, "block1a_")
    h = _mbconv(h, 8, 2, 0.2, "block2a_")
    h = layers.Dropout(0.2, name="top_dropout")(layers.GlobalAveragePooling2D(name="avg_pool")(h))
    outputs = layers.Dense(num_classes, activation="softmax", name="pred")(h)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="categorical_crossentropy", metrics=["accuracy"])
    return ZooCase("efficientnet_se",
                   "examples/vision/image_classification_efficientnet_fine_tuning.py",
                   ("random", "batchnorm", "preprocessing"),
                   model, x, y, _fit_kwargs(batch_size=16))


class TemporalSoftmax(layers.Layer):
    """A softmax over the timesteps its input's mask keeps."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.supports_masking = True

    def call(self, inputs, mask=None):
        broadcast_float_mask = ops.expand_dims(ops.cast(mask, "float32"), -1)
        inputs_exp = ops.exp(inputs) * broadcast_float_mask
        inputs_sum = ops.sum(inputs_exp * broadcast_float_mask, axis=1, keepdims=True)
        return inputs_exp / inputs_sum


def masking_and_padding() -> ZooCase:
    """Masks made, carried and consumed: Embedding(mask_zero=True), Masking, a custom layer.

    Follows guides/understanding_masking_and_padding.py: zero-padded ids of
    any length through Embedding(mask_zero=True) into a GRU (here with
    `return_state=True`), its TemporalSoftmax (a custom layer reading the
    mask) weighting the GRU's outputs, GlobalAveragePooling1D over the
    unmasked steps, and a Masking layer on zero-padded float readings into an
    LSTM; dict inputs by name, 1-D targets.
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(61)
    n, maxlen, vocab, steps = 80, 10, 20, 6
    ids = _padded(rng, n, maxlen, vocab)
    readings = rng.normal(size=(n, steps, 3)).astype("float32")
    readings[np.arange(steps)[None, :] >= rng.integers(2, steps + 1, n)[:, None]] = 0.0
    y = ((ids == 3).any(axis=1) | (readings[:, 0, 0] > 1.0)).astype("float32")
    ids_input = keras.Input((None,), dtype="int32", name="ids")
    readings_input = keras.Input((steps, 3), name="readings")
    embedded = layers.Embedding(vocab, 8, mask_zero=True)(ids_input)
    sequence, state = layers.GRU(8, return_sequences=True, return_state=True)(embedded)
    weights = TemporalSoftmax()(layers.Dense(1)(sequence))
    attended = ops.sum(weights * sequence, axis=1)
    pooled = layers.GlobalAveragePooling1D()(sequence)
    read = layers.LSTM(4)(layers.Masking(mask_value=0.0)(readings_input))
    outputs = layers.Dense(1, activation="sigmoid")(
        layers.concatenate([attended, pooled, state, read]))
    model = keras.Model({"ids": ids_input, "readings": readings_input}, outputs)
    model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
    return ZooCase("masking_and_padding", "guides/understanding_masking_and_padding.py",
                   ("masking", "rnn", "dict_inputs", "variable_length", "1d_targets"),
                   model, {"ids": ids, "readings": readings}, y, _fit_kwargs(batch_size=16))


def feature_space_heart() -> ZooCase:
    """Heart-disease classifier on a dataset encoded by a FeatureSpace adapted on it.

    Follows examples/structured_data/structured_data_classification_with_feature_space.py:
    a `tf.data.Dataset` of (dict of columns, label), shuffled (here with a
    seed: unseeded, autodist refuses it), batched; a FeatureSpace (integer
    and string categoricals, a discretized and normalized floats, a feature
    cross, concatenated) adapted on that dataset (12 passes over it before
    fit), then mapped over it with `num_parallel_calls=AUTOTUNE` and
    prefetched; the training model takes the encoded features: Dense,
    Dropout(0.5), a sigmoid.
    """
    import tensorflow as tf
    from keras.utils import FeatureSpace

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(71)
    n = 96
    columns = {"sex": rng.integers(0, 2, n), "cp": rng.integers(0, 5, n),
               "thal": rng.choice(np.array(["fixed", "normal", "reversible"], dtype=object), n),
               "age": rng.integers(29, 78, n), "chol": rng.normal(245.0, 50.0, n),
               "oldpeak": rng.uniform(0.0, 4.0, n)}
    labels = ((columns["age"] > 55) ^ (rng.random(n) < 0.2)).astype("int64")
    feature_space = FeatureSpace(
        features={"sex": FeatureSpace.integer_categorical(num_oov_indices=0),
                  "cp": FeatureSpace.integer_categorical(num_oov_indices=0),
                  "thal": FeatureSpace.string_categorical(num_oov_indices=0),
                  "age": FeatureSpace.float_discretized(num_bins=4),
                  "chol": FeatureSpace.float_normalized(),
                  "oldpeak": FeatureSpace.float_normalized()},
        crosses=[FeatureSpace.cross(feature_names=("sex", "age"), crossing_dim=8)],
        output_mode="concat")
    train_ds = tf.data.Dataset.from_tensor_slices((dict(columns), labels))
    train_ds = train_ds.shuffle(buffer_size=n, seed=1).batch(16)
    feature_space.adapt(train_ds.map(lambda x, _: x))
    preprocessed = train_ds.map(lambda x, y: (feature_space(x), y),
                                num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)
    encoded_features = feature_space.get_encoded_features()
    h = layers.Dropout(0.5)(layers.Dense(8, activation="relu")(encoded_features))
    predictions = layers.Dense(1, activation="sigmoid")(h)
    model = keras.Model(inputs=encoded_features, outputs=predictions)
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    return ZooCase("feature_space_heart",
                   "examples/structured_data/structured_data_classification_with_feature_space.py",
                   ("dataset", "preprocessing", "random", "1d_targets"),
                   model, preprocessed, None, _fit_kwargs(batch_size=16))


def addition_rnn() -> ZooCase:
    """Sequence-to-sequence addition: one-hot questions in, one-hot answers out, as bools.

    Follows examples/nlp/addition_rnn.py: questions like "12+34" and their
    sums as one-hot *boolean* arrays (x (N, T, chars), y (N, digits + 1,
    chars), `dtype=bool` as the example builds them), an encoder LSTM given
    `input_shape`, RepeatVector, a decoder LSTM returning sequences and a
    softmax Dense over the characters; categorical cross-entropy on the bool
    targets, Adam, accuracy, and a held-out `validation_data`.
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(29)
    chars, digits = "0123456789+ ", 2
    maxlen = 2 * digits + 1
    table = {c: i for i, c in enumerate(chars)}

    def one_hot(texts: list[str], length: int) -> np.ndarray:
        out = np.zeros((len(texts), length, len(chars)), dtype=bool)
        for i, text in enumerate(texts):
            for t, c in enumerate(text):
                out[i, t, table[c]] = True
        return out

    a, b = rng.integers(0, 10 ** digits, 72), rng.integers(0, 10 ** digits, 72)
    questions = [f"{p}+{q}".ljust(maxlen)[::-1] for p, q in zip(a, b)]  # reversed, as there
    answers = [str(p + q).ljust(digits + 1) for p, q in zip(a, b)]
    x, y = one_hot(questions, maxlen), one_hot(answers, digits + 1)
    model = keras.Sequential([
        layers.LSTM(8, input_shape=(maxlen, len(chars))),
        layers.RepeatVector(digits + 1),
        layers.LSTM(8, return_sequences=True),
        layers.Dense(len(chars), activation="softmax"),
    ])
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    return ZooCase("addition_rnn", "examples/nlp/addition_rnn.py",
                   ("rnn", "dtypes", "time_targets", "validation"),
                   model, x[:64], y[:64], _fit_kwargs(validation_data=(x[64:], y[64:])))


ZOO: dict[str, Callable[[], ZooCase]] = {builder.__name__: builder for builder in (
    heart_disease, census_deep_cross, movielens_recommender, text_cnn_strings,
    imdb_bidirectional_lstm, imdb_masked_lstm, ticket_triage, char_gpt, lstm_seq2seq,
    ecg_fcn, anomaly_autoencoder, weather_lstm, mnist_convnet, augmented_xception,
    vision_transformer, transformer_text_mixed, fraud_class_weight, digits_sample_weight,
    nmt_transformer, siamese_contrastive, video_gru_masked, next_frame_conv_lstm,
    endpoint_layer, mixup_separable, oxford_pets_unet, cct_stochastic_depth, efficientnet_se,
    masking_and_padding, feature_space_heart, addition_rnn)}


def variable_values(model: keras.Model) -> list[np.ndarray]:
    """Every variable of `model` (trainable, state and seed generators), in order."""
    return [np.asarray(v.numpy()) for v in model.variables]


def assert_same_variables(a: keras.Model, b: keras.Model) -> None:
    """`a` and `b` hold the same variables: count, shapes, dtypes and bitwise values."""
    va, vb = a.variables, b.variables
    assert len(va) == len(vb), f"{len(va)} variables vs {len(vb)}"
    for x, y in zip(va, vb):
        assert (tuple(x.shape), x.dtype) == (tuple(y.shape), y.dtype), f"{x.path} vs {y.path}"
        assert np.array_equal(np.asarray(x.numpy()), np.asarray(y.numpy())), \
            f"{x.path} differs from {y.path}"


def keras_reference(case: ZooCase) -> tuple[list[np.ndarray], dict[str, list[float]]]:
    """The weights and History single-device Keras `fit` gives from the case's start.

    Builds an independent twin with the case's builder (its initial weights
    and seed-generator states equal `case.model`'s, which is checked) and
    fits it on `case.x`, `case.y` with `case.fit_kwargs`; Keras' own
    shuffling draws from the global seed, set first.

    Returns:
        Every variable of the trained twin (`model.variables` order) and
        `history.history`.
    """
    twin = ZOO[case.name]().model
    assert_same_variables(case.model, twin)
    keras.utils.set_random_seed(0)
    history = twin.fit(case.x, case.y, **case.fit_kwargs, verbose=0)
    return variable_values(twin), history.history
