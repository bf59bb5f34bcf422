"""Measures strategies on a real local cluster: the runtime's search `Runner`."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from autodist.ir.errors import AutodistError
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.runtime.run import DistributedRun


class LocalTrialRunner:
    """Trains a few steps of the model with a strategy and reports step times.

    The model's weights are restored after every trial, so measuring never
    changes the user's model. Each trial launches its own cluster.

    Args:
        model: The compiled Keras model.
        resource_spec: The (local) cluster to measure on.
        x, y: Data for the trial steps (default: synthetic data shaped for
            the model).
        batch_size: Global batch size.
        steps: Steps timed after warm-up.
        warmup_steps: Steps run first and not timed.
        graph_item: The model's capture, if already made.
        timeout_s: Bound on one trial.
        allow_exposed: See `DistributedRun`: where no private network
            namespace can be made, run the trial clusters reachable.
    """

    def __init__(self, model, resource_spec: ResourceSpec, *, x: Any = None, y: Any = None,
                 batch_size: int = 64, steps: int = 10, warmup_steps: int = 3,
                 graph_item: GraphItem | None = None, timeout_s: float = 300.0,
                 allow_exposed: bool = False) -> None:
        if steps < 1 or warmup_steps < 0:
            raise AutodistError(f"steps must be >= 1 and warmup_steps >= 0. Received: "
                                f"steps={steps!r}, warmup_steps={warmup_steps!r}")
        self.model = model
        self.resource_spec = resource_spec
        self.batch_size = batch_size
        self.steps = steps
        self.warmup_steps = warmup_steps
        self.graph_item = graph_item
        self.timeout_s = timeout_s
        self.allow_exposed = allow_exposed
        if x is None:
            from autodist.models import synthetic_data  # pylint: disable=C0415

            x, y = synthetic_data(model, batch_size * (steps + warmup_steps))
        self.x, self.y = x, y

    def measure(self, strategy: Strategy) -> Sequence[float]:
        """Step times (seconds) of the timed steps; raises if the trial fails."""
        weights = [np.array(w) for w in self.model.get_weights()]
        try:
            run = DistributedRun(self.model, strategy, self.resource_spec,
                                 graph_item=self.graph_item, allow_exposed=self.allow_exposed)
            self.graph_item = run.graph_item
            history = run.fit(self.x, self.y, batch_size=self.batch_size, epochs=1,
                              steps_per_epoch=self.steps + self.warmup_steps, verbose=0,
                              timeout_s=self.timeout_s)
        finally:
            self.model.set_weights(weights)
        return list(history.step_times[self.warmup_steps:])
