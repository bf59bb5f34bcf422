"""Calibrates the simulator on the cluster it plans for, and caches the result.

`calibrate_cluster(spec)` measures, in one to two minutes on a local
cluster:

* the rates in this process (`calibrate.measure_calibration`: one core's
  FLOP rate for matmuls and for convolutions, the cost of an op, the
  optimizer update rate), with the host's cores, so CPU replicas that
  outnumber them share them;
* the fixed costs of a step on the cluster itself, each measured the way a
  real strategy pays it, from probe models trained a few steps under probe
  strategies switched in place, in two launches, each launch's probes
  interleaved over two rounds: a small model (an embedding and three small
  dense layers: 7 variables, as few as the trial workloads have, so that
  collectives and PS messages overlap each other no more than theirs) under
  all-reduce in one, two and three fused groups (a collective hop: their
  differences) and with parameter servers the PS builder (a PS message) and
  Parallax (the extra session run of a step that mixes PS and all-reduce);
  the same model with two 512-wide layers (megabytes per step: the CPU's
  time per byte moved, beyond the link's, from its all-reduce against its
  PS step) and a thousand cheap elementwise ops on an activation-sized
  tensor (the cost of an op in a worker's step, against the small model),
  under all-reduce and PS.
  `search.calibration_fit` fits the costs to the measured steps.

The result is written to the calibration cache, keyed by the ResourceSpec's
fingerprint (`cache_path`), and `autodist.optimize` uses a cached
calibration of its spec when it is given none. Only local clusters are
measured so far (the runner launches local task processes).
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import warnings
from typing import Callable

import numpy as np

from autodist.ir.atomic import NotRegularFileError, atomic_write, read_regular
from autodist.ir.errors import AutodistError, InvalidArgumentError
from autodist.ir.resource_spec import ResourceSpec
from autodist.search.calibration_fit import (ProbeStep, all_reduce_in_groups, fit_fixed_costs,
                                             probe_step)
from autodist.search.measured_compute import MeasuredCompute
from autodist.search.simulator import Calibration, Simulator
from autodist.search.space import SearchSpace

CACHE_VERSION = 1
# The environment variable that moves the cache (default: $XDG_CACHE_HOME/autodist).
CACHE_ENV = "AUTODIST_CACHE_DIR"
_MAX_CACHE_BYTES = 1 << 20
# Width of the wide probe model's layers (a 1 MiB kernel).
WIDE_UNITS = 512
# Elementwise blocks of the op-heavy probe model (about 1,000 ops more), and the
# values per example they work on.
OP_BLOCKS = 100
CHAIN_WIDTH = 2048


class CalibrationError(AutodistError, ValueError):
    """A calibration could not be measured, or a calibration file is not one."""


def cache_dir() -> pathlib.Path:
    """Where calibrations are cached: $AUTODIST_CACHE_DIR, else $XDG_CACHE_HOME/autodist,
    else ~/.cache/autodist."""
    if os.environ.get(CACHE_ENV):
        return pathlib.Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "autodist"


def cache_path(spec: ResourceSpec) -> pathlib.Path:
    """The cached calibration file of `spec`."""
    return cache_dir() / "calibration" / f"{spec.fingerprint}.json"


def save_calibration(spec: ResourceSpec, calibration: Calibration,
                     report: dict[str, object] | None = None) -> pathlib.Path:
    """Writes `calibration` as `spec`'s cached calibration (atomically); returns the path."""
    path = cache_path(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"version": CACHE_VERSION, "resource_spec_fingerprint": spec.fingerprint,
              "calibration": calibration.to_dict(), "report": report or {}}
    atomic_write(path, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())
    return path


def load_calibration(path: str | os.PathLike, spec: ResourceSpec | None = None) -> Calibration:
    """The calibration in a file `save_calibration` wrote.

    Args:
        path: The file.
        spec: When given, the file must have been measured on it.

    Raises:
        CalibrationError: Unreadable, not a calibration, of a newer version
            or of another cluster (each named, with the path).
    """
    path = pathlib.Path(path)
    try:
        raw = read_regular(path, _MAX_CACHE_BYTES + 1)
    except NotRegularFileError:
        raise CalibrationError(f"calibration file {path} is not a regular file") from None
    except OSError as e:
        raise CalibrationError(f"calibration file {path} cannot be read: {e}") from None
    if len(raw) > _MAX_CACHE_BYTES:
        raise CalibrationError(f"calibration file {path} is larger than {_MAX_CACHE_BYTES} bytes")
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CalibrationError(f"calibration file {path} is not readable JSON: "
                               f"{type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(record, dict) or not isinstance(record.get("version"), int):
        raise CalibrationError(f"calibration file {path} has no version")
    if record["version"] > CACHE_VERSION:
        raise CalibrationError(f"calibration file {path} has version {record['version']}, "
                               f"newer than {CACHE_VERSION}, the newest this autodist reads")
    if spec is not None and record.get("resource_spec_fingerprint") != spec.fingerprint:
        raise CalibrationError(f"calibration file {path} was measured on cluster "
                               f"{str(record.get('resource_spec_fingerprint'))[:40]!r}, "
                               f"not on this one ({spec.fingerprint})")
    try:
        return Calibration.from_dict(record.get("calibration"), source=f"calibration file {path}")
    except InvalidArgumentError as e:
        raise CalibrationError(str(e)) from None


def cached_calibration(spec: ResourceSpec) -> Calibration | None:
    """`spec`'s cached calibration, or None (a damaged cache file is warned about)."""
    path = cache_path(spec)
    if not path.exists():
        return None
    try:
        return load_calibration(path, spec)
    except CalibrationError as e:
        warnings.warn(f"ignoring the cached calibration: {e}; `autodist calibrate` measures "
                      f"it again", stacklevel=2)
        return None


def probe_model(wide_units: int = 0, op_blocks: int = 0):
    """The probe model: an embedding and three small dense layers, SGD (7 variables).

    As few variables as the trial workloads have (5-36), so that a probe's
    collectives and PS messages overlap each other no more than theirs. With
    `wide_units`, two dense layers of that width follow the embedding (a
    `wide_units`² kernel: 1 MiB at 512), so the step moves megabytes; with
    `op_blocks`, that many elementwise blocks (tanh, add: about 10 ops each
    with their gradients) on an activation-sized tensor (the last layer's
    output repeated to `CHAIN_WIDTH` values per example, as wide as a small
    Transformer's activations) follow the dense layers, so the step runs a
    thousand ops more at next to no FLOPs and no traffic.
    """
    import keras

    ids = keras.Input((1,), dtype="int32", name="ids")
    features = keras.Input((8,), name="features")
    hidden = keras.layers.Concatenate()(
        [keras.layers.Flatten()(keras.layers.Embedding(64, 8, name="probe_embedding")(ids)),
         features])
    for i in range(2 if wide_units else 0):
        hidden = keras.layers.Dense(wide_units, name=f"probe_wide_{i}")(hidden)
    for i in range(2):
        hidden = keras.layers.Dense(8, activation="relu", name=f"probe_dense_{i}")(hidden)
    if op_blocks:
        hidden = keras.layers.RepeatVector(CHAIN_WIDTH // 8)(hidden)
        chain = hidden
        for _ in range(op_blocks):
            chain = keras.layers.Add()([keras.layers.Activation("tanh")(chain), hidden])
        hidden = keras.layers.Flatten()(chain)
    outputs = keras.layers.Dense(1, name="probe_out")(hidden)
    model = keras.Model([ids, features], outputs, name="calibration_probe")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


# The probe launches: (name prefix, wide_units, op_blocks). The wide model also
# runs the op chain: a launch costs more than its steps (about 40 s at 9 tasks on
# 2 cores), and its all-reduce and PS probes differ in bytes, not in ops.
PROBE_LAUNCHES = (("", 0, 0), ("wide: ", WIDE_UNITS, OP_BLOCKS))


def probe_strategies(graph_item, spec: ResourceSpec, prefix: str = "") -> dict[str, object]:
    """The probe strategies `spec` can run, by name, for the probe launch `prefix`.

    The small probe model ("") runs all-reduce in one, two and three fused
    groups (the cost of a collective hop), and with parameter servers the PS
    builder (a PS message) and Parallax (the extra session run of a step that
    mixes PS and all-reduce); the wide, op-heavy one ("wide: ") all-reduces
    in one group and, with parameter servers, runs the PS builder.
    """
    from autodist.search import builders

    replicas = len(spec.replica_devices)
    probes = {f"{prefix}all-reduce, one group": all_reduce_in_groups(graph_item, spec, 1)}
    if not prefix and replicas > 1:
        probes["all-reduce, two groups"] = all_reduce_in_groups(graph_item, spec, 2)
        probes["all-reduce, three groups"] = all_reduce_in_groups(graph_item, spec, 3)
    if spec.ps_devices:
        probes[f"{prefix}parameter server"] = builders.PS().build(graph_item, spec)
        if not prefix and replicas > 1:
            probes["parallax (PS and all-reduce)"] = builders.Parallax().build(graph_item, spec)
    return probes


def calibrate_cluster(spec: ResourceSpec, *, steps: int = 20, warmup_steps: int = 5,
                      rounds: int = 2, batch_size: int | None = None, seconds: float = 1.0,
                      save: bool = True, allow_exposed: bool = False,
                      log: Callable[[str], None] = lambda _: None) -> Calibration:
    """Measures the simulator's constants on `spec`'s (local) cluster.

    Args:
        spec: The cluster (every node on this machine).
        steps: Timed steps per probe strategy and round.
        warmup_steps: Untimed steps after each switch.
        rounds: Times each launch runs its probe strategies, interleaved; a
            probe's step time is the median of its steps over the rounds.
        batch_size: Global batch of the probe steps (default 8 per replica).
        seconds: Time for the in-process rate micro-benchmarks.
        save: Write the result to the calibration cache (`cache_path(spec)`).
        allow_exposed: As for `DistributedRun`.
        log: Receives a line per stage.

    Returns:
        The calibration (its `source` says when and on what it was measured).

    Raises:
        CalibrationError: A probe failed, or a node is not on this machine.
    """
    import keras

    from autodist.ir.capture import capture
    from autodist.launch.local import check_local
    from autodist.runtime.calibrate import measure_calibration
    from autodist.runtime.local_runner import LocalRunner

    try:
        check_local(spec)
    except AutodistError as e:
        raise CalibrationError(f"calibrate_cluster measures local clusters only: {e}") from None
    log("measuring rates in this process")
    rates = measure_calibration(seconds)
    base = Calibration(flops_per_s=rates.flops_per_s, op_overhead_s=rates.op_overhead_s,
                       memory_bytes_per_s=rates.memory_bytes_per_s,
                       conv_flops_per_s=rates.conv_flops_per_s,
                       host_cores=os.cpu_count() or 0)
    batch = batch_size or 8 * len(spec.replica_devices)
    measured: dict[str, float] = {}
    probes: list[ProbeStep] = []
    for prefix, wide_units, op_blocks in PROBE_LAUNCHES:
        keras.backend.clear_session()
        model = probe_model(wide_units, op_blocks)
        graph_item = capture(model)
        strategies = probe_strategies(graph_item, spec, prefix)
        log(f"measuring {len(strategies)} probe strategies in one launch on "
            f"{len(spec.nodes)} tasks")
        runner = LocalRunner(model, spec, batch_size=batch, steps=steps,
                             warmup_steps=warmup_steps, graph_item=graph_item,
                             allow_exposed=allow_exposed, log=log)
        simulator = Simulator(SearchSpace(graph_item, spec), base, batch_size=batch)
        # Interleaved rounds (A B C A B C): a load that drifts during the launch
        # reaches every probe alike, and their differences are the costs.
        names = list(strategies) * rounds
        step_times: dict[str, list[float]] = {name: [] for name in strategies}
        for name, result in zip(names, runner.run([strategies[n] for n in names])):
            if not result.ok:
                raise CalibrationError(f"probe {name!r} failed on the cluster: {result.error}")
            step_times[name].extend(result.step_times_s)
        for name, times in step_times.items():
            measured[name] = float(np.median(times))
            log(f"{name}: {measured[name] * 1e3:.2f} ms")
            probes.append(probe_step(simulator, strategies[name], name, measured[name]))
    source = f"{_measured_now(spec)} ({spec.fingerprint[:12]})"
    report: dict[str, object] = {"probes_s": measured, "batch_size": batch}
    calibration, errors = fit_fixed_costs(base, probes, source=source)
    report.update(errors)
    if save:
        path = save_calibration(spec, calibration, report)
        log(f"saved to {path}")
    return calibration


def measure_compute(model, spec: ResourceSpec, *, batch_size: int, graph_item=None,
                    steps: int = 5, allow_exposed: bool = False,
                    timeout_s: float = 600.0) -> MeasuredCompute:
    """`model`'s forward and backward passes measured on `spec`'s local cluster.

    One launch (about 10-30 s): every replica runs its share of `batch_size`
    random examples (`models.synthetic_data`) at once under all-reduce (its
    variables local: no communication is timed), one warm-up batch and
    `steps` timed ones (`DistributedRun.measure_throughput`). The slowest
    replica's median is what a step waits for.

    Args:
        model: The Keras model (compiled).
        spec: The cluster (local tasks only).
        batch_size: The global batch the plan is for.
        graph_item: Its capture (default: captured now).
        steps: Timed batches.
        allow_exposed: As in `DistributedRun`.
        timeout_s: Bound on the launch.

    Raises:
        CalibrationError: not a local cluster, or fewer examples than replicas.
    """
    from autodist.ir.capture import capture
    from autodist.launch.local import check_local
    from autodist.models import synthetic_data
    from autodist.runtime.run import DistributedRun
    from autodist.search.builders import AllReduce

    try:
        check_local(spec)
    except AutodistError as e:
        raise CalibrationError(f"measure_compute measures local clusters only: {e}") from None
    replicas = len(spec.replica_devices)
    if batch_size < replicas:
        raise CalibrationError(f"measuring compute needs a batch of at least one example per "
                               f"replica ({replicas}). Received: batch_size={batch_size}")
    graph_item = graph_item or capture(model)
    run = DistributedRun(model, AllReduce().build(graph_item, spec), spec,
                         graph_item=graph_item, allow_exposed=allow_exposed)
    x, y = synthetic_data(model, batch_size * (steps + 1), seed=0)
    rates = run.measure_throughput(x, y, batch_size=batch_size, steps=steps,
                                   timeout_s=timeout_s)
    examples = batch_size / replicas
    return MeasuredCompute(max(examples / rate for rate in rates.values()), examples,
                           _measured_now(spec))


def _measured_now(spec: ResourceSpec) -> str:
    """"measured <UTC time> on <n> tasks": the source of what was measured on `spec` now."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"measured {stamp} on {len(spec.nodes)} tasks"
