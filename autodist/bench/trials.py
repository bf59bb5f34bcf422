"""The trial data set: what the collector measures and writes, and what the trainer reads.

`benchmarks/collect_trials.py` measures, per workload (an example model at
its benchmark size on an emulated cluster `Shape`), the builders' strategies
and seeded samples of the search space (`candidate_strategies`) with the
search's local runner, and writes one `TrialRecord` per strategy
(`make_record`). `benchmarks/train_cost_model.py` reads the records back
(`read_records`, plain or gzip), scores them again with the current
simulator (`rescore`) and turns the successful ones into training rows
(`Rows`); `autodist.bench.shipping` decides what ships.
"""
from __future__ import annotations

import dataclasses
import gzip
import os
import pathlib
from typing import Any, Callable, Sequence

import numpy as np

from autodist.ir.errors import InvalidArgumentError
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.search.database import (Database, DatabaseError, TrialRecord, decode_line,
                                      summarize_graph_item)
from autodist.search.measurement import MeasureResult, Runner, pool
from autodist.search.space import SearchSpace


@dataclasses.dataclass(frozen=True)
class Shape:
    """An emulated cluster: worker and PS tasks, every task's link capped at `mbit`."""

    workers: int
    ps: int
    mbit: float

    @classmethod
    def parse(cls, text: str) -> Shape:
        """Reads "<workers>x<ps>@<Mbit/s>", e.g. "2x1@100"."""
        try:
            tasks, mbit = text.split("@")
            workers, ps = tasks.lower().split("x")
            shape = cls(int(workers), int(ps), float(mbit))
        except ValueError:
            raise InvalidArgumentError(f"a shape is '<workers>x<ps>@<Mbit/s>', e.g. '2x1@100'. "
                                       f"Received: {text!r}") from None
        if shape.workers < 1 or shape.ps < 0 or shape.mbit <= 0:
            raise InvalidArgumentError("a shape needs >= 1 worker, >= 0 PS and a positive "
                                       "bandwidth. "
                                       f"Received: {text!r}")
        return shape

    def __str__(self) -> str:
        return f"{self.workers}x{self.ps}@{self.mbit:g}"


# ------------------------------------------------------------- collecting
def candidate_strategies(graph_item: GraphItem, spec: ResourceSpec, space: SearchSpace,
                         count: int, seed: int, skip: set[tuple[int, ...]] = frozenset(),
                         on_builder_error: Callable[[str, str], None] = lambda *_: None
                         ) -> list[tuple[str, Strategy, tuple[int, ...]]]:
    """The builders' strategies, then seeded samples of the space, without duplicates.

    Args:
        graph_item, spec, space: The workload and its search space.
        count: Most strategies to return.
        seed: Seeds the samples.
        skip: Keys (`space.encode(strategy)`) already measured.
        on_builder_error: Receives (builder name, "<ExceptionType>: message")
            for each builder that cannot build for the workload (e.g. a PS
            builder without PS tasks).

    Returns:
        [(origin, strategy, key)], at most `count` (the builders always,
        unless already in `skip`); the key is `space.encode(strategy)` as a
        tuple, which identifies a strategy.
    """
    from autodist.search import builders

    out, seen = [], set(skip)
    for name, cls in builders.STRATEGY_BUILDERS.items():
        try:
            strategy = cls().build(graph_item, spec)
        except Exception as e:  # noqa: BLE001
            on_builder_error(name, f"{type(e).__name__}: {e}")
            continue
        key = tuple(int(c) for c in space.encode(strategy))
        if key not in seen:
            seen.add(key)
            out.append((name, strategy, key))
    rng = np.random.default_rng(seed)
    for _round in range(20):
        if len(out) >= count:
            break
        need = count - len(out)
        samples = np.concatenate([space.sample(need, rng, prior="knowledge"),
                                  space.sample(need, rng, prior="uniform")])
        rng.shuffle(samples)
        for candidate in samples:
            if len(out) >= count:
                break
            strategy = space.decode(candidate, origin="sample")
            # Keyed by the strategy's own encoding: candidates that differ only in
            # how fusion slots are numbered decode to the same strategy.
            key = tuple(int(c) for c in space.encode(strategy))
            if key in seen:
                continue
            seen.add(key)
            out.append(("sample", strategy, key))
    return out


def measure_repeated(runner: Runner, strategies: Sequence[Strategy], repeats: int
                     ) -> list[tuple[MeasureResult, list[float]]]:
    """Measures strategies in `repeats` separate runs and pools each one's timed steps.

    Every run is a fresh `runner.run` (with the collector's `per_launch`, a
    fresh cluster launch); every other run takes the strategies in reverse
    order, so no strategy is always measured late in a launch. A strategy's
    pooled result holds the timed steps of all its successful runs (its
    record's median is the median over all of them: one definition of a
    trial's time, whatever `repeats`), or the first run's error when none
    succeeded.

    Args:
        runner: Measures a list of strategies (one launch per call here).
        strategies: The strategies, in launch order.
        repeats: Runs per strategy (>= 1).

    Returns:
        [(pooled result, median step time of each successful run)], in the
        order of `strategies`.
    """
    if repeats < 1:
        raise InvalidArgumentError(f"repeats must be >= 1. Received: {repeats!r}")
    n = len(strategies)
    runs: list[list[MeasureResult]] = [[] for _ in range(n)]
    for repeat in range(repeats):
        order = list(range(n)) if repeat % 2 == 0 else list(reversed(range(n)))
        outcomes = runner.run([strategies[i] for i in order])
        for i, outcome in zip(order, outcomes):
            runs[i].append(outcome)
    return [(pool(results), [float(np.median(r.step_times_s)) for r in results if r.ok])
            for results in runs]


def make_record(graph_item: GraphItem, spec: ResourceSpec, strategy: Strategy,
                outcome: MeasureResult, *, model_key: str, batch_size: int,
                features: dict[str, float] | None, predicted_s: float | None,
                extra: dict[str, Any]) -> TrialRecord:
    """The Database record of one measured (or failed) strategy.

    `extra` gets the warm-up step times, the launch size and (when the
    strategy was switched to) the switch's seconds.
    """
    summary = dict(summarize_graph_item(graph_item), batch_size=float(batch_size))
    details = dict(extra, warmup_step_times_s=list(outcome.warmup_times_s),
                   launch_size=outcome.launch_size)
    if outcome.switch_s is not None:
        details["switch_s"] = outcome.switch_s
    return TrialRecord.from_trial(
        graph_item, spec, strategy, model_name=model_key,
        step_times_s=outcome.step_times_s if outcome.error is None else (),
        error=outcome.error, features=features, predicted_step_time_s=predicted_s,
        graph_summary=summary, extra=details)


def record_key(record: TrialRecord) -> tuple[str, float]:
    """The ranking group of a record: its workload and global batch size."""
    return record.workload, float(record.graph_summary.get("batch_size", 0.0))


def measured_keys(records: Sequence[TrialRecord], workload: str, batch_size: int,
                  space: SearchSpace) -> set[tuple[int, ...]]:
    """Candidates the database already holds for this workload and batch size."""
    keys = set()
    for record in records:
        if record_key(record) != (workload, float(batch_size)) or not record.strategy:
            continue
        keys.add(tuple(int(c) for c in space.encode(record.load_strategy())))
    return keys


# ---------------------------------------------------------------- training
def read_records(path: str | os.PathLike) -> tuple[list[TrialRecord], int]:
    """The valid records of a trial database (plain or gzip-compressed JSON Lines).

    Returns:
        (records, number of skipped lines).
    """
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no trial database at {str(path)!r}; run "
                                "benchmarks/collect_trials.py first")
    if path.suffix != ".gz":
        contents = Database(path).read()
        return contents.records, len(contents.skipped)
    records, skipped = [], 0
    with gzip.open(path, "rb") as f:
        for line in f.read().split(b"\n"):
            if not line.strip():
                continue
            try:
                records.append(decode_line(line))
            except DatabaseError:
                skipped += 1
    return records, skipped


class Rows:
    """The training rows of the successful trials of a database.

    Attributes:
        records: The successful records with features.
        X: Their features, in `feature_names` order.
        times: Their median step times.
        workloads: Their ranking groups: workload and global batch size.
        models: Their model names.
        simulator: The simulator's prediction of each (stored, or its feature).
    """

    def __init__(self, records: Sequence[TrialRecord], feature_names: Sequence[str]) -> None:
        usable = [r for r in records if r.ok and r.features]
        missing = sorted({n for r in usable for n in feature_names if n not in r.features})
        if missing:
            raise InvalidArgumentError(f"trial records lack features {missing}; recollect them "
                                       "with "
                                       "the current autodist")
        self.records = usable
        self.X = np.array([[r.features[n] for n in feature_names] for r in usable])
        self.times = np.array([r.median_step_time_s for r in usable])
        # Rankings compare strategies of one workload at one global batch size.
        self.workloads = [f"{r.workload}@{r.graph_summary.get('batch_size', 0):g}"
                          for r in usable]
        self.models = [r.model_name for r in usable]
        self.simulator = np.array([r.predicted_step_time_s if r.predicted_step_time_s
                                   is not None else r.features["sim_step_time_s"]
                                   for r in usable])


def rescore(records: Sequence[TrialRecord],
            calibration_for: Callable[[TrialRecord], Any] | None = None,
            same_flops: bool = True,
            measured_compute_for: Callable[[TrialRecord], Any] | None = None
            ) -> list[TrialRecord]:
    """The records with features and simulator predictions of the current code.

    A trial's measured times do not change when the simulator or the features
    do, but what a cost model learns from must be what `optimize` computes
    now; each successful record's strategy is scored again on its workload
    (the model rebuilt from `model_name` and `extra["model_kwargs"]`, the
    stored resource spec, the stored global batch). `calibration_for` gives
    the simulator's `Calibration` of a record's cluster (default: the
    simulator's default constants), `measured_compute_for` its workload's
    `MeasuredCompute` (default: none, compute estimated). With
    `same_flops=False` a capture whose
    FLOP estimate changed (a newer capture infers more shapes) still
    re-scores the trials of the same model, if its variables are the same.

    Raises:
        ValueError: A model now captures to another graph than its trials'.
    """
    import keras

    from autodist import models
    from autodist.ir.capture import capture
    from autodist.search.features import featurize_strategy
    from autodist.search.simulator import Simulator

    graph_items: dict[str, Any] = {}
    simulators: dict[tuple[str, str, float], Any] = {}
    out = []
    for record in records:
        if not record.ok:
            out.append(record)
            continue
        kwargs = dict(record.extra.get("model_kwargs", {}))
        key = f"{record.model_name}:{sorted(kwargs.items())}"
        if key not in graph_items:
            keras.backend.clear_session()  # layer names as in a fresh process
            graph_items[key] = capture(models.build(record.model_name, **kwargs))
        graph_item = graph_items[key]
        if graph_item.fingerprint != record.graph_item_fingerprint and \
                not _same_graph(graph_item, record, same_flops):
            raise InvalidArgumentError(f"{record.model_name} {kwargs} captures to another graph "
                                       f"({graph_item.fingerprint}) than its trials "
                                       f"({record.graph_item_fingerprint}); use --stored-features")
        batch = float(record.graph_summary.get("batch_size", 0)) or None
        calibration = calibration_for(record) if calibration_for else None
        compute = measured_compute_for(record) if measured_compute_for else None
        sim_key = (key, record.resource_spec_fingerprint, batch or 0.0, calibration, compute)
        if sim_key not in simulators:
            spec = record.load_resource_spec()
            simulators[sim_key] = Simulator(SearchSpace(graph_item, spec), calibration,
                                            batch_size=int(batch) if batch else None,
                                            measured_compute=compute)
        features = featurize_strategy(simulators[sim_key], record.load_strategy())
        out.append(dataclasses.replace(record, features=features,
                                       predicted_step_time_s=features["sim_step_time_s"]))
    return out


def _same_graph(graph_item: GraphItem, record: TrialRecord, same_flops: bool = True) -> bool:
    """Whether a capture has the trial's variables and (within 1%) its FLOPs.

    The fingerprint also covers the capture's per-op estimates (e.g. the rows
    of a sparse gradient) and its bookkeeping ops (a newer capture adds the
    sample-weight input and the metrics' per-batch sums: a few ops and a few
    hundred FLOPs), which a newer capture may compute differently for the
    same model; the trial's measurements still hold then. The variables must
    match exactly.
    """
    now = summarize_graph_item(graph_item)
    for key, value in now.items():
        stored = float(record.graph_summary.get(key, -1.0))
        if key == "num_ops" or (key == "total_flops" and not same_flops):
            continue
        if key == "total_flops":
            allowed = max(_FLOPS_TOLERANCE * value, _FLOPS_SLACK)
        else:
            allowed = 1e-9 * max(1.0, value)
        if abs(value - stored) > allowed:
            return False
    return True


# FLOPs difference under which a newer capture is the trial's graph: 1%, or
# 10^5 FLOPs (about a microsecond: the bookkeeping ops of a capture are a few
# thousand FLOPs, 1.9% of ncf's 3 * 10^5).
_FLOPS_TOLERANCE = 0.01
_FLOPS_SLACK = 1e5
