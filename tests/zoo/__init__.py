"""A zoo of small real-world Keras models (after keras-io examples) and their references."""
