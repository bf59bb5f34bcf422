"""The tuner: propose → rank → (measure the top) → notify callbacks → search again.

`Tuner.tune` searches the space with the current cost model (a `Predictor`:
the analytic simulator, or a LightGBM `CostModel`), optionally measures the
best unmeasured candidates through a `Runner` (one `run` call per round, so a
local runner measures a round in one cluster launch), and hands every
round's trials to its callbacks: by default `AddToDatabase` (every trial,
failed ones with their error), `RefitCostModel` (retrain on the database)
and, with `progress`, `LogProgress`. When a callback replaced the cost
model, it searches again, until the trial budget is spent. The builders'
strategies are always candidates, so the pick is never predicted slower than
the best builder; when measuring, the builders predicted fastest are
measured in the first round, so the pick is never measured slower than them
(its `origin` then names the builder it is). A builder that fails for the
workload, or whose strategy does not fit the devices' memory, is recorded in
`builder_errors` and the explanation, not dropped. Candidates that do not
fit (`Prediction.fits`) score infinitely slow, so the search never returns
one. A tuner resumes from its database: strategies already measured for the
workload are not measured again.

What orders the candidates to measure may differ from what ranks
predictions: a measured-search model (the shipped one, which
`benchmarks/train_cost_model.py` ships only where it picks better than the
simulator after k measured trials, or one passed as
`measured_search_model`) orders the builders and searched candidates to
measure until a refit replaces the cost model; the searched candidates are
then the best of the cost model's search and of a search scored by the
measured-search model. `explain` names what ordered them and why.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np

from autodist.ir.deprecation import renamed_names
from autodist.ir.errors import InvalidArgumentError
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy, describe_synchronizer, is_gathered
from autodist.search import builders as builder_presets
from autodist.search.algorithms import SearchResult, search
from autodist.search.cost_model import DefaultCostModel, SimulatorCostModel
from autodist.search.database import Database, TrialRecord, workload_key
from autodist.search.features import FEATURE_NAMES, featurize
from autodist.search.measure_callback import MeasureCallback, StrategyTrial, default_callbacks
from autodist.search.memory import DoesNotFitError, format_bytes
from autodist.search.measurement import Runner, checked_run
from autodist.search.measured_compute import MeasuredCompute
from autodist.search.predictor import Predictor
from autodist.search.simulator import Calibration, Prediction, Simulator
from autodist.search.space import SearchSpace, SpaceOptions

__all__ = ["Runner", "StrategyTrial", "TuneResult", "Tuner"]


@dataclasses.dataclass
class TuneResult:
    """What the tuner found.

    Attributes:
        strategy: The pick (its `performance` holds the prediction and any
            measurements).
        predicted_step_time_s: Predicted step time of the pick (seconds).
        lower_bound_s: The simulator's lower bound for the pick.
        builder_step_times_s: Builder name → predicted step time.
        trials: Measured trials of this run, in order.
        candidates_scored: Candidates the search scored.
        elapsed_s: Wall time of `tune`.
        explanation: Per variable, the choice and its best alternative; the builders.
        builder_errors: Builder name → why it could not build a strategy for
            this workload (such builders are no candidates).
    """

    strategy: Strategy
    predicted_step_time_s: float
    lower_bound_s: float
    builder_step_times_s: dict[str, float]
    trials: list[StrategyTrial]
    candidates_scored: int
    elapsed_s: float
    explanation: str = ""
    builder_errors: dict[str, str] = dataclasses.field(default_factory=dict)


class Tuner:
    """Finds a strategy for one GraphItem on one ResourceSpec.

    Args:
        graph_item, resource_spec: The workload.
        space_options: Bounds of the search space.
        calibration: Machine constants of the simulator.
        batch_size: Global batch size the strategy is for.
        cost_model: What ranks candidates: a `Predictor` such as a trained
            LightGBM `CostModel` or `SimulatorCostModel()` (the default); a
            `DefaultCostModel` (`resolve_cost_model(None)`) also brings its
            measured-search model.
        measured_search_model: What orders the candidates measured (default:
            the `DefaultCostModel`'s shipped one, else the cost model itself).
        database: Where trials are recorded (and resumed from).
        runner: Measures strategies; needed for `tune(trials > 0)`.
        search_budget: Candidates scored per search round.
        algorithm: "auto", "random", "greedy" or "evolutionary".
        seed: Seeds every random choice.
        progress: With the default callbacks, print a line per trial to stderr.
        callbacks: Run after each measured round (default:
            `default_callbacks(progress)`: record in the database, refit the
            cost model, and with `progress` log).
        measured_compute: The model's forward and backward passes measured
            on the cluster, for the simulator (`Simulator`).

    Example:
        >>> runner = LocalRunner(model, spec)                  # doctest: +SKIP
        >>> result = Tuner(gi, spec, runner=runner, database=Database("t.jsonl")).tune(4)
        >>> result.strategy, [t.median_step_time_s for t in result.trials]
    """

    def __init__(self, graph_item: GraphItem, resource_spec: ResourceSpec, *,
                 space_options: SpaceOptions | None = None,
                 calibration: Calibration | None = None, batch_size: int | None = None,
                 cost_model: Predictor | None = None, database: Database | None = None,
                 runner: Runner | None = None, search_budget: int = 4000,
                 algorithm: str = "auto", seed: int = 0, progress: bool = False,
                 callbacks: Sequence[MeasureCallback] | None = None,
                 measured_search_model: Predictor | None = None,
                 measured_compute: MeasuredCompute | None = None) -> None:
        self.graph_item = graph_item
        self.resource_spec = resource_spec
        self.space = SearchSpace(graph_item, resource_spec, space_options, batch_size)
        self.simulator = Simulator(self.space, calibration, batch_size, measured_compute)
        why = ("given as measured_search_model" if measured_search_model is not None
               else "the cost model orders them too")
        if isinstance(cost_model, DefaultCostModel):
            if measured_search_model is None:
                measured_search_model = cost_model.measured_search
                why = cost_model.measured_search_why
            cost_model = cost_model.ranking
        self.cost_model: Predictor = (cost_model if cost_model is not None
                                      else SimulatorCostModel())
        self.cost_model.check_features(FEATURE_NAMES)
        if measured_search_model is not None:
            measured_search_model.check_features(FEATURE_NAMES)
        self.measured_search_model: Predictor | None = measured_search_model
        # Why the measured-search model (or the cost model) orders the measured candidates.
        self.measured_search_why = why
        # What ordered each measured round's candidates (`explain` says so).
        self.measured_ordered_by: list[str] = []
        self.base_cost_model: Predictor = self.cost_model  # what refits continue from
        self.database = database
        self.runner = runner
        self.search_budget = search_budget
        self.algorithm = algorithm
        self.seed = seed
        self.progress = progress
        self.callbacks: list[MeasureCallback] = (list(callbacks) if callbacks is not None
                                                 else default_callbacks(progress))
        self.workload = workload_key(graph_item.fingerprint, resource_spec.fingerprint)
        self.builder_strategies, self.builder_errors = self._builder_strategies()
        self.seeds = {name: self.space.encode(s) for name, s in self.builder_strategies.items()}

    # -------------------------------------------------------------- scoring
    def score(self, candidates: np.ndarray) -> np.ndarray:
        """Ranking scores (lower = faster) of a candidate matrix; inf where it does not fit."""
        prediction = self.simulator.predict(candidates)
        scores = np.asarray(self.cost_model.predict_candidates(self.simulator, candidates,
                                                               prediction), dtype=np.float64)
        return np.where(prediction.fits, scores, np.inf)

    def predict_seconds(self, candidates: np.ndarray, prediction: Prediction | None = None
                        ) -> tuple[np.ndarray, np.ndarray]:
        """Predicted step times and lower bounds in seconds.

        A cost model that predicts seconds (the simulator, a regressor) gives
        them; a ranker only orders, so the simulator gives the seconds then.

        Args:
            candidates: An (N, V + 1) candidate matrix.
            prediction: The simulator's prediction for them, when known.
        """
        if prediction is None:
            prediction = self.simulator.predict(candidates)
        seconds = prediction.step_time_s
        if self.cost_model.predicts_seconds:
            seconds = np.asarray(self.cost_model.predict_candidates(self.simulator, candidates,
                                                                    prediction))
        return seconds, prediction.lower_bound_s

    @property
    def predictor(self) -> str:
        """The name of what ranks now ("simulator", "lightgbm-regressor", ...)."""
        return self.cost_model.name

    @property
    def measure_ranker(self) -> Predictor:
        """What orders the candidates to measure now: the measured-search model until a
        refit replaces the cost model, else the cost model."""
        if self.measured_search_model is not None and self.cost_model is self.base_cost_model:
            return self.measured_search_model
        return self.cost_model

    def measure_order(self, candidates: np.ndarray) -> np.ndarray:
        """The rows of `candidates` that fit, in the order to measure them: by
        `measure_ranker`, ties by the cost model."""
        if len(candidates) == 0:
            return candidates
        prediction = self.simulator.predict(candidates)
        scores = np.asarray(self.cost_model.predict_candidates(self.simulator, candidates,
                                                               prediction), dtype=np.float64)
        ranker = self.measure_ranker
        first = (scores if ranker is self.cost_model else np.asarray(
            ranker.predict_candidates(self.simulator, candidates, prediction), dtype=np.float64))
        order = np.lexsort((scores, first))
        return candidates[order[prediction.fits[order]]]

    def _measured_search_pool(self, result: SearchResult) -> np.ndarray:
        """The searched candidates to measure, in order: while a measured-search model
        orders them, the best of the cost model's search and of one scored by it."""
        ranker = self.measure_ranker
        if ranker is self.cost_model:
            return result.candidates

        def score(candidates: np.ndarray) -> np.ndarray:
            prediction = self.simulator.predict(candidates)
            scores = np.asarray(ranker.predict_candidates(self.simulator, candidates,
                                                          prediction), dtype=np.float64)
            return np.where(prediction.fits, scores, np.inf)

        found = search(self.space, score, algorithm=self.algorithm, budget=self.search_budget,
                       seed=self.seed, seeds=list(self.seeds.values()))
        return self.measure_order(np.concatenate([found.candidates, result.candidates]))

    # --------------------------------------------------------------- tuning
    def tune(self, trials: int = 0, measure_per_round: int = 2,
             builder_trials: int | None = None) -> TuneResult:
        """Searches, measures up to `trials` strategies, and returns the pick.

        Args:
            trials: Real measurements to make (0: rank by prediction only).
            measure_per_round: Searched candidates measured between refits.
            builder_trials: How many of the trials go to the builders predicted
                fastest (default: half of them), so that the pick is measured
                against what a user would have picked by hand. They are
                measured in the first round, with its searched candidates.
        """
        if trials < 0:
            raise InvalidArgumentError(f"trials must be >= 0. Received: {trials!r}")
        if trials and self.runner is None:
            raise InvalidArgumentError("tune(trials > 0) needs a runner to measure strategies")
        start = time.perf_counter()
        measured = self._measured_from_database()
        result = self._search()
        scored = result.evaluated
        done: list[StrategyTrial] = []
        builder_trials = trials // 2 if builder_trials is None else min(builder_trials, trials)
        pending: dict[tuple, tuple[np.ndarray, str]] = {}
        for name in self._builders_by_measure_order()[:builder_trials]:
            key = tuple(self.seeds[name])
            if key not in measured and key not in pending:
                pending[key] = (self.seeds[name], name)
        pool = self._measured_search_pool(result) if trials else result.candidates
        while len(done) < trials:
            batch, pending = pending, {}
            room = min(measure_per_round, trials - len(done) - len(batch))
            for candidate in pool:
                if room <= 0:
                    break
                key = tuple(candidate)
                if key not in measured and key not in batch:
                    batch[key] = (candidate, "search")
                    room -= 1
            if not batch:
                break
            self.measured_ordered_by.append(self.measure_ranker.name)
            new = self._measure(list(batch.values()))
            done += new
            measured.update(zip(batch, new))
            ranked_with = self.cost_model
            for callback in self.callbacks:
                callback.apply(self, new)
            if self.cost_model is not ranked_with:
                result = self._search()
                scored += result.evaluated
                pool = self._measured_search_pool(result)
        best, predicted, lower = self._pick(result, measured)
        builder_seconds = (self.predict_seconds(np.stack(list(self.seeds.values())))[0]
                           if self.seeds else [])
        return TuneResult(
            strategy=best, predicted_step_time_s=predicted, lower_bound_s=lower,
            builder_step_times_s=dict(zip(self.seeds, (float(t) for t in builder_seconds))),
            trials=done, candidates_scored=scored, elapsed_s=time.perf_counter() - start,
            explanation=self.explain(self.space.encode(best)),
            builder_errors=dict(self.builder_errors))

    def _builders_by_measure_order(self) -> list[str]:
        """The builders in the order to measure them: by the measured-search model while
        it orders (`measure_order`), else by predicted seconds."""
        if not self.seeds:
            return []
        if self.measure_ranker is self.cost_model:
            seconds, _ = self.predict_seconds(np.stack(list(self.seeds.values())))
            return [name for _, name in sorted(zip(seconds, self.seeds))]
        by_key = {tuple(c): name for name, c in self.seeds.items()}
        return [by_key[tuple(c)] for c in self.measure_order(np.stack(list(self.seeds.values())))]

    def _search(self) -> SearchResult:
        result = search(self.space, self.score, algorithm=self.algorithm,
                        budget=self.search_budget, seed=self.seed,
                        seeds=list(self.seeds.values()))
        fits = np.isfinite(result.scores)
        if not fits.any():
            columns = self.simulator.memory.strategy_columns(
                self.space.decode(result.best)) if len(result.candidates) else None
            detail = ("" if columns is None else
                      "; the best candidate found needs:\n"
                      + self.simulator.memory.describe(columns))
            raise DoesNotFitError(
                f"no strategy the search found for {self.graph_item.name!r} fits the devices' "
                f"memory at a global batch of {self.simulator.batch_size} "
                f"({result.evaluated} candidates scored){detail}")
        return SearchResult(result.candidates[fits], result.scores[fits], result.evaluated)

    def _pick(self, result: SearchResult,
              measured: dict[tuple, StrategyTrial]) -> tuple[Strategy, float, float]:
        ok = {k: t for k, t in measured.items() if t.error is None and t.step_times_s}
        if ok:
            key = min(ok, key=lambda k: ok[k].median_step_time_s)
            candidate = np.array(key, dtype=np.int64)
        else:
            candidate = result.best
        seconds, lower = self.predict_seconds(candidate[None, :])
        origin = ok[tuple(candidate)].strategy.origin if tuple(candidate) in ok else "search"
        strategy = self.space.decode(candidate, origin=origin)
        perf = strategy.proto.performance
        perf.predicted_step_time_s = float(seconds[0])
        perf.lower_bound_step_time_s = float(lower[0])
        perf.predictor = self.predictor
        if tuple(candidate) in ok:
            perf.measured_step_time_s.extend(ok[tuple(candidate)].step_times_s)
        return strategy, float(seconds[0]), float(lower[0])

    def _measure(self, batch: Sequence[tuple[np.ndarray, str]]) -> list[StrategyTrial]:
        """Measures (candidate, origin) pairs with one `run` call; failures as trials."""
        strategies = [self.space.decode(candidate, origin=origin) for candidate, origin in batch]
        seconds, _ = self.predict_seconds(np.stack([candidate for candidate, _ in batch]))
        trials = []
        for (_, origin), strategy, predicted, result in zip(
                batch, strategies, seconds, checked_run(self.runner, strategies)):
            error = result.error
            if error is None and not result.step_times_s:
                error = "the runner returned no step times"
            trials.append(StrategyTrial(strategy, float(predicted),
                                result.step_times_s if error is None else (), error, origin))
        return trials

    def record(self, strategy: Strategy, step_times_s: Sequence[float], error: str | None,
               predicted_step_time_s: float | None = None, origin: str = "search",
               extra: dict | None = None) -> TrialRecord:
        """A database record of one trial of `strategy` on this workload."""
        features = featurize(self.simulator, self.space.encode(strategy)[None, :])[0]
        gi = self.graph_item
        return TrialRecord(
            workload=self.workload, graph_item_fingerprint=gi.fingerprint,
            resource_spec_fingerprint=self.resource_spec.fingerprint, model_name=gi.name,
            graph_summary={"num_variables": float(len(gi.variables)),
                           "total_variable_bytes": float(gi.total_variable_bytes),
                           "total_flops": float(gi.total_flops),
                           "batch_size": float(self.simulator.batch_size)},
            resource_spec=self.resource_spec.to_text(), strategy=strategy.serialize(),
            features=dict(zip(FEATURE_NAMES, (float(x) for x in features))),
            step_times_s=tuple(step_times_s), error=error, origin=origin,
            predicted_step_time_s=predicted_step_time_s, created_at=time.time(),
            extra=dict(extra or {}))

    def _measured_from_database(self) -> dict[tuple, StrategyTrial]:
        measured: dict[tuple, StrategyTrial] = {}
        if self.database is None:
            return measured
        for record in self.database.records():
            if record.workload != self.workload or not record.strategy:
                continue
            strategy = Strategy.deserialize(record.strategy, source="trial database")
            candidate = self.space.encode(strategy)
            measured[tuple(candidate)] = StrategyTrial(
                strategy, record.predicted_step_time_s or 0.0, tuple(record.step_times_s),
                record.error, record.origin)
        return measured

    # -------------------------------------------------------------- explain
    def explain(self, candidate: np.ndarray) -> str:
        """Per variable: the choice, the best alternative of the other kind and its cost.

        Where memory forced the choice, it says so: the kinds the space left
        out because they cannot fit (with the bytes they would need), and a
        faster alternative that does not fit with the rest of the candidate.
        """
        candidate = np.asarray(candidate, dtype=np.int64)
        base = float(self.predict_seconds(candidate[None, :])[0][0])
        lines = [f"predicted step time {base * 1e3:.3f} ms ({self.predictor}; simulator "
                 f"constants: {self.simulator.calibration.source})",
                 self._measured_search_line()]
        measured = self.simulator.measured_compute
        if measured is not None:
            lines.append(f"compute: {measured.seconds * 1e3:.3f} ms per replica step at "
                         f"{measured.examples:g} examples, {measured.source}")
        memory = self.simulator.memory
        if memory.constrained:
            columns = self.space.memory.strategy_columns(self.space.decode(candidate))
            used = memory.pool_bytes(columns)[0]
            ratio = np.where(np.isfinite(memory.capacities), used / memory.capacities, 0.0)
            fullest = int(np.argmax(ratio))
            lines.append(f"memory: fullest {memory.pools[fullest].name}, "
                         f"{format_bytes(used[fullest])} of "
                         f"{format_bytes(memory.pools[fullest].capacity_bytes)} "
                         f"({ratio[fullest]:.0%}) at a global batch of {memory.batch_size}")
        lines += ["", "variable: choice — the best alternative of another kind (PS, all-reduce, "
                  "all-gather, split), with the rest fixed"]
        for v, var in enumerate(self.space.variables):
            options = self.space.options[v]
            trial = np.repeat(candidate[None, :], len(options), axis=0)
            trial[:, v] = np.arange(len(options))
            prediction = self.simulator.predict(trial)
            seconds = self.predict_seconds(trial, prediction)[0]
            fits = prediction.fits
            chosen = options[int(candidate[v])]
            kind = _how(chosen, var.sparse_gradient)
            kinds = [_how(o, var.sparse_gradient) for o in options]
            others = [i for i, k in enumerate(kinds) if k != kind]
            what = _describe(chosen, var.sparse_gradient)
            kind_note = "sparse" if var.sparse_gradient else "dense"
            why = "the only kind available"
            fitting = [i for i in others if fits[i]]
            if fitting:
                alt = min(fitting, key=lambda i: seconds[i])
                why = (f"{_describe(options[alt], var.sparse_gradient)} would be "
                       f"{(seconds[alt] - base) * 1e3:+.3f} ms")
            elif others:
                why = "no other kind fits in memory with the rest"
            if others and not fits[min(others, key=lambda i: seconds[i])]:
                alt = min(others, key=lambda i: seconds[i])
                why += (f"; {_describe(options[alt], var.sparse_gradient)} "
                        f"({(seconds[alt] - base) * 1e3:+.3f} ms) does not fit in memory "
                        "with the rest")
            why += self._refused(v, set(kinds))
            lines.append(f"  {var.name} ({kind_note}, {var.byte_size} B): {what} — {why}")
        lines += ["", "builders (predicted step time):"]
        if self.seeds:
            builder_seconds = self.predict_seconds(np.stack(list(self.seeds.values())))[0]
            for name, seconds in sorted(zip(self.seeds, builder_seconds), key=lambda p: p[1]):
                lines.append(f"  {name:<22} {seconds * 1e3:.3f} ms  ({seconds / base:.2f}x)")
        for name, error in self.builder_errors.items():
            lines.append(f"  {name:<22} failed to build: {error.splitlines()[0][:160]}")
        return "\n".join(lines)

    def _measured_search_line(self) -> str:
        """What ordered the measured candidates (or would, with trials), and why."""
        ranker = self.measured_search_model or self.base_cost_model
        if not self.measured_ordered_by:
            return (f"measured search: no trials; with trials, {ranker.name} would order the "
                    f"candidates to measure ({self.measured_search_why})")
        text = (f"measured search: {ranker.name} ordered the measured candidates "
                f"({self.measured_search_why})")
        if any(name != ranker.name for name in self.measured_ordered_by):
            text += ("; by round: " + ", ".join(self.measured_ordered_by)
                     + " (a refit on the trials replaced the cost model)")
        return text

    def _refused(self, v: int, offered: set[str]) -> str:
        """The kinds the space left out for variable `v` for memory, and what they need."""
        sparse = self.space.variables[v].sparse_gradient
        smallest: dict[str, tuple[float, str, float]] = {}
        for refusal in self.space.memory_refusals[v]:
            kind = _how(refusal.config, sparse)
            if kind not in offered and (kind not in smallest
                                        or refusal.needed_bytes < smallest[kind][0]):
                smallest[kind] = (refusal.needed_bytes, refusal.pool.name,
                                  refusal.pool.capacity_bytes)
        return "".join(f"; memory: {kind} would need {format_bytes(needed)} in {pool} > "
                       f"{format_bytes(capacity)}: not offered"
                       for kind, (needed, pool, capacity) in sorted(smallest.items()))

    def _builder_strategies(self) -> tuple[dict[str, Strategy], dict[str, str]]:
        """Each builder's strategy for the workload, and why the others failed to build."""
        strategies, errors = {}, {}
        for name, cls in builder_presets.STRATEGY_BUILDERS.items():
            try:
                strategy = cls().build(self.graph_item, self.resource_spec)
            except Exception as e:  # noqa: BLE001
                # e.g. a PS builder on a spec without PS devices: recorded, no candidate.
                errors[name] = f"{type(e).__name__}: {e}"
                continue
            if not self.space.admits(strategy):
                # e.g. mixed synchronizers under the optimizer's gradient clipping
                errors[name] = ("not admitted by the search space (its synchronizers do not "
                                "fit the optimizer's gradient clipping: "
                                f"{self.space.clipping!r})")
                continue
            overflow = self.simulator.memory.overflow(
                self.simulator.memory.strategy_columns(strategy))
            if overflow is not None:
                pool, needed = overflow
                errors[name] = (f"does not fit in memory: needs {format_bytes(needed)} in "
                                f"{pool.name} (capacity {format_bytes(pool.capacity_bytes)})")
                continue
            strategies[name] = strategy
        return strategies, errors


def _how(config, sparse_gradient: bool) -> str:
    """How a variable's gradient travels: "ps", "all-reduce", "all-gather" or "split"."""
    kinds = {s.WhichOneof("kind") for s in config.shards}
    if len(kinds) > 1:
        return "split"
    if kinds == {"ps"}:
        return "ps"
    gathered = is_gathered(config.shards[0].all_reduce, sparse_gradient)
    return "all-gather" if gathered else "all-reduce"


def _describe(config, sparse_gradient: bool = False) -> str:
    shards = [describe_synchronizer(s) for s in config.shards]
    densified = ", densified" if sparse_gradient and _how(config, True) == "all-reduce" else ""
    if config.partitioner.num_shards > 1:
        head = f"{config.partitioner.num_shards} shards on axis {config.partitioner.axis}: "
        kinds = sorted(set(shards))
        return head + (", ".join(shards) if len(kinds) > 1 else kinds[0]) + densified
    return shards[0] + densified


# Old names, kept working with a DeprecationWarning that names the new one.
__getattr__ = renamed_names(__name__, globals(), {"Trial": "StrategyTrial"})
