"""Features of (GraphItem, ResourceSpec, Strategy) for the learned cost model.

One row per candidate, in the fixed order of `FEATURE_NAMES`: the
simulator's parts and the traffic behind them (per-node bytes and their
max/sum weighted by bandwidth, all-reduce groups and bytes, messages per
step, sparse traffic, the PS imbalance), the consistency, and the workload's
shape (model size, sparse fraction, compute estimate, cluster shape,
bandwidth). Everything is computed vectorised from the simulator's tables,
so featurising costs about as much as scoring.
"""
from __future__ import annotations

import numpy as np

from autodist.ir.strategy import Strategy
from autodist.search.simulator import Prediction, Simulator

# Per-candidate quantities taken from the simulator's parts.
_PART_FEATURES = (
    "compute_s", "bandwidth_s", "latency_s", "update_s", "sync_s", "phase_s",
    "max_node_bytes", "sum_node_bytes", "ps_bytes", "ps_shards", "ps_messages_max",
    "messages", "ar_bytes", "ar_groups", "ag_payload", "ag_count", "ps_vars", "ar_vars",
    "sparse_ps_bytes", "var_bytes_on_ps", "ps_imbalance", "sync", "staleness",
)
# Derived per-candidate features.
_DERIVED_FEATURES = ("sim_step_time_s", "sim_lower_bound_s", "sim_comm_over_compute",
                     "frac_var_bytes_on_ps")
# Properties of the workload, equal for every candidate of one space.
_WORKLOAD_FEATURES = (
    "num_variables", "total_var_bytes", "sparse_var_fraction", "flops_per_replica",
    "per_replica_batch", "num_replicas", "num_nodes", "num_ps_devices",
    "min_bandwidth_bytes_per_s", "mean_bandwidth_bytes_per_s",
)

FEATURE_NAMES: tuple[str, ...] = _PART_FEATURES + _DERIVED_FEATURES + _WORKLOAD_FEATURES


def featurize(simulator: Simulator, candidates: np.ndarray,
              prediction: Prediction | None = None) -> np.ndarray:
    """The (N, len(FEATURE_NAMES)) feature matrix of a candidate matrix.

    Args:
        simulator: The simulator of the candidates' space.
        candidates: An (N, V + 1) candidate matrix.
        prediction: The simulator's prediction for `candidates`, when the
            caller already has it.
    """
    if prediction is None:
        prediction = simulator.predict(candidates)
    n = len(prediction.step_time_s)
    parts = prediction.parts
    columns = [parts[name] for name in _PART_FEATURES]
    total_bytes = float(simulator.space.graph_item.total_variable_bytes) or 1.0
    columns += [prediction.step_time_s, prediction.lower_bound_s,
                (prediction.step_time_s - parts["compute_s"]) / max(simulator.compute_s, 1e-12),
                parts["var_bytes_on_ps"] / total_bytes]
    workload = workload_features(simulator)
    columns += [np.full(n, workload[name]) for name in _WORKLOAD_FEATURES]
    return np.stack(columns, axis=1).astype(np.float64)


def workload_features(simulator: Simulator) -> dict[str, float]:
    """The features every candidate of the simulator's workload shares."""
    space = simulator.space
    gi = space.graph_item
    total = float(gi.total_variable_bytes)
    sparse = float(sum(v.byte_size for v in gi.variables if v.sparse_gradient))
    estimate = gi.estimate_batch_size
    return {
        "num_variables": float(len(gi.variables)),
        "total_var_bytes": total,
        "sparse_var_fraction": sparse / total if total else 0.0,
        "flops_per_replica": gi.total_flops * simulator.per_replica_batch / estimate,
        "per_replica_batch": float(simulator.per_replica_batch),
        "num_replicas": float(simulator.num_replicas),
        "num_nodes": float(simulator.num_nodes),
        "num_ps_devices": float(len(space.ps_devices)),
        "min_bandwidth_bytes_per_s": float(simulator.bandwidth.min()),
        "mean_bandwidth_bytes_per_s": float(simulator.bandwidth.mean()),
    }


def featurize_strategy(simulator: Simulator, strategy: Strategy) -> dict[str, float]:
    """The named features of one Strategy (its choices are added to the space)."""
    row = featurize(simulator, simulator.space.encode(strategy)[None, :])[0]
    return dict(zip(FEATURE_NAMES, (float(x) for x in row)))
