"""The thin public surface that ties the layers together."""
from __future__ import annotations

from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.runtime.run import DistributedRun


def distribute(model, strategy: Strategy, resource_spec: ResourceSpec, *,
               graph_item: GraphItem | None = None, **options) -> DistributedRun:
    """Prepares `model` to train with `strategy` on `resource_spec`.

    Args:
        model: A compiled Keras 3 model.
        strategy: From a builder, a file, or the search.
        resource_spec: The cluster.
        graph_item: The model's capture, if already made.
        **options: Passed to `DistributedRun` (job_dir, step_timeout_s, launch, ...).
            `launch="remote"` runs on a multi-host cluster whose other tasks
            already run `autodist serve` (see the README, "Multi-host /
            Kubernetes").

    Returns:
        A DistributedRun; call `.fit(x, y, batch_size=..., epochs=...)`.

    Example:
        >>> spec = autodist.ResourceSpec.local(workers=2, ps=1)     # doctest: +SKIP
        >>> s = autodist.builders.PS().build(autodist.capture(model), spec)
        >>> history = autodist.distribute(model, s, spec).fit(x, y, batch_size=64)
        >>> # On the chief's pod of a TF operator job (other pods: `autodist serve --tf-config`):
        >>> spec = autodist.ResourceSpec.from_tf_config()
        >>> run = autodist.distribute(model, s, spec, launch="remote")
    """
    return DistributedRun(model, strategy, resource_spec, graph_item=graph_item, **options)
