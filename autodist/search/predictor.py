"""The cost-model role of the search: rank candidates, predict seconds, learn from trials.

The tuner, `autodist.optimize`, the autoscaler and the CLI talk to one
interface, `Predictor`; what ranks is an object, never a missing value. Two
implementations live in `autodist.search.cost_model`:

* `SimulatorCostModel`: the analytic simulator's step time. It learns
  nothing; what learns from its trials is a LightGBM regressor.
* `CostModel`: LightGBM trained on measured trials: a ranker, a regressor
  of step time, or a residual model of the simulator's error.

A predictor scores candidates of one workload through that workload's
`Simulator` (the context: its search space, calibration and batch size), as
the learned models read features computed from the simulator's tables.

Example:
    >>> model = SimulatorCostModel()                              # doctest: +SKIP
    >>> scores = model.predict_candidates(simulator, candidates)  # lower = faster
    >>> model = model.update(database.records())     # a LightGBM regressor of the trials
"""
from __future__ import annotations

import abc
import os
from typing import Sequence

import numpy as np

from autodist.search.database import TrialRecord
from autodist.search.features import FEATURE_NAMES
from autodist.search.simulator import Prediction, Simulator


class Predictor(abc.ABC):
    """Ranks candidate strategies of a workload (lower = predicted faster).

    Subclasses define `name`, `predicts_seconds`, `predict_candidates`,
    `update` and `save` (and a `load` classmethod reading what `save` wrote).
    """

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """What ranks, as recorded in `Strategy.performance.predictor` ("simulator", ...)."""

    @property
    @abc.abstractmethod
    def predicts_seconds(self) -> bool:
        """Whether `predict_candidates` returns step times in seconds (else only an order)."""

    @abc.abstractmethod
    def predict_candidates(self, simulator: Simulator, candidates: np.ndarray,
                           prediction: Prediction | None = None) -> np.ndarray:
        """One value per row of `candidates`, lower = predicted faster.

        Args:
            simulator: The workload's simulator (space, calibration, batch size).
            candidates: An (N, V + 1) candidate matrix of `simulator.space`.
            prediction: `simulator.predict(candidates)`, when the caller has it.

        Returns:
            Shape (N,): seconds when `predicts_seconds`, else ranking scores
            comparable only between candidates of this workload.
        """

    def check_features(self, names: Sequence[str]) -> None:
        """Raises unless the predictor can read candidates featurised with `names`."""
        del names  # a predictor that reads no features reads any

    @abc.abstractmethod
    def update(self, records: Sequence[TrialRecord], seed: int = 0) -> Predictor:
        """A predictor that has learned from measured trials, continuing from this one.

        Args:
            records: Successful trials with features (`TrialRecord.ok`).
            seed: Seeds any random choice of the training.

        Returns:
            A new predictor; this one is unchanged.

        Raises:
            CostModelError: Too few or unusable trials to learn from.
        """

    @abc.abstractmethod
    def save(self, path: str | os.PathLike) -> None:
        """Writes the predictor to one file (`autodist.search.cost_model.load_cost_model`)."""


def training_rows(records: Sequence[TrialRecord], feature_names: Sequence[str] = FEATURE_NAMES
                  ) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(features, median step times, workloads) of the successful trials with features.

    A feature a record lacks reads as 0 (records of an older feature set).
    """
    usable = [r for r in records if r.ok and r.features]
    x = np.array([[r.features.get(name, 0.0) for name in feature_names] for r in usable],
                 dtype=np.float64).reshape(len(usable), len(feature_names))
    y = np.array([r.median_step_time_s for r in usable], dtype=np.float64)
    return x, y, [r.workload for r in usable]
