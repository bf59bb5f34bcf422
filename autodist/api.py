"""The thin public surface that ties the layers together."""
from __future__ import annotations

import inspect
import os
import warnings
from typing import TYPE_CHECKING, Any

from autodist.ir.errors import InvalidArgumentError
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.runtime.compile_state import CompileState
from autodist.runtime.run import LAUNCH_MODES, DistributedRun

if TYPE_CHECKING:  # pragma: no cover - types only
    from matplotlib.figure import Figure


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=3)


def _run_option_names() -> frozenset[str]:
    """The options of `DistributedRun` itself (job_dir, launch, secret_file, ...).

    Read from its signature, so that `Plan.fit` passes on every one of them,
    whatever the run gains.
    """
    parameters = inspect.signature(DistributedRun.__init__).parameters
    return frozenset(name for name, p in parameters.items()
                     if p.kind is p.KEYWORD_ONLY and name != "graph_item")


def distribute(model, strategy: Strategy, resource_spec: ResourceSpec, *,
               graph_item: GraphItem | None = None, x=None, y=None,
               **options) -> DistributedRun:
    """Prepares `model` to train with `strategy` on `resource_spec`.

    Args:
        model: A compiled Keras 3 model.
        strategy: From a builder, a file, or the search.
        resource_spec: The cluster.
        graph_item: The model's capture, if already made.
        x, y: Example inputs and targets for capturing the model where it
            needs them (a subclassed model; several outputs), as in
            `capture(model, x=..., y=...)`. Ignored with `graph_item`.
        **options: Passed to `DistributedRun` (job_dir, step_timeout_s, launch,
            allow_exposed, secret_file, ...). `launch="remote"` runs on a
            multi-host cluster whose other tasks already run `autodist serve`
            (see docs/multihost.md).

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
    if graph_item is None and (x is not None or y is not None):
        from autodist.ir.capture import capture

        graph_item = capture(model, x=x, y=y)
    return DistributedRun(model, strategy, resource_spec, graph_item=graph_item, **options)


class Plan:
    """What `optimize` found: a strategy for a model on a cluster, ready to train.

    Attributes:
        model: The user's Keras model (trained weights return to it).
        graph_item: Its capture.
        strategy: The chosen Strategy (export it with `strategy.save(path)`).
        resource_spec: The cluster it is for.
        predicted_step_time_s: Predicted seconds per step.
        lower_bound_step_time_s: The simulator's lower bound (seconds).
        builder_step_times_s: Builder name → predicted seconds per step.
        trials: Measured trials (`StrategyTrial`s, with `measure=True`).
        search_time_s: Seconds the search took.
        builder_errors: Builder name → why it could not build a strategy for
            this model and cluster (such builders were no candidates).
        allow_exposed: `fit`'s default for the `DistributedRun` option (as
            given to `optimize`).
        launch, secret_file: `fit`'s defaults for these `DistributedRun`
            options (as given to `optimize`): a plan measured on served
            hosts trains there.
        batch_size: The global batch the plan is for (None: the search's
            default, the capture's estimate batch per replica).
    """

    def __init__(self, model, graph_item: GraphItem, resource_spec: ResourceSpec,
                 result, allow_exposed: bool = False, batch_size: int | None = None,
                 launch: str = "local", secret_file: str | None = None) -> None:
        self.model = model
        self._compiled = CompileState(model)
        self.batch_size = batch_size
        self.allow_exposed = allow_exposed
        self.launch = launch
        self.secret_file = secret_file
        self.graph_item = graph_item
        self.resource_spec = resource_spec
        self.strategy: Strategy = result.strategy
        self.predicted_step_time_s: float = result.predicted_step_time_s
        self.lower_bound_step_time_s: float = result.lower_bound_s
        self.builder_step_times_s: dict[str, float] = result.builder_step_times_s
        self.trials = result.trials
        self.search_time_s: float = result.elapsed_s
        self.candidates_scored: int = result.candidates_scored
        self.builder_errors: dict[str, str] = dict(result.builder_errors)
        self._explanation = result.explanation

    # The names before the unit suffix: deprecated.
    @property
    def predicted_step_time(self) -> float:
        """Deprecated: `predicted_step_time_s`."""
        _deprecated("Plan.predicted_step_time", "Plan.predicted_step_time_s")
        return self.predicted_step_time_s

    @property
    def lower_bound_step_time(self) -> float:
        """Deprecated: `lower_bound_step_time_s`."""
        _deprecated("Plan.lower_bound_step_time", "Plan.lower_bound_step_time_s")
        return self.lower_bound_step_time_s

    @property
    def builder_step_times(self) -> dict[str, float]:
        """Deprecated: `builder_step_times_s`."""
        _deprecated("Plan.builder_step_times", "Plan.builder_step_times_s")
        return self.builder_step_times_s

    @property
    def search_time(self) -> float:
        """Deprecated: `search_time_s`."""
        _deprecated("Plan.search_time", "Plan.search_time_s")
        return self.search_time_s

    def explain(self) -> str:
        """Per variable: the choice and why; and the predicted time of every builder."""
        return self._explanation

    def plot(self, path: str | os.PathLike | None = None, **options: Any) -> Figure:
        """Draws the plan's strategy: who holds what, and the bytes per step per link.

        One figure (`autodist.plotting.plot_strategy`): per device the
        variables and shards it holds, coloured by synchronizer, and each
        node's bytes in and out per step as the search's simulator counts
        them at the plan's batch. Needs matplotlib (the `plot` extra).

        Args:
            path: Save the figure there (PNG, SVG, PDF: by the suffix).
            **options: Passed to `plot_strategy` (e.g. `max_variables`).

        Returns:
            The matplotlib Figure (a notebook displays it).

        Example:
            >>> plan = autodist.optimize(model)      # doctest: +SKIP
            >>> plan.plot("plan.png")                # doctest: +SKIP
        """
        from autodist.plotting import plot_strategy

        options.setdefault("batch_size", self.batch_size)
        return plot_strategy(self.strategy, self.graph_item, self.resource_spec, path=path,
                             **options)

    def fit(self, *args: Any, **kwargs: Any):
        """Trains with the plan's strategy: `distribute(...).fit(*args, **kwargs)`.

        Every option of `DistributedRun` (job_dir, step_timeout_s,
        startup_timeout_s, launch, allow_exposed, secret_file, ...) may be
        given here too and goes to the run; the rest go to
        `DistributedRun.fit`. allow_exposed, launch and secret_file default
        to `optimize`'s.

        Returns:
            The run's `History`.

        Raises:
            ModelChangedError: the model was compiled again, or its trainable
                variables changed, since `optimize` captured it: call
                `optimize(model)` again for a plan of the model as it is.
        """
        self._compiled.check(self.model, "autodist.optimize")
        names = _run_option_names()
        run_options = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        run_options.setdefault("allow_exposed", self.allow_exposed)
        run_options.setdefault("launch", self.launch)
        if self.secret_file is not None:
            run_options.setdefault("secret_file", self.secret_file)
        return distribute(self.model, self.strategy, self.resource_spec,
                          graph_item=self.graph_item, **run_options).fit(*args, **kwargs)

    def __repr__(self) -> str:
        return (f"Plan({self.graph_item.name!r}, {self.resource_spec.num_worker_tasks} worker "
                f"task(s), predicted {self.predicted_step_time_s * 1e3:.3f} ms/step)")


def optimize(model, resource_spec: ResourceSpec | None = None, *, trials: int | None = None,
             measure: bool = False, cost_model=None, batch_size: int | None = None,
             database=None, space_options=None, search_budget: int = 4000, seed: int = 0,
             progress: bool = False, graph_item: GraphItem | None = None,
             calibration=None, x=None, y=None, allow_exposed: bool = False,
             launch: str = "local", secret_file: str | None = None,
             spec: ResourceSpec | None = None, budget: int | None = None) -> Plan:
    """Finds a strategy for `model` on `resource_spec` with the search and cost model.

    Args:
        model: A compiled Keras 3 model (its loss and optimizer are used).
        resource_spec: The cluster (default: `ResourceSpec.local(workers=2,
            ps=1)`, a local cluster on this machine; with launch="remote",
            TF_CONFIG's cluster probed: its served tasks' devices and
            memory and their links to the chief measured, a few seconds,
            `launch.cluster_probe.planning_spec`).
        trials: Strategies to measure on the real cluster (needs
            `measure=True`; default 3 then). The CLI's `--trials`.
        measure: Measure the best candidates on the cluster (a few seconds
            each) and pick the fastest measured one.
        cost_model: What ranks candidates: a cost model object (a LightGBM
            `CostModel`, `SimulatorCostModel()`, any `Predictor`), a path to a
            saved one, "simulator" for the analytic simulator alone, or None
            for the shipped default (`autodist/search/data/cost_model.txt`)
            when it exists, else the simulator. None also brings the shipped
            measured-search model (`data/measured_search_model.txt`), which
            orders the candidates `measure=True` measures (see
            docs/search.md); any other value orders them itself.
        batch_size: Global batch size the plan is for (default: 32 per replica).
        database: A `Database` or path where trials are recorded and resumed.
        space_options: `SpaceOptions` bounding the search space (compressors
            and asynchronous consistency change results and are opt-in there).
        search_budget: Candidates scored per search round (the CLI's `--budget`).
        seed: Seeds the search.
        progress: Print a line per measured trial.
        graph_item: The model's capture, if already made.
        calibration: The simulator's machine constants: a `Calibration`;
            "cached" (`spec`'s calibration that `autodist calibrate`
            measured); "cluster" (measured on `spec`'s cluster now, about
            a minute, and cached; the model's own forward and backward
            passes are measured there too, in one launch more, and replace
            the simulator's estimate of them: `measure_compute`); "measure"
            (TensorFlow micro-benchmarks in
            this process, about a second); or None for the defaults, which
            rank the trial data set's strategies better so far
            (`benchmarks/results/calibrated_simulator.md`).
        x, y: Example inputs and targets for capturing the model where it
            needs them (a subclassed model; several outputs), as in
            `capture(model, x=..., y=...)`. Ignored with `graph_item`.
        allow_exposed: Let measured trials and `Plan.fit` run local clusters
            reachable from other hosts where no private network namespace
            can be made (see `DistributedRun`).
        launch: Where measured trials and `Plan.fit` run: "local" (every
            task on this machine) or "remote" (this process is the chief of
            a multi-host cluster whose other tasks run `autodist serve`,
            e.g. `ResourceSpec.from_tf_config()`; each round of trials is a
            short job there, see docs/search.md).
        secret_file: launch="remote": the cluster's shared secret, as for
            `DistributedRun` (default: ``AUTODIST_SECRET_FILE``, else
            ``AUTODIST_SECRET``).
        spec: Deprecated name of `resource_spec`.
        budget: Deprecated name of `trials`.

    Returns:
        A Plan: `.strategy`, `.predicted_step_time_s`, `.explain()`, `.plot()`, `.fit(...)`.

    Example:
        >>> plan = autodist.optimize(model)              # doctest: +SKIP
        >>> print(plan.explain())                        # doctest: +SKIP
        >>> history = plan.fit(x, y, batch_size=64)      # doctest: +SKIP
        >>> # On the chief of served hosts (the others: `autodist serve --tf-config`):
        >>> plan = autodist.optimize(model, measure=True, launch="remote")  # doctest: +SKIP
    """
    from autodist.ir.capture import capture
    from autodist.search.cost_model import resolve_cost_model
    from autodist.search.database import Database
    from autodist.search.tuner import Tuner

    resource_spec = _renamed("spec", spec, "resource_spec", resource_spec)
    trials = _renamed("budget", budget, "trials", trials)
    if trials is not None and not measure:
        raise InvalidArgumentError(f"trials counts measured trials; pass measure=True with "
                                   f"trials={trials!r}")
    trials = (3 if trials is None else trials) if measure else 0
    if launch not in LAUNCH_MODES:
        raise InvalidArgumentError(f"launch must be one of {LAUNCH_MODES}. Received: "
                                   f"{launch!r}")
    if resource_spec is None and launch == "remote":
        from autodist.launch.cluster_probe import planning_spec

        resource_spec = planning_spec(log=print if progress else lambda _: None)
    resource_spec = resource_spec or ResourceSpec.local(workers=2, ps=1)
    graph_item = graph_item or capture(model, x=x, y=y)
    cost_model = resolve_cost_model(cost_model)
    if database is not None and not isinstance(database, Database):
        database = Database(database)
    runner = None
    measure_batch = batch_size or 32 * len(resource_spec.replica_devices)
    # One launch per round of trials: its strategies are switched in place.
    if measure and launch == "remote":
        from autodist.runtime.remote_runner import RemoteRunner

        runner = RemoteRunner(model, resource_spec, graph_item=graph_item,
                              batch_size=measure_batch, secret_file=secret_file)
    elif measure:
        from autodist.runtime.local_runner import LocalRunner

        runner = LocalRunner(model, resource_spec, graph_item=graph_item,
                             batch_size=measure_batch, allow_exposed=allow_exposed)
    measured_compute = None
    if calibration == "cluster":
        from autodist.runtime.cluster_calibration import measure_compute

        measured_compute = measure_compute(model, resource_spec, batch_size=measure_batch,
                                           graph_item=graph_item, allow_exposed=allow_exposed)
    calibration = resolve_calibration(calibration, resource_spec, allow_exposed=allow_exposed)
    tuner = Tuner(graph_item, resource_spec, space_options=space_options, batch_size=batch_size,
                  calibration=calibration, measured_compute=measured_compute,
                  cost_model=cost_model, database=database, runner=runner,
                  search_budget=search_budget, seed=seed, progress=progress)
    return Plan(model, graph_item, resource_spec, tuner.tune(trials), allow_exposed=allow_exposed,
                batch_size=batch_size, launch=launch, secret_file=secret_file)


def _renamed(old: str, old_value: Any, new: str, new_value: Any) -> Any:
    """`new`'s value, or the deprecated `old`'s (warning), never both."""
    if old_value is None:
        return new_value
    if new_value is not None:
        raise InvalidArgumentError(f"give {new}= or its deprecated name {old}=, not both")
    warnings.warn(f"optimize({old}=...) is deprecated; use {new}=", DeprecationWarning,
                  stacklevel=3)
    return old_value


def resolve_calibration(calibration, spec: ResourceSpec, *, allow_exposed: bool = False):
    """The `Calibration` that `optimize(calibration=...)` names (see there)."""
    from autodist.runtime import cluster_calibration
    from autodist.search.simulator import Calibration

    if calibration is None or isinstance(calibration, Calibration):
        return calibration
    if calibration == "cached":
        cached = cluster_calibration.cached_calibration(spec)
        if cached is None:
            raise InvalidArgumentError(
                f"no cached calibration of this cluster ({spec.fingerprint}) in "
                f"{cluster_calibration.cache_path(spec).parent}: run `autodist calibrate` or "
                f"pass calibration='cluster'")
        return cached
    if calibration == "cluster":
        return cluster_calibration.calibrate_cluster(spec, allow_exposed=allow_exposed)
    if calibration == "measure":
        from autodist.runtime.calibrate import measure_calibration

        return measure_calibration()
    raise InvalidArgumentError(f"calibration must be a Calibration, 'cached', 'cluster', "
                               f"'measure' or None. Received: {calibration!r}")


def default_cost_model():
    """The LightGBM cost model shipped with the package, or None while none is shipped.

    `optimize(cost_model=None)` ranks with it, or with the simulator
    (`SimulatorCostModel`) when there is none.
    """
    from autodist.search.cost_model import shipped_cost_model

    return shipped_cost_model()
