"""Strategy search: builders (named presets), and later the space, cost model and tuner."""
