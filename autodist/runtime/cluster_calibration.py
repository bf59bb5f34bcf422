"""Calibrates the simulator on the cluster it plans for, and caches the result.

`calibrate_cluster(spec)` measures, in about half a minute on a local
cluster:

* the rates in this process (`calibrate.measure_calibration`: one core's
  FLOP rate for matmuls and for convolutions, the cost of an op, the
  optimizer update rate), with the host's cores, so CPU replicas that
  outnumber them share them;
* the fixed costs of a step on the cluster itself, from a probe model (an
  embedding and seven small dense layers: too little compute and traffic to
  hide them) trained a few steps under probe strategies in one launch, the
  strategies switched in place: all-reduce in one fused group and in one
  group per variable (the cost of a collective hop), and with parameter
  servers the PS builder and Parallax (a PS message; the extra session run of
  a step that mixes PS and all-reduce); then, in a second launch, the same
  model with two 512-wide layers (megabytes per step: the CPU's time per
  byte moved, beyond the link's) under all-reduce and PS.
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

from autodist.ir.atomic import NotRegularFileError, atomic_write, read_regular
from autodist.ir.errors import AutodistError, InvalidArgumentError
from autodist.ir.resource_spec import ResourceSpec
from autodist.search.calibration_fit import ProbeStep, fit_fixed_costs, probe_step
from autodist.search.simulator import Calibration, Simulator
from autodist.search.space import SearchSpace

CACHE_VERSION = 1
# The environment variable that moves the cache (default: $XDG_CACHE_HOME/autodist).
CACHE_ENV = "AUTODIST_CACHE_DIR"
_MAX_CACHE_BYTES = 1 << 20
# Width of the wide probe model's layers (a 1 MiB kernel).
WIDE_UNITS = 512


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


def probe_model(wide_units: int = 0):
    """The probe model: an embedding and seven small dense layers, SGD (17 variables).

    With `wide_units`, two dense layers of that width follow the embedding
    (a `wide_units`² kernel: 1 MiB at 512), so the step moves megabytes.
    """
    import keras

    ids = keras.Input((1,), dtype="int32", name="ids")
    features = keras.Input((8,), name="features")
    hidden = keras.layers.Concatenate()(
        [keras.layers.Flatten()(keras.layers.Embedding(64, 8, name="probe_embedding")(ids)),
         features])
    for i in range(2 if wide_units else 0):
        hidden = keras.layers.Dense(wide_units, name=f"probe_wide_{i}")(hidden)
    for i in range(7):
        hidden = keras.layers.Dense(8, activation="relu", name=f"probe_dense_{i}")(hidden)
    outputs = keras.layers.Dense(1, name="probe_out")(hidden)
    model = keras.Model([ids, features], outputs, name="calibration_probe")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def probe_strategies(graph_item, spec: ResourceSpec, wide: bool = False) -> dict[str, object]:
    """The probe strategies `spec` can run, by name (`wide`: those of the wide probe model)."""
    from autodist.search import builders

    if wide:
        probes = {"wide: all-reduce, one group": builders.AllReduce(group_bytes=1 << 30)}
        if spec.ps_devices:
            probes["wide: parameter server"] = builders.PS()
        return {name: builder.build(graph_item, spec) for name, builder in probes.items()}
    probes = {"all-reduce, one group": builders.AllReduce(group_bytes=1 << 30)}
    if len(spec.replica_devices) > 1:
        probes["all-reduce, a group per variable"] = builders.AllReduce(group_bytes=1)
    if spec.ps_devices:
        probes["parameter server"] = builders.PS()
        if len(spec.replica_devices) > 1:
            probes["parallax (PS and all-reduce)"] = builders.Parallax()
    return {name: builder.build(graph_item, spec) for name, builder in probes.items()}


def calibrate_cluster(spec: ResourceSpec, *, steps: int = 20, warmup_steps: int = 5,
                      batch_size: int | None = None, seconds: float = 1.0,
                      save: bool = True, allow_exposed: bool = False,
                      log: Callable[[str], None] = lambda _: None) -> Calibration:
    """Measures the simulator's constants on `spec`'s (local) cluster.

    Args:
        spec: The cluster (every node on this machine).
        steps: Timed steps per probe strategy.
        warmup_steps: Untimed steps after each switch.
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
    for wide_units in (0, WIDE_UNITS):
        keras.backend.clear_session()
        model = probe_model(wide_units)
        graph_item = capture(model)
        strategies = probe_strategies(graph_item, spec, wide=bool(wide_units))
        log(f"measuring {len(strategies)} probe strategies in one launch on "
            f"{len(spec.nodes)} tasks")
        runner = LocalRunner(model, spec, batch_size=batch, steps=steps,
                             warmup_steps=warmup_steps, graph_item=graph_item,
                             allow_exposed=allow_exposed, log=log)
        simulator = Simulator(SearchSpace(graph_item, spec), base, batch_size=batch)
        for name, result in zip(strategies, runner.run(list(strategies.values()))):
            if not result.ok:
                raise CalibrationError(f"probe {name!r} failed on the cluster: {result.error}")
            measured[name] = float(result.median_step_time_s)
            probes.append(probe_step(simulator, strategies[name], name, measured[name]))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    source = f"measured {stamp} on {len(spec.nodes)} tasks ({spec.fingerprint[:12]})"
    report: dict[str, object] = {"probes_s": measured, "batch_size": batch}
    calibration, errors = fit_fixed_costs(base, probes, source=source)
    report.update(errors)
    if save:
        path = save_calibration(spec, calibration, report)
        log(f"saved to {path}")
    return calibration
