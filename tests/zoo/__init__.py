"""A zoo of small real-world Keras models (after the keras-io examples) and their Keras references."""
