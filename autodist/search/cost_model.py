"""Cost models of strategies: LightGBM trained on measured trials, and the simulator.

Both implement the search's cost-model role (`autodist.search.predictor.Predictor`):

* `CostModel`: LightGBM, trained only from data: callers turn `Database`
  records into a feature matrix, a vector of measured step times and the
  workload of each row. Three kinds:

  * ``"ranker"`` (default): LightGBM ``lambdarank`` with one query per
    workload. Within a workload, faster trials get higher relevance labels.
    It learns the order of strategies for a workload, which is what a search
    needs, and copes with workloads whose absolute times differ by orders of
    magnitude.
  * ``"regressor"``: LightGBM regression on log(step time); predicts seconds.
  * ``"residual"``: LightGBM regression on the simulator's error,
    log(measured / simulated step time), with the simulator's step time read
    from the ``sim_step_time_s`` feature; predicts simulator × exp(residual)
    seconds. Where the trials agree with the simulator it keeps the
    simulator's order; its training starts from the simulator rather than
    from nothing.

* `SimulatorCostModel`: the analytic simulator's step time (seconds); it
  learns nothing, and `update` gives a LightGBM regressor of the trials.

`CostModel.predict` returns a value where LOWER means predicted FASTER for
every kind (the negated ranking score, or the predicted step time in seconds),
so callers always sort ascending. A ranker's scores are comparable only
between strategies of the same workload.

`resolve_cost_model` turns what `autodist.optimize(cost_model=...)` and the
CLI accept ("simulator", a file, a predictor, or None for the shipped
default) into a predictor. The shipped default (`DefaultCostModel`) has two
roles, each shipped by its own rule (`benchmarks/train_cost_model.py`):
what ranks predictions (`SHIPPED_COST_MODEL`, else the simulator) and what
orders the candidates a measured search measures
(`SHIPPED_MEASURED_SEARCH_MODEL`, else the ranking one). The metrics live in
`autodist.search.metrics`.

Example:
    >>> model = CostModel("ranker").fit(X, step_times, workloads, names)  # doctest: +SKIP
    >>> order = np.argsort(model.predict(X_candidates))   # best first   # doctest: +SKIP
    >>> model.save("cost_model.json"); CostModel.load("cost_model.json")  # doctest: +SKIP
"""
from __future__ import annotations

import collections
import hashlib
import json
import math
import os
import pathlib
import warnings
from typing import Any, Callable, Literal, Mapping, Sequence

import numpy as np

from autodist.ir.atomic import atomic_write
from autodist.search.database import TrialRecord
from autodist.search.features import FEATURE_NAMES, featurize
from autodist.search.lightgbm_text import canonical_model_text
from autodist.search.metrics import (CostModelError, as_matrix, as_names, as_vector,
                                     check_same_length, group_indices, kendall_tau, log_rmse,
                                     pairwise_accuracy)
from autodist.search.predictor import Predictor, training_rows
from autodist.search.simulator import Prediction, Simulator
from autodist.ir.errors import short_repr, shorten

# Version of the saved file; `load` refuses newer ones. Version 2 added
# "model_sha256", the checksum of the LightGBM model text, verified before
# LightGBM parses it (LightGBM may abort the process on a damaged model).
# Version 3 added the kind "residual" (an older autodist then says the file
# is newer rather than that the kind is unknown).
COST_MODEL_FORMAT_VERSION = 3
_FORMAT = "autodist.cost_model"
# Relevance labels of the ranker are integers 0 .. _RELEVANCE_LEVELS - 1
# (LightGBM's lambdarank accepts labels up to 30 with its default tables).
_RELEVANCE_LEVELS = 31
_KINDS = ("ranker", "regressor", "residual")
# Kinds whose predictions are step times in seconds.
_SECONDS_KINDS = ("regressor", "residual")
# The feature a residual model corrects: the simulator's step time in seconds.
SIMULATOR_FEATURE = "sim_step_time_s"
# The kind decides these; a caller may not override them through `params`.
_RESERVED_PARAMS = ("objective", "application", "app", "objective_type", "loss")
# The most LightGBM threads a saved model may ask for.
_MAX_THREADS = 1024


def _lightgbm():
    """Imports LightGBM on first use (it takes ~0.5 s; importing autodist must stay cheap)."""
    import lightgbm
    return lightgbm


def relevance_labels(step_times: Sequence[float] | np.ndarray,
                     workloads: Sequence[str]) -> np.ndarray:
    """The ranker's labels: integers 0..30, graded by rank quantile within each workload.

    The fastest distinct step time of a workload gets 30, the slowest 0, and
    the times between are spread evenly by their rank among the workload's
    distinct times, rounded to the nearest integer, halves up (equal times get
    equal labels). A workload with one
    distinct time gets 0 everywhere.
    """
    times = as_vector(step_times, "step_times")
    names = as_names(workloads)
    check_same_length(("step_times", times), ("workloads", names))
    labels = np.zeros(len(times), dtype=np.int64)
    top = _RELEVANCE_LEVELS - 1
    for idx in group_indices(names):
        distinct, rank = np.unique(times[idx], return_inverse=True)   # rank 0 = fastest
        steps = len(distinct) - 1
        if steps:
            # round(top * (steps - rank) / steps), halves up, in exact integer arithmetic
            labels[idx] = (2 * top * (steps - rank) + steps) // (2 * steps)
    return labels


# ---------------------------------------------------------------- the model
class CostModel(Predictor):
    """A LightGBM model of strategy step time, trained from measured trials.

    Args:
        kind: "ranker" (lambdarank, one query per workload), "regressor"
            (regression on log step time) or "residual" (regression on
            log(step time / the `sim_step_time_s` feature), the simulator's
            error; needs that feature).
        params: LightGBM parameters overriding the defaults (not the
            objective, which `kind` decides).
        num_boost_round: Boosting rounds.
        seed: Seed of every random choice LightGBM makes.

    Training is deterministic by default (`deterministic=True`,
    `num_threads=1`): the same data and seed give the same model.

    Example:
        >>> model = CostModel("ranker", num_boost_round=100)       # doctest: +SKIP
        >>> model.fit(X, times, workloads, names).evaluate(X2, times2, workloads2)  # doctest: +SKIP
        {'pairwise_accuracy': 0.91, 'kendall_tau': 0.83, ...}
    """

    def __init__(self, kind: Literal["ranker", "regressor", "residual"] = "ranker",
                 params: Mapping[str, Any] | None = None, num_boost_round: int = 200,
                 seed: int = 0) -> None:
        if kind not in _KINDS:
            raise CostModelError(f"kind must be one of {list(_KINDS)}. "
                                 f"Received: {short_repr(kind)}")
        if isinstance(num_boost_round, bool) or not isinstance(num_boost_round, int) \
                or num_boost_round < 1:
            raise CostModelError(f"num_boost_round must be a positive integer. "
                                 f"Received: {short_repr(num_boost_round)}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise CostModelError(f"seed must be an integer. Received: {short_repr(seed)}")
        params = dict(params or {})
        reserved = sorted(set(params) & set(_RESERVED_PARAMS))
        if reserved:
            raise CostModelError(f"params may not set {reserved}: kind={kind!r} decides the "
                                 "objective")
        try:
            json.dumps(params, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as e:
            why = "nested too deeply" if isinstance(e, RecursionError) else shorten(str(e), 300)
            raise CostModelError(f"params must be JSON-able (they are saved with the model): "
                                 f"{why}") from e
        self._kind = kind
        self._params = params
        self._num_boost_round = num_boost_round
        self._seed = seed
        self._booster = None
        # The text a loaded model was read from (LightGBM parsed a rebuilt copy,
        # which leaves out fields no prediction reads): what `to_json` writes back.
        self._model_text: str | None = None
        self._feature_names: list[str] = []
        self._train_params: dict[str, Any] = {}
        self._training: dict[str, Any] = {}

    # ---------------------------------------------------------- accessors
    @property
    def kind(self) -> str:
        return self._kind

    @property
    def feature_names(self) -> list[str]:
        """The feature names the model was trained with ([] before `fit`)."""
        return list(self._feature_names)

    @property
    def is_fitted(self) -> bool:
        return self._booster is not None

    @property
    def training_stats(self) -> dict[str, Any]:
        """Facts about the training data: rows, workloads, step-time range, train metrics."""
        return dict(self._training)

    @property
    def notes(self) -> dict[str, str]:
        """Notes saved with the model (e.g. "shipped_because": the rule that shipped it)."""
        notes = self._training.get("notes", {})
        return {str(k): str(v) for k, v in notes.items()} if isinstance(notes, dict) else {}

    def annotate(self, **notes: str) -> CostModel:
        """Adds notes saved with the model (after `fit`; a later `fit` drops them).

        Returns:
            self.
        """
        self._require_fitted()
        self._training["notes"] = dict(self.notes, **{k: str(v) for k, v in notes.items()})
        return self

    @property
    def params(self) -> dict[str, Any]:
        """The LightGBM parameters of the last `fit` (the defaults merged with `params`)."""
        return dict(self._train_params) if self._train_params else self._lgb_params(1)

    def _lgb_params(self, max_group_size: int) -> dict[str, Any]:
        params: dict[str, Any] = {
            "learning_rate": 0.1,
            "num_leaves": 15,
            "min_data_in_leaf": 5,
            "min_sum_hessian_in_leaf": 1e-6,
            "deterministic": True,
            "force_row_wise": True,
            "num_threads": 1,
            "seed": self._seed,
            "verbose": -1,
        }
        if self._kind == "ranker":
            params.update({
                "objective": "lambdarank",
                # Linear gain: every place in a workload's order matters, not only the top.
                "label_gain": [float(i) for i in range(_RELEVANCE_LEVELS)],
                # Consider all pairs of a query, not only those with a top-30 item.
                "lambdarank_truncation_level": max(max_group_size, 1),
                "metric": "ndcg",
            })
        else:
            params.update({"objective": "regression", "metric": "l2"})
        params.update(self._params)
        return params

    # ------------------------------------------------------------ training
    def fit(self, X: Any, step_times: Any, workloads: Sequence[str],
            feature_names: Sequence[str], init_model: CostModel | None = None) -> CostModel:
        """Trains on measured trials (replacing any earlier training).

        Args:
            X: Feature matrix, shape (n, f).
            step_times: Measured step time of each row in seconds, shape (n,), positive.
            workloads: The workload of each row (`TrialRecord.workload`).
            feature_names: The f column names, unique.
            init_model: Continue boosting from this fitted model of the same
                kind and features (e.g. the shipped model, refined with a
                user's own trials) instead of starting from nothing.

        Returns:
            self.

        Raises:
            CostModelError: On shape mismatch, non-finite values, non-positive
                step times, duplicate feature names, or too little data (a
                ranker needs a workload with two trials of different times; a
                regressor or residual model two rows), or, for a residual
                model, no positive `sim_step_time_s` feature.
        """
        X = as_matrix(X)
        times = as_vector(step_times, "step_times")
        names = as_names(workloads)
        features = _feature_name_list(feature_names)
        check_same_length(("X rows", X), ("step_times", times), ("workloads", names))
        if X.shape[1] != len(features):
            raise CostModelError(f"X has {X.shape[1]} columns but {len(features)} feature names "
                                 f"were given: {features}")
        bad = np.flatnonzero(times <= 0)
        if bad.size:
            raise CostModelError(f"step_times must be positive seconds. Received "
                                 f"{times[bad[0]]} at row {bad[0]}")
        groups = group_indices(names)
        if self._kind == "ranker":
            rankable = [idx for idx in groups if len(np.unique(times[idx])) > 1]
            if not rankable:
                raise CostModelError(
                    "a ranker needs at least one workload with two trials of different step "
                    f"times. Received {len(names)} rows in {len(groups)} workloads, "
                    f"largest has {max((len(i) for i in groups), default=0)} rows")
        elif len(times) < 2:
            raise CostModelError(f"a {self._kind} needs at least 2 rows. "
                                 f"Received: {len(times)}")
        base = _simulator_times(X, features, "X") if self._kind == "residual" else None

        if init_model is not None and (not init_model.is_fitted or init_model.kind != self._kind
                                       or init_model.feature_names != features):
            raise CostModelError(
                f"init_model must be a fitted {self._kind} with features {features}. Received: "
                f"{init_model.kind if init_model.is_fitted else 'an unfitted'} model with "
                f"features {init_model.feature_names if init_model.is_fitted else []}")
        lgb = _lightgbm()
        order = np.concatenate(groups)              # rows of a workload must be contiguous
        params = self._lgb_params(max(len(idx) for idx in groups))
        if self._kind == "ranker":
            label = relevance_labels(times, names)[order]
            group = [len(idx) for idx in groups]
        elif base is not None:
            label = np.log(times[order]) - np.log(base[order])
            group = None
        else:
            label = np.log(times[order])
            group = None
        dataset = lgb.Dataset(X[order], label=label, group=group,
                              feature_name=[f"f{i}" for i in range(len(features))],
                              params={"feature_pre_filter": False, "verbose": -1,
                                      "seed": self._seed, "num_threads": params["num_threads"]},
                              free_raw_data=True)
        try:
            booster = lgb.train(params, dataset, num_boost_round=self._num_boost_round,
                                init_model=init_model._booster if init_model else None)  # noqa: SLF001
        except lgb.basic.LightGBMError as e:
            raise CostModelError(f"LightGBM failed to train the {self._kind}: {e}") from e
        self._booster = booster
        self._model_text = None
        self._feature_names = features
        self._train_params = params
        train_pred = self.predict(X)
        self._training = {
            "num_rows": int(len(times)),
            "num_workloads": len(groups),
            "min_step_time_s": float(times.min()),
            "max_step_time_s": float(times.max()),
            "train_pairwise_accuracy": _json_float(pairwise_accuracy(train_pred, times, names)),
            "train_kendall_tau": _json_float(kendall_tau(train_pred, times, names)),
        }
        return self

    # ---------------------------------------------------------- inference
    def predict(self, X: Any) -> np.ndarray:
        """Predictions for the rows of X, LOWER = predicted FASTER.

        Args:
            X: Feature matrix, shape (n, f), columns in `feature_names` order.

        Returns:
            For a regressor or residual model, predicted step times in seconds;
            for a ranker, the negated ranking score (comparable only within
            one workload).

        Raises:
            CostModelError: X has the wrong number of columns, or (residual)
                a non-positive simulator step time.
        """
        booster = self._require_fitted()
        X = as_matrix(X)
        if X.shape[1] != len(self._feature_names):
            raise CostModelError(f"X has {X.shape[1]} columns; the model was trained with "
                                 f"{len(self._feature_names)} features: {self._feature_names}")
        if len(X) == 0:
            return np.zeros(0, dtype=np.float64)
        raw = np.asarray(booster.predict(X, num_threads=self._train_params.get("num_threads", 1)),
                         dtype=np.float64)
        if self._kind == "ranker":
            return -raw
        if self._kind == "residual":
            return _simulator_times(X, self._feature_names, "X") * np.exp(raw)
        return np.exp(raw)

    def evaluate(self, X: Any, step_times: Any, workloads: Sequence[str]) -> dict[str, float]:
        """Ranking quality on measured trials (and log-time error for seconds).

        Returns:
            {"pairwise_accuracy", "kendall_tau", "num_rows", "num_workloads"},
            plus "log_rmse" for a regressor or residual model.
        """
        pred = self.predict(X)
        times = as_vector(step_times, "step_times")
        names = as_names(workloads)
        check_same_length(("X rows", pred), ("step_times", times), ("workloads", names))
        out = {"pairwise_accuracy": pairwise_accuracy(pred, times, names),
               "kendall_tau": kendall_tau(pred, times, names),
               "num_rows": float(len(times)),
               "num_workloads": float(len(set(names)))}
        if self._kind in _SECONDS_KINDS:
            out["log_rmse"] = log_rmse(pred, times)
        return out

    def feature_importance(self, importance_type: Literal["gain", "split"] = "gain"
                           ) -> dict[str, float]:
        """Importance of each feature by name (total gain, or number of splits)."""
        booster = self._require_fitted()
        if importance_type not in ("gain", "split"):
            raise CostModelError(f"importance_type must be 'gain' or 'split'. "
                                 f"Received: {importance_type!r}")
        values = booster.feature_importance(importance_type=importance_type)
        return {name: float(v) for name, v in zip(self._feature_names, values)}

    def check_features(self, names: Sequence[str]) -> None:
        """Raises `CostModelError` unless `names` are exactly the model's features, in order."""
        self._require_fitted()
        names = _feature_name_list(names)
        if names == self._feature_names:
            return
        missing = [n for n in self._feature_names if n not in names]
        unexpected = [n for n in names if n not in self._feature_names]
        detail = (f"missing {missing}, unexpected {unexpected}" if missing or unexpected
                  else "same names in a different order")
        raise CostModelError(f"the cost model was trained with features {self._feature_names}; "
                             f"the caller has {names} ({detail})")

    # ------------------------------------------------ the search's role
    @property
    def name(self) -> str:
        """"lightgbm-ranker", "lightgbm-regressor" or "lightgbm-residual"."""
        return f"lightgbm-{self._kind}"

    @property
    def predicts_seconds(self) -> bool:
        """A regressor or residual model predicts seconds; a ranker only orders."""
        return self._kind in _SECONDS_KINDS

    def predict_candidates(self, simulator: Simulator, candidates: np.ndarray,
                           prediction: Prediction | None = None) -> np.ndarray:
        """`predict` of the candidates' features (`autodist.search.features.featurize`)."""
        return np.asarray(self.predict(featurize(simulator, candidates, prediction)))

    def update(self, records: Sequence[TrialRecord], seed: int = 0) -> CostModel:
        """A model of the same kind trained on `records`, boosting on from this one.

        A fitted model with this autodist's features continues (e.g. the
        shipped model refined with a user's own trials) rather than being
        replaced by a model of these few workloads.
        """
        x, y, workloads = training_rows(records)
        init = self if self.is_fitted and self._feature_names == list(FEATURE_NAMES) else None
        return CostModel(kind=self._kind, seed=seed).fit(x, y, workloads, FEATURE_NAMES,
                                                          init_model=init)

    # ------------------------------------------------------- persistence
    def to_json(self) -> str:
        """The model and its metadata as one JSON document (what `save` writes)."""
        booster = self._require_fitted()
        lgb = _lightgbm()
        model = self._model_text or booster.model_to_string()
        return json.dumps({
            "format": _FORMAT,
            "version": COST_MODEL_FORMAT_VERSION,
            "kind": self._kind,
            "feature_names": self._feature_names,
            "params": self._params,
            "train_params": self._train_params,
            "num_boost_round": self._num_boost_round,
            "seed": self._seed,
            "training": self._training,
            "lightgbm_version": lgb.__version__,
            "model": model,
            "model_sha256": hashlib.sha256(model.encode()).hexdigest(),
        }, indent=1, sort_keys=True, allow_nan=False)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the model atomically to one file (JSON metadata + LightGBM model string)."""
        atomic_write(path, self.to_json().encode())

    @classmethod
    def from_json(cls, text: str, source: str = "cost model JSON",
                  feature_names: Sequence[str] | None = None, *, verify: bool = True) -> CostModel:
        """Inverse of `to_json`; checks `feature_names` when given.

        Every field is checked, and the model text's checksum verified; LightGBM
        then parses only the model rebuilt from the text's checked values
        (`lightgbm_text.canonical_model_text`), never the text itself.

        Args:
            text: The document.
            source: Names the document in errors.
            feature_names: If given, the features the caller will pass.
            verify: Require the checksum (format version 2). False also reads
                version-1 documents, which have none.

        Raises:
            CostModelError: naming the field and the value received.
        """
        try:
            data = json.loads(text, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as e:
            why = "nested too deeply" if isinstance(e, RecursionError) else shorten(str(e), 300)
            raise CostModelError(f"{source} is not a saved cost model (not JSON): {why}") from e
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise CostModelError(f"{source} is not a saved cost model (no format {_FORMAT!r})")
        version = data.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise CostModelError(f"{source} has an invalid version {short_repr(version)}")
        if version > COST_MODEL_FORMAT_VERSION:
            raise CostModelError(f"{source} has format version {version}, newer than "
                                 f"{COST_MODEL_FORMAT_VERSION}, the newest this autodist reads")
        missing = [k for k in ("kind", "feature_names", "params", "train_params",
                               "num_boost_round", "seed", "training", "model") if k not in data]
        if missing:
            raise CostModelError(f"{source} misses fields {missing}")
        for key in ("params", "train_params", "training"):
            if not isinstance(data[key], dict):
                raise CostModelError(f"{source}: {key} must be a JSON object. "
                                     f"Received: {short_repr(data[key])}")
        threads = data["train_params"].get("num_threads", 1)
        if isinstance(threads, bool) or not isinstance(threads, int) or \
                not 1 <= threads <= _MAX_THREADS:
            raise CostModelError(f"{source}: train_params.num_threads must be an integer in "
                                 f"[1, {_MAX_THREADS}]. Received: {short_repr(threads)}")
        model_text = data["model"]
        if not isinstance(model_text, str) or not model_text:
            raise CostModelError(f"{source}: model must be the LightGBM model text. "
                                 f"Received: {short_repr(model_text)}")
        _verify_checksum(data, model_text, source, verify)
        feature_list = _feature_name_list(data["feature_names"])
        try:
            model = cls(data["kind"], data["params"], data["num_boost_round"], data["seed"])
        except CostModelError as e:
            raise CostModelError(f"{source}: {e}") from e
        if model.kind == "residual" and SIMULATOR_FEATURE not in feature_list:
            raise CostModelError(f"{source}: a residual model needs the feature "
                                 f"{SIMULATOR_FEATURE!r}. Received feature_names: "
                                 f"{short_repr(feature_list)}")
        # LightGBM's parser trusts its input (a bad index aborts the process): it
        # only parses text rebuilt from checked values.
        safe_text = canonical_model_text(model_text, len(feature_list), source=source)
        lgb = _lightgbm()
        try:
            model._booster = lgb.Booster(model_str=safe_text)
            model._model_text = model_text
        except lgb.basic.LightGBMError as e:
            raise CostModelError(f"{source} holds a LightGBM model that cannot be read: "
                                 f"{shorten(str(e), 300)}") from e
        model._feature_names = feature_list
        if model._booster.num_feature() != len(model._feature_names):
            raise CostModelError(f"{source}: the LightGBM model has "
                                 f"{model._booster.num_feature()} features, the metadata "
                                 f"{len(model._feature_names)}")
        model._train_params = dict(data["train_params"])
        model._training = dict(data["training"])
        if feature_names is not None:
            model.check_features(feature_names)
        return model

    @classmethod
    def load(cls, path: str | os.PathLike, feature_names: Sequence[str] | None = None, *,
             verify: bool = True) -> CostModel:
        """Reads a model written by `save`.

        The model text's checksum is verified before LightGBM parses it.

        Args:
            path: The file.
            feature_names: If given, the features the caller will pass; a model
                trained with other features raises `CostModelError`.
            verify: See `from_json` (False reads files without a checksum).

        Raises:
            CostModelError: The file is missing, damaged or malformed (naming
                the field and the value), or its features differ.
        """
        path = pathlib.Path(path)
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise CostModelError(f"cannot read cost model file {str(path)!r}: {e}") from e
        return cls.from_json(text, source=f"cost model file {str(path)!r}",
                             feature_names=feature_names, verify=verify)

    def _require_fitted(self):
        if self._booster is None:
            raise CostModelError(f"this {self._kind} cost model is not trained; call fit first")
        return self._booster

    def __repr__(self) -> str:
        state = (f"{len(self._feature_names)} features, {self._training.get('num_rows')} rows"
                 if self.is_fitted else "not fitted")
        return f"CostModel(kind={self._kind!r}, {state})"


def _feature_name_list(names: Sequence[str]) -> list[str]:
    if isinstance(names, (str, bytes)):
        raise CostModelError(f"feature_names must be a sequence of names, not one string. "
                             f"Received: {short_repr(names)}")
    try:
        out = list(names)
    except TypeError as e:
        raise CostModelError(f"feature_names must be a sequence of names. "
                             f"Received: {short_repr(names)}") from e
    bad = [n for n in out if not isinstance(n, str) or not n]
    if bad:
        raise CostModelError(f"feature names must be non-empty strings. "
                             f"Received: {short_repr(bad)}")
    dupes = sorted(n for n, count in collections.Counter(out).items() if count > 1)
    if dupes:
        raise CostModelError(f"feature names must be unique. "
                             f"Received duplicates: {short_repr(dupes)}")
    return out


def _verify_checksum(data: Mapping[str, Any], model_text: str, source: str,
                     verify: bool) -> None:
    """Raises CostModelError unless the model text matches its recorded checksum."""
    recorded = data.get("model_sha256")
    if recorded is None:
        if verify:
            raise CostModelError(
                f"{source} has no model checksum (format version {data['version']}, written "
                "by an older autodist); load it with verify=False and save it again")
        return
    actual = hashlib.sha256(model_text.encode("utf-8", "surrogatepass")).hexdigest()
    if recorded != actual:
        raise CostModelError(f"{source} is damaged: the model text's sha256 is {actual}, the "
                             f"file records {short_repr(recorded, 80)}")


def _simulator_times(X: np.ndarray, feature_names: Sequence[str], name: str) -> np.ndarray:
    """The simulator's step times a residual model corrects: X's `SIMULATOR_FEATURE` column."""
    if SIMULATOR_FEATURE not in feature_names:
        raise CostModelError(f"a residual model needs the feature {SIMULATOR_FEATURE!r} (the "
                             f"simulator's step time) among its features. Received: "
                             f"{short_repr(list(feature_names))}")
    base = X[:, list(feature_names).index(SIMULATOR_FEATURE)]
    bad = np.flatnonzero(base <= 0)
    if bad.size:
        raise CostModelError(f"{name} column {SIMULATOR_FEATURE!r} must hold positive seconds. "
                             f"Received {base[bad[0]]} at row {bad[0]}")
    return base


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number a saved cost model holds")


def _json_float(value: float) -> float | None:
    return value if math.isfinite(value) else None


# ---------------------------------------------------------- cross-validation
def leave_one_group_out(X: Any, step_times: Any, workloads: Sequence[str], groups: Sequence[str],
                        feature_names: Sequence[str], *,
                        make_model: Callable[[], CostModel] | None = None
                        ) -> dict[str, dict[str, float]]:
    """Trains without each group and evaluates on it (e.g. leave-one-model-out).

    Args:
        X, step_times, workloads, feature_names: As for `CostModel.fit`.
        groups: The group of each row (e.g. `TrialRecord.model_name`). Every
            workload must lie in one group, so no workload is in both the
            training and the held-out rows.
        make_model: Returns a fresh untrained model; default `CostModel()`.

    Returns:
        group -> the held-out `evaluate` metrics plus "num_train_rows", in
        order of first appearance.
    """
    X = as_matrix(X)
    times = as_vector(step_times, "step_times")
    names = as_names(workloads)
    group_names = as_names(groups)
    check_same_length(("X rows", X), ("step_times", times), ("workloads", names),
                 ("groups", group_names))
    group_of: dict[str, str] = {}
    for workload, group in zip(names, group_names):
        if group_of.setdefault(workload, group) != group:
            raise CostModelError(f"workload {workload!r} lies in groups {group_of[workload]!r} "
                                 f"and {group!r}; each workload must lie in one group")
    distinct = list(dict.fromkeys(group_names))
    if len(distinct) < 2:
        raise CostModelError(f"leave_one_group_out needs at least 2 groups. "
                             f"Received: {distinct}")
    make_model = make_model or CostModel
    labels = np.asarray(group_names, dtype=object)
    results: dict[str, dict[str, float]] = {}
    for group in distinct:
        test = labels == group
        train = ~test
        model = make_model()
        model.fit(X[train], times[train], [n for n, t in zip(names, train) if t], feature_names)
        metrics = model.evaluate(X[test], times[test], [n for n, t in zip(names, test) if t])
        metrics["num_train_rows"] = float(train.sum())
        results[group] = metrics
    return results


# ------------------------------------------------------------ the simulator
_SIMULATOR_FORMAT = "autodist.simulator_cost_model"


class SimulatorCostModel(Predictor):
    """The analytic simulator as a cost model: its predicted step time, in seconds.

    It has no state of its own: the workload's `Simulator` (its calibration
    and batch size) is the context every prediction is made in. It learns
    nothing from trials; `update` returns a LightGBM model of kind
    `refit_kind` trained on them.

    Args:
        refit_kind: The kind of LightGBM model `update` trains ("regressor":
            it predicts seconds, as the simulator does; "residual" learns
            the simulator's error; "ranker").

    Example:
        >>> plan = autodist.optimize(model, cost_model=SimulatorCostModel())  # doctest: +SKIP
    """

    def __init__(self, refit_kind: Literal["ranker", "regressor", "residual"] = "regressor"
                 ) -> None:
        if refit_kind not in _KINDS:
            raise CostModelError(f"refit_kind must be one of {list(_KINDS)}. "
                                 f"Received: {refit_kind!r}")
        self.refit_kind = refit_kind

    @property
    def name(self) -> str:
        return "simulator"

    @property
    def predicts_seconds(self) -> bool:
        return True

    def predict_candidates(self, simulator: Simulator, candidates: np.ndarray,
                           prediction: Prediction | None = None) -> np.ndarray:
        """The simulator's step times (seconds) of the candidates."""
        if prediction is None:
            prediction = simulator.predict(candidates)
        return np.asarray(prediction.step_time_s)

    def update(self, records: Sequence[TrialRecord], seed: int = 0) -> CostModel:
        """A fresh LightGBM model of kind `refit_kind` trained on `records`."""
        x, y, workloads = training_rows(records)
        return CostModel(kind=self.refit_kind, seed=seed).fit(x, y, workloads, FEATURE_NAMES)

    def save(self, path: str | os.PathLike) -> None:
        """Writes a small JSON file naming the simulator (and `refit_kind`)."""
        atomic_write(path, json.dumps({"format": _SIMULATOR_FORMAT, "version": 1,
                                       "refit_kind": self.refit_kind}).encode())

    @classmethod
    def load(cls, path: str | os.PathLike) -> SimulatorCostModel:
        """Reads a file written by `save`."""
        path = pathlib.Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise CostModelError(f"cannot read cost model file {str(path)!r}: {e}") from e
        if not isinstance(data, dict) or data.get("format") != _SIMULATOR_FORMAT:
            raise CostModelError(f"cost model file {str(path)!r} is not a saved simulator "
                                 f"(no format {_SIMULATOR_FORMAT!r})")
        return cls(data.get("refit_kind", "regressor"))

    def __repr__(self) -> str:
        return f"SimulatorCostModel(refit_kind={self.refit_kind!r})"


# ------------------------------------------------- what optimize accepts
SHIPPED_COST_MODEL = pathlib.Path(__file__).parent / "data" / "cost_model.txt"


def load_cost_model(path: str | os.PathLike) -> Predictor:
    """Reads a saved predictor: a LightGBM `CostModel` or a `SimulatorCostModel`."""
    path = pathlib.Path(path)
    try:
        head = path.read_text()[:4096]
    except (OSError, UnicodeDecodeError) as e:
        raise CostModelError(f"cannot read cost model file {str(path)!r}: {e}") from e
    if _SIMULATOR_FORMAT in head:
        return SimulatorCostModel.load(path)
    return CostModel.load(path)


# What orders the candidates a measured search measures (`optimize(measure=True)`,
# `autodist search --trials k`), shipped by its own rule.
SHIPPED_MEASURED_SEARCH_MODEL = pathlib.Path(__file__).parent / "data" / "measured_search_model.txt"


def shipped_cost_model() -> CostModel | None:
    """The LightGBM model shipped with the package, or None while none is shipped."""
    return CostModel.load(SHIPPED_COST_MODEL) if SHIPPED_COST_MODEL.exists() else None


def shipped_measured_search_model(path: str | os.PathLike | None = None
                                  ) -> tuple[CostModel | None, str]:
    """The shipped model that orders a measured search's candidates, and why it does or not.

    A file that cannot be used (damaged, of a newer format, trained with
    other features) is skipped with a `RuntimeWarning`: the ranking model
    then orders the measured candidates, as when none ships.

    Args:
        path: The file (default: the package's `SHIPPED_MEASURED_SEARCH_MODEL`).

    Returns:
        (the model or None, a sentence saying why it orders them or why none does).
    """
    path = pathlib.Path(SHIPPED_MEASURED_SEARCH_MODEL if path is None else path)
    if not path.exists():
        return None, ("no measured-search model ships (benchmarks/train_cost_model.py ships "
                      "one only where it beats the simulator with k measured trials)")
    try:
        model = CostModel.load(path, FEATURE_NAMES)
    except CostModelError as e:
        warnings.warn(f"the shipped measured-search model is not used: {e}; the ranking "
                      "model orders the measured candidates", RuntimeWarning, stacklevel=2)
        return None, f"the shipped measured-search model {path.name} could not be used ({e})"
    why = model.notes.get("shipped_because", "shipped by benchmarks/train_cost_model.py")
    return model, f"the shipped measured-search model: {why}"


class DefaultCostModel(Predictor):
    """The shipped defaults, what `optimize(cost_model=None)` and the CLI rank with.

    It ranks as `ranking` (the shipped `CostModel`, else the simulator) and
    carries `measured_search`, the model shipped to order the candidates a
    measured search measures (None: `ranking` orders them), which the
    `Tuner` takes apart.

    Args:
        ranking: What ranks predictions (the pick without trials, seconds).
        measured_search: What orders the measured candidates, or None.
        measured_search_why: Why `measured_search` orders them, or why none does.
    """

    def __init__(self, ranking: Predictor, measured_search: Predictor | None = None,
                 measured_search_why: str = "") -> None:
        if isinstance(ranking, DefaultCostModel):
            raise CostModelError("a DefaultCostModel's ranking model is a plain predictor")
        self.ranking = ranking
        self.measured_search = measured_search
        self.measured_search_why = measured_search_why

    @property
    def name(self) -> str:
        return self.ranking.name

    @property
    def predicts_seconds(self) -> bool:
        return self.ranking.predicts_seconds

    def predict_candidates(self, simulator: Simulator, candidates: np.ndarray,
                           prediction: Prediction | None = None) -> np.ndarray:
        return self.ranking.predict_candidates(simulator, candidates, prediction)

    def check_features(self, names: Sequence[str]) -> None:
        self.ranking.check_features(names)
        if self.measured_search is not None:
            self.measured_search.check_features(names)

    def update(self, records: Sequence[TrialRecord], seed: int = 0) -> Predictor:
        return self.ranking.update(records, seed)

    def save(self, path: str | os.PathLike) -> None:
        """Saves the ranking model (the measured-search model ships in its own file)."""
        self.ranking.save(path)

    def __repr__(self) -> str:
        return f"DefaultCostModel({self.ranking!r}, measured_search={self.measured_search!r})"


def shipped_defaults() -> DefaultCostModel:
    """The shipped defaults: the shipped ranking model (else the simulator) and the
    shipped measured-search model (else none)."""
    shipped = shipped_cost_model()
    measured, why = shipped_measured_search_model()
    return DefaultCostModel(shipped if shipped is not None else SimulatorCostModel(),
                            measured, why)


def resolve_cost_model(value: Predictor | str | os.PathLike | None) -> Predictor:
    """The predictor that `value` names.

    Args:
        value: A `Predictor` (returned as is); "simulator" for a
            `SimulatorCostModel`; a path to a file written by a predictor's
            `save`; or None for the shipped defaults (`shipped_defaults`: the
            shipped model when the package has one, else the simulator, and
            the shipped measured-search model, if any, which orders the
            candidates a measured search measures).

    Raises:
        CostModelError: The file cannot be read or is no saved cost model.
    """
    if isinstance(value, Predictor):
        return value
    if value is None:
        return shipped_defaults()
    if isinstance(value, str) and value == "simulator":
        return SimulatorCostModel()
    if isinstance(value, (str, os.PathLike)):
        return load_cost_model(value)
    raise CostModelError(f"cost_model must be a Predictor (CostModel, SimulatorCostModel), "
                         f"'simulator', a path or None. Received: {type(value).__name__}")
