"""Models overriding `train_step` as keras-io's examples do, small: the VAE
(examples/generative/vae.py) and model 3 of the guide "customizing what happens in
fit" (compute_loss, sample weights from `len(data)`, compiled metrics)."""
from __future__ import annotations

IMAGE = (4, 4, 1)
LATENT = 2


def vae_model(optimizer=None):
    """keras-io's VAE on 4x4 images: an encoder with a Sampling layer drawing from a
    SeedGenerator, a decoder, three Mean trackers and a KL term; Adam(0.01) unless
    `optimizer` is given."""
    import keras
    import tensorflow as tf
    from keras import layers, ops

    class Sampling(layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.seed_generator = keras.random.SeedGenerator(1337)

        def call(self, inputs):
            z_mean, z_log_var = inputs
            batch = ops.shape(z_mean)[0]
            dim = ops.shape(z_mean)[1]
            epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
            return z_mean + ops.exp(0.5 * z_log_var) * epsilon

    class VAE(keras.Model):
        def __init__(self, encoder, decoder, **kwargs):
            super().__init__(**kwargs)
            self.encoder = encoder
            self.decoder = decoder
            self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
            self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
            self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

        @property
        def metrics(self):
            return [self.total_loss_tracker, self.reconstruction_loss_tracker,
                    self.kl_loss_tracker]

        def train_step(self, data):
            with tf.GradientTape() as tape:
                z_mean, z_log_var, z = self.encoder(data)
                reconstruction = self.decoder(z)
                reconstruction_loss = ops.mean(ops.sum(
                    keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2)))
                kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
                kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
                total_loss = reconstruction_loss + kl_loss
            grads = tape.gradient(total_loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
            self.total_loss_tracker.update_state(total_loss)
            self.reconstruction_loss_tracker.update_state(reconstruction_loss)
            self.kl_loss_tracker.update_state(kl_loss)
            return {"loss": self.total_loss_tracker.result(),
                    "reconstruction_loss": self.reconstruction_loss_tracker.result(),
                    "kl_loss": self.kl_loss_tracker.result()}

    encoder_inputs = keras.Input(IMAGE)
    h = layers.Dense(6, activation="relu")(layers.Flatten()(encoder_inputs))
    z_mean = layers.Dense(LATENT, name="z_mean")(h)
    z_log_var = layers.Dense(LATENT, name="z_log_var")(h)
    encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, Sampling()([z_mean, z_log_var])],
                          name="encoder")
    latent_inputs = keras.Input((LATENT,))
    h = layers.Dense(6, activation="relu")(latent_inputs)
    decoded = layers.Reshape(IMAGE)(layers.Dense(16, activation="sigmoid")(h))
    decoder = keras.Model(latent_inputs, decoded, name="decoder")
    vae = VAE(encoder, decoder, name="vae")
    vae.compile(optimizer=optimizer or keras.optimizers.Adam(0.01))
    return vae


def guide_model_3(optimizer=None):
    """The guide's model 3: compute_loss with the sample weights of `len(data) == 3`,
    the loss and compiled metrics updated in the step; mse, mae, Adam(0.01) unless
    `optimizer` is given."""
    import keras
    import tensorflow as tf

    class CustomModel(keras.Model):
        def train_step(self, data):
            if len(data) == 3:
                x, y, sample_weight = data
            else:
                sample_weight = None
                x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
            trainable_vars = self.trainable_variables
            gradients = tape.gradient(loss, trainable_vars)
            self.optimizer.apply(gradients, trainable_vars)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred, sample_weight=sample_weight)
            return {m.name: m.result() for m in self.metrics}

    inputs = keras.Input(shape=(5,))
    hidden = keras.layers.Dense(4, activation="tanh")(inputs)
    model = CustomModel(inputs, keras.layers.Dense(1)(hidden), name="custom_model")
    model.compile(optimizer=optimizer or keras.optimizers.Adam(0.01), loss="mse",
                  metrics=["mae"])
    return model


def simsiam_model(optimizer=None):
    """keras-io's SimSiam, small: an encoder with batch normalization (in training mode)
    called on two views (fit's x and y, as a zip of two datasets gives them), a
    predictor, the negative cosine similarity against the other view's stopped
    encoding, a Mean tracker; SGD(0.05, momentum 0.9) unless `optimizer` is given."""
    import keras
    import tensorflow as tf
    from keras import layers

    def negative_cosine(p, z):
        z = tf.stop_gradient(z)
        p = tf.math.l2_normalize(p, axis=1)
        z = tf.math.l2_normalize(z, axis=1)
        return -tf.reduce_mean(tf.reduce_sum(p * z, axis=1))

    class SimSiam(keras.Model):
        def __init__(self, encoder, predictor, **kwargs):
            super().__init__(**kwargs)
            self.encoder, self.predictor = encoder, predictor
            self.loss_tracker = keras.metrics.Mean(name="loss")

        @property
        def metrics(self):
            return [self.loss_tracker]

        def train_step(self, data):
            ds_one, ds_two = data
            with tf.GradientTape() as tape:
                z1 = self.encoder(ds_one, training=True)
                z2 = self.encoder(ds_two, training=True)
                p1, p2 = self.predictor(z1), self.predictor(z2)
                loss = negative_cosine(p1, z2) / 2 + negative_cosine(p2, z1) / 2
            params = self.encoder.trainable_variables + self.predictor.trainable_variables
            self.optimizer.apply_gradients(zip(tape.gradient(loss, params), params))
            self.loss_tracker.update_state(loss)
            return {"loss": self.loss_tracker.result()}

    inputs = keras.Input((6,))
    h = layers.ReLU()(layers.BatchNormalization()(layers.Dense(8, use_bias=False)(inputs)))
    encoder = keras.Model(inputs, layers.Dense(4)(h), name="encoder")
    latent = keras.Input((4,))
    predictor = keras.Model(latent, layers.Dense(4)(layers.Dense(3, activation="relu")(latent)),
                            name="predictor")
    model = SimSiam(encoder, predictor, name="simsiam")
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.05, momentum=0.9))
    return model
