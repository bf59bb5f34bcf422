"""The `autodist` command line.

    autodist inspect MODEL [--save graph_item.pb] [--batch-size N] [--json]
    autodist strategy show FILE [--graph-item GI.pb --cluster cluster.yml]
            [--plot out.png] [--json]
    autodist strategy build BUILDER --model MODEL [--cluster cluster.yml] --out s.pb
    autodist run --model mlp --builder AllReduce|search [--workers 2 --ps 1 --epochs 2]
    autodist search --model MODEL [--cluster cluster.yml | --tf-config] [--trials N]
            [--launch local|remote --secret-file F] --out s.pb [--json]
    autodist export trials.jsonl [--workload NAME] --out s.pbtxt [--json]
    autodist bench [--preset small|full] [--models mlp,ncf --mbits 100,1000] [--out DIR]
    autodist serve --tf-config [--gpus-per-worker N --cpu-replicas-per-worker N]
            | --cluster cluster.yml --task worker:1
            [--job-timeout 600 --idle-timeout S --max-jobs N --work-dir DIR]
    autodist probe --tf-config [--timeout 30 --payload-mb 4 --repeats 5] [--json]

MODEL is an example model name (see `autodist.models.REGISTRY`), a saved
`.keras` file, a GraphItem file (`.pb`), or `package.module:function`
returning a compiled Keras model. `--json` prints one JSON object on stdout
instead of the text (its keys: docs/cli.md); errors go to stderr, exit 2.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import pathlib
import statistics
import sys
from typing import Any, Iterator, Mapping, Sequence

from autodist.ir.errors import AutodistError
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy, describe_synchronizer, enum_name
from autodist.proto import strategy_pb2

# Version of the --json objects' layout: raised when a key changes meaning or goes.
JSON_SCHEMA_VERSION = 1


def load_graph_item(model: str, batch_size: int | None = None) -> GraphItem:
    """Resolves a MODEL argument to a GraphItem (capturing it if needed)."""
    return load_model(model, batch_size)[1]


def load_model(model: str, batch_size: int | None = None):
    """Resolves a MODEL argument to (Keras model or None for a GraphItem file, GraphItem)."""
    path = pathlib.Path(model)
    if path.suffix == ".pb" and path.exists():
        return None, GraphItem.load(path)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from autodist import models
    from autodist.ir.capture import capture

    if model in models.REGISTRY:
        keras_model = models.build(model)
    elif path.suffix == ".keras":
        if not path.exists():
            raise AutodistError(f"model file {model!r} does not exist")
        import keras
        keras_model = keras.models.load_model(path)
    elif ":" in model:
        module_name, _, attr = model.partition(":")
        # As `python -c` would: a module of the current directory is importable (a
        # console script's path starts at its own directory, not the caller's).
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise AutodistError(f"cannot load {model!r} (from {os.getcwd()!r}): {e}") from e
        keras_model = factory()
    else:
        raise AutodistError(
            f"unknown model {model!r}: expected an example name ({', '.join(models.REGISTRY)}), "
            "a .keras file, a GraphItem .pb file or package.module:function")
    kwargs = {"estimate_batch_size": batch_size} if batch_size else {}
    return keras_model, capture(keras_model, **kwargs)


def _cluster(path: str | None) -> ResourceSpec:
    return ResourceSpec.from_yaml(path) if path else ResourceSpec.local(workers=2, ps=1)


# ------------------------------------------------------------------- JSON output
def _number(value: float | None) -> float | None:
    """A float for JSON: None for None, NaN and infinities (JSON has none of them)."""
    return None if value is None or not math.isfinite(value) else float(value)


def _emit(payload: Mapping[str, Any]) -> None:
    """Prints one JSON object on stdout (`--json`), with the schema version first."""
    print(json.dumps({"schema_version": JSON_SCHEMA_VERSION, **payload}, indent=2,
                     allow_nan=False))


@contextlib.contextmanager
def _stdout_to_stderr(active: bool) -> Iterator[None]:
    """With --json: what the command prints along the way goes to stderr, so stdout
    holds the JSON object alone (Python's prints, and the processes it starts, which
    inherit file descriptor 1)."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)


def graph_item_json(graph_item: GraphItem) -> dict[str, Any]:
    """A GraphItem's facts as `autodist inspect --json` prints them."""
    opt = graph_item.optimizer
    return {
        "name": graph_item.name,
        "source": graph_item.source,
        "fingerprint": graph_item.fingerprint,
        "num_parameters": graph_item.num_parameters,
        "total_variable_bytes": graph_item.total_variable_bytes,
        "total_flops": graph_item.total_flops,
        "estimate_batch_size": graph_item.estimate_batch_size,
        "optimizer": {"class_name": opt.class_name, "family": opt.family,
                      "algorithm": opt.algorithm,
                      "hyperparameters": {k: _number(v) for k, v in
                                          sorted(opt.hyperparameters.items())}},
        "variables": [{"name": v.name, "shape": list(v.shape), "dtype": v.dtype,
                       "bytes": v.byte_size, "sparse_gradient": v.sparse_gradient,
                       "partitionable_axes": list(v.partitionable_axes),
                       "slots": list(v.slots)} for v in graph_item.variables],
        "state_variables": [{"name": v.name, "shape": list(v.shape), "dtype": v.dtype,
                             "bytes": v.byte_size} for v in graph_item.state_variables],
        "inputs": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "role": t.role}
                   for t in graph_item.inputs],
    }


def _shard_json(sync: strategy_pb2.Synchronizer) -> dict[str, Any]:
    kind = sync.WhichOneof("kind")
    out: dict[str, Any] = {"kind": kind or "none", "description": describe_synchronizer(sync)}
    if kind == "ps":
        out.update(device=sync.ps.reduction_destination, sync=sync.ps.sync,
                   staleness=int(sync.ps.staleness),
                   local_replication=sync.ps.local_replication)
    elif kind == "all_reduce":
        ar = sync.all_reduce
        out.update(spec=enum_name(strategy_pb2.AllReduceSynchronizer.Spec, ar.spec),
                   compressor=enum_name(strategy_pb2.AllReduceSynchronizer.Compressor,
                                        ar.compressor),
                   group=int(ar.group))
    return out


def strategy_json(strategy: Strategy) -> dict[str, Any]:
    """A strategy as the `--json` outputs print it (measured times before predicted)."""
    proto = strategy.proto
    vn = proto.graph_config.virtual_nodes
    perf = proto.performance
    measured = list(perf.measured_step_time_s)
    variables = []
    for config in proto.variables:
        p = config.partitioner
        variables.append({
            "name": config.var_name,
            "partitioner": ({"axis": int(p.axis), "num_shards": int(p.num_shards),
                             "shard_sizes": list(p.shard_sizes)}
                            if config.HasField("partitioner") and p.num_shards > 1 else None),
            "shards": [_shard_json(sync) for sync in config.shards]})
    return {
        "id": strategy.id,
        "origin": strategy.origin,
        "schema_version": int(proto.schema_version),
        "replicas": strategy.replicas,
        "virtual_nodes": ({"num_virtual_nodes": int(vn.num_virtual_nodes),
                           "global_batch_size": int(vn.global_batch_size),
                           "devices": list(vn.device)} if vn.num_virtual_nodes else None),
        "hyperparameters": {k: _number(v) for k, v in sorted(strategy.hyperparameters.items())},
        "performance": {
            "measured_median_step_time_s": (_number(statistics.median(measured))
                                            if measured else None),
            "measured_step_time_s": measured,
            "predicted_step_time_s": _number(perf.predicted_step_time_s) or None,
            "lower_bound_step_time_s": _number(perf.lower_bound_step_time_s) or None,
            "predictor": perf.predictor or None,
        },
        "variables": variables,
    }


# ---------------------------------------------------------------------- commands
def _cmd_inspect(args: argparse.Namespace) -> int:
    with _stdout_to_stderr(args.json):
        graph_item = load_graph_item(args.model, args.batch_size)
        if args.save:
            graph_item.save(args.save)
    if args.json:
        _emit({"graph_item": graph_item_json(graph_item), "saved_to": args.save})
        return 0
    print(graph_item.summary())
    if args.save:
        print(f"\nGraphItem written to {args.save}")
    return 0


def _cmd_strategy_show(args: argparse.Namespace) -> int:
    strategy = Strategy.load(args.file)
    graph_item = spec = None
    with _stdout_to_stderr(args.json):
        if args.graph_item:
            graph_item, spec = load_graph_item(args.graph_item), _cluster(args.cluster)
            strategy.validate(graph_item, spec)
        elif args.cluster:
            raise AutodistError("--cluster goes with --graph-item (the model the strategy is "
                                "for): bytes and validation need both")
        layout = None
        if args.plot or args.json:
            from autodist.plotting import plot_strategy, strategy_layout

            layout = strategy_layout(strategy, graph_item, spec)
            if args.plot:
                plot_strategy(strategy, graph_item, spec, path=args.plot, layout=layout)
    if args.json:
        _emit({"strategy": strategy_json(strategy),
               "valid": True if graph_item is not None else None,
               "layout": layout.as_dict(), "plot": args.plot})
        return 0
    print(strategy.summary())
    if args.text:
        print()
        print(strategy.to_text())
    if graph_item is not None:
        print("\nvalid for the given GraphItem and cluster")
    if args.plot:
        print(f"\nfigure written to {args.plot}"
              + ("" if graph_item is not None else " (no bytes per link: pass --graph-item "
                                                   "MODEL [--cluster FILE] for them)"))
    return 0


def _cmd_strategy_build(args: argparse.Namespace) -> int:
    from autodist.search import builders

    builder = builders.get(args.builder)()
    graph_item = load_graph_item(args.model)
    strategy = builder.build(graph_item, _cluster(args.cluster))
    print(strategy.summary())
    if args.out:
        strategy.save(args.out)
        print(f"\nstrategy written to {args.out}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    """Trains an example model on a local cluster and checks it against Keras."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import time

    import keras
    import numpy as np

    from autodist import models
    from autodist.api import distribute
    from autodist.ir.capture import capture
    from autodist.search import builders

    if args.model not in models.REGISTRY:
        raise AutodistError(f"unknown example model {args.model!r}; known: "
                            f"{sorted(models.REGISTRY)}")
    model = models.build(args.model)
    x, y = models.synthetic_data(model, args.examples, seed=0)
    reference = models.single_device_twin(model)
    spec = _cluster(args.cluster) if args.cluster else ResourceSpec.local(args.workers, args.ps)
    graph_item = capture(model)
    if args.builder == "search":
        from autodist.api import optimize

        plan = optimize(model, spec, graph_item=graph_item, batch_size=args.batch_size)
        strategy = plan.strategy
        print(f"strategy found by the search in {plan.search_time_s:.2f}s "
              f"({plan.candidates_scored} candidates scored)\n")
        print(plan.explain(), "\n")
    else:
        strategy = builders.get(args.builder)().build(graph_item, spec)
    print(strategy.summary(), "\n")
    start = time.perf_counter()
    # Shuffled as Keras' fit shuffles by default: in Keras' own order, with its seed set.
    keras.utils.set_random_seed(0)
    history = distribute(model, strategy, spec, graph_item=graph_item).fit(
        x, y, batch_size=args.batch_size, epochs=args.epochs, verbose=1)
    elapsed = time.perf_counter() - start
    keras.utils.set_random_seed(0)
    reference.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, verbose=0)
    diff = max(float(np.abs(a - b).max())
               for a, b in zip(model.get_weights(), reference.get_weights()))
    print(f"\ntrained {len(history.step_losses)} steps on {len(spec.replica_devices)} replicas "
          f"in {elapsed:.1f}s (including cluster start-up); epoch losses "
          f"{[round(v, 4) for v in history.history['loss']]}")
    print(f"max |weight - single-device Keras fit| = {diff:.2e}")
    return 0


def _cmd_search(args: argparse.Namespace) -> int:
    """Searches a strategy offline (optionally measuring trials on the cluster: local
    processes, or with --launch remote / --tf-config jobs on served hosts).

    A measured search reports measured times first: the trials by their
    measured median, then the pick's measured time, then the prediction.
    """
    from autodist.search.cost_model import SimulatorCostModel, resolve_cost_model
    from autodist.search.database import Database
    from autodist.search.space import SpaceOptions
    from autodist.search.tuner import Tuner

    with _stdout_to_stderr(args.json):
        model, graph_item = load_model(args.model)
        if args.tf_config and args.cluster:
            raise AutodistError("give --cluster FILE or --tf-config, not both")
        if args.tf_config:
            from autodist.launch.cluster_probe import planning_spec

            spec = planning_spec(log=lambda text: print(text, file=sys.stderr))
        else:
            spec = _cluster(args.cluster)
        launch = args.launch or ("remote" if args.tf_config else "local")
        if args.secret_file and launch != "remote":
            raise AutodistError("--secret-file goes with --launch remote (or --tf-config)")
        runner = None
        if args.trials:
            if model is None:
                raise AutodistError("--trials needs a runnable model (an example name, .keras "
                                    "file or module:function), not a GraphItem file")
            batch = args.batch_size or 32 * len(spec.replica_devices)
            if launch == "remote":
                from autodist.runtime.remote_runner import RemoteRunner

                runner = RemoteRunner(model, spec, graph_item=graph_item, batch_size=batch,
                                      secret_file=args.secret_file)
            else:
                from autodist.runtime.local_runner import LocalRunner

                runner = LocalRunner(model, spec, graph_item=graph_item, batch_size=batch)
        options = SpaceOptions(compressors=tuple(args.compressors.split(",")),
                               consistency=tuple(args.consistency.split(",")))
        if args.cost_model:
            cost_model = resolve_cost_model(args.cost_model)
        elif args.no_default_cost_model:
            cost_model = SimulatorCostModel()
        else:
            cost_model = resolve_cost_model(None)   # the shipped model, else the simulator
        tuner = Tuner(graph_item, spec, space_options=options, batch_size=args.batch_size,
                      cost_model=cost_model,
                      database=Database(args.database) if args.database else None,
                      runner=runner, search_budget=args.search_budget, seed=args.seed,
                      progress=True)
        if not args.json:
            print(tuner.space.describe())
        result = tuner.tune(args.trials)
        if args.out:
            result.strategy.save(args.out)
    trials = sorted(result.trials, key=_trial_order)
    measured = list(result.strategy.measured_step_times_s)
    if args.json:
        _emit({
            "workload": _workload_json(graph_item.name, graph_item.fingerprint, spec,
                                       spec.fingerprint),
            "candidates_scored": result.candidates_scored,
            "elapsed_s": result.elapsed_s,
            "measured_step_time_s": _number(statistics.median(measured)) if measured else None,
            "predicted_step_time_s": _number(result.predicted_step_time_s),
            "lower_bound_step_time_s": _number(result.lower_bound_s),
            "predictor": tuner.predictor,
            "trials": [_trial_json(t) for t in trials],
            "builder_step_times_s": {k: _number(v)
                                     for k, v in result.builder_step_times_s.items()},
            "builder_errors": dict(result.builder_errors),
            "strategy": strategy_json(result.strategy),
            "out": args.out,
        })
        return 0
    print(f"scored {result.candidates_scored} candidates, measured {len(result.trials)} "
          f"in {result.elapsed_s:.2f}s\n")
    if trials:
        print("measured trials (fastest first):")
        for trial in trials:
            print("  " + _trial_line(trial))
        if measured:
            print(f"\npick: measured {statistics.median(measured) * 1e3:.3f} ms/step (median of "
                  f"{len(measured)} steps); predicted "
                  f"{result.predicted_step_time_s * 1e3:.3f} ms\n")
        else:
            print("\npick: not measured (every measured trial failed); ranked by "
                  "prediction\n")
    print(result.explanation, "\n")
    print(result.strategy.summary())
    if args.out:
        print(f"\nstrategy written to {args.out}")
    return 0


def _trial_order(trial) -> tuple[int, float]:
    """Measured trials by their median, then the failed ones."""
    median = statistics.median(trial.step_times_s) if trial.step_times_s else math.inf
    return (0 if trial.error is None and trial.step_times_s else 1, median)


def _trial_json(trial) -> dict[str, Any]:
    times = list(trial.step_times_s)
    return {"origin": trial.origin,
            "measured_median_step_time_s": _number(statistics.median(times)) if times else None,
            "measured_step_time_s": times,
            "predicted_step_time_s": _number(trial.predicted_step_time_s),
            "error": trial.error}


def _trial_line(trial) -> str:
    predicted = f"predicted {trial.predicted_step_time_s * 1e3:.3f} ms"
    if trial.error is not None or not trial.step_times_s:
        return f"{trial.origin:<22} failed: {str(trial.error).splitlines()[0][:120]} ({predicted})"
    return (f"{trial.origin:<22} measured {statistics.median(trial.step_times_s) * 1e3:.3f} ms "
            f"(median of {len(trial.step_times_s)}), {predicted}")


def describe_cluster(spec: ResourceSpec) -> str:
    """A short, shell-safe name of a cluster, e.g. "2workers+1ps" or "4workers-8gpus@25gbit".

    Worker tasks, their replicas when not one each (GPUs or CPU devices),
    parameter-server-only tasks, and the bandwidth when every node has the
    same known one.
    """
    workers = spec.num_worker_tasks
    replicas = spec.replica_devices
    name = f"{workers}worker" + ("s" if workers != 1 else "")
    if len(replicas) != workers:
        kind = "gpu" if any("/device:GPU:" in d for d in replicas) else "cpu"
        name += f"-{len(replicas)}{kind}" + ("s" if len(replicas) != 1 else "")
    ps_only = sum(1 for n in spec.nodes if "worker" not in n.roles)
    if ps_only:
        name += f"+{ps_only}ps"
    bandwidths = {n.network_bandwidth_gbps for n in spec.nodes}
    if len(bandwidths) == 1 and next(iter(bandwidths)) > 0:
        name += f"@{next(iter(bandwidths)):g}gbit"
    return name


def _workload_json(model_name: str, graph_item_fingerprint: str, spec: ResourceSpec | None,
                   resource_spec_fingerprint: str, name: str | None = None) -> dict[str, Any]:
    cluster = describe_cluster(spec) if spec is not None else "unknown-cluster"
    return {"name": name or f"{model_name or 'model'}@{cluster}",
            "key": f"{graph_item_fingerprint}:{resource_spec_fingerprint}",
            "model": model_name, "cluster": cluster,
            "graph_item_fingerprint": graph_item_fingerprint,
            "resource_spec_fingerprint": resource_spec_fingerprint}


def workload_names(by_workload: Mapping[str, Sequence[Any]]) -> dict[str, dict[str, Any]]:
    """Workload key -> its `_workload_json` with a readable, unique name.

    Named "<model>@<cluster>" (`describe_cluster`); workloads that share that
    name (one model captured twice, say at another batch) get "#" and the
    start of their GraphItem fingerprint, then of the cluster's, appended.
    """
    out: dict[str, dict[str, Any]] = {}
    for key, records in by_workload.items():
        record = records[0]
        try:
            spec = record.load_resource_spec()
        except AutodistError:
            spec = None
        out[key] = _workload_json(record.model_name, record.graph_item_fingerprint, spec,
                                  record.resource_spec_fingerprint)
    for fingerprint_field in ("graph_item_fingerprint", "resource_spec_fingerprint"):
        names: dict[str, list[str]] = {}
        for key, info in out.items():
            names.setdefault(info["name"], []).append(key)
        for keys in names.values():
            if len(keys) > 1:
                for key in keys:
                    out[key]["name"] += "#" + out[key][fingerprint_field][:8]
    return out


def _cmd_export(args: argparse.Namespace) -> int:
    """Writes the best measured strategy of a trial database to a file.

    The strategy written keeps its measured step times (and the prediction
    recorded with the trial) in its `performance`.
    """
    from autodist.search.database import Database

    db = Database(args.database)
    by_workload = db.by_workload(ok_only=True)
    if not by_workload:
        raise AutodistError(f"{args.database} holds no measured trial (a search with --trials "
                            "N --database FILE records them)")
    named = workload_names(by_workload)
    by_name = {info["name"]: key for key, info in named.items()}
    listing = ", ".join(f"{info['name']} ({len(by_workload[key])} trials)"
                        for key, info in named.items())
    if args.workload:
        key = by_name.get(args.workload, args.workload)
        matches = [k for k in by_workload if k == key or k.startswith(key)]
        if len(matches) != 1:
            raise AutodistError(f"no measured trial of workload {args.workload!r} in "
                                f"{args.database} "
                                f"(a name, a key or the unique start of a key); workloads: "
                                f"{listing}")
        workload = matches[0]
    elif len(by_workload) == 1:
        workload = next(iter(by_workload))
    else:
        raise AutodistError(f"{args.database} holds {len(by_workload)} workloads with "
                            f"measured trials; pick one with --workload NAME: {listing}")
    trials = by_workload[workload]
    best = min(trials, key=lambda r: r.median_step_time_s)
    strategy = best.load_strategy()
    strategy = strategy.with_performance(
        measured_step_times_s=best.step_times_s,
        predicted_step_time_s=best.predicted_step_time_s
        if strategy.predicted_step_time_s is None else None)
    strategy.save(args.out)
    if args.json:
        _emit({"database": str(args.database), "workload": named[workload],
               "workloads": list(named.values()), "trials": len(trials),
               "best": {"origin": best.origin,
                        "measured_median_step_time_s": _number(best.median_step_time_s),
                        "measured_step_time_s": list(best.step_times_s),
                        "predicted_step_time_s": _number(best.predicted_step_time_s)},
               "strategy": strategy_json(strategy), "out": args.out})
        return 0
    predicted = (f"; predicted {best.predicted_step_time_s * 1e3:.3f} ms"
                 if best.predicted_step_time_s is not None else "")
    print(f"best of {len(trials)} measured trials of {named[workload]['name']}: measured "
          f"{best.median_step_time_s * 1e3:.3f} ms/step (median of {len(best.step_times_s)} "
          f"steps{predicted}; origin {best.origin})\n")
    print(strategy.summary())
    print(f"\nstrategy written to {args.out} (with its measured step times)")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    """Measures the simulator's constants on a local cluster and caches them."""
    from autodist.runtime.cluster_calibration import cache_path, calibrate_cluster

    spec = _cluster(args.cluster) if args.cluster else ResourceSpec.local(workers=args.workers,
                                                                           ps=args.ps)
    with _stdout_to_stderr(args.json):   # with --json the progress lines go to stderr
        calibration = calibrate_cluster(spec, steps=args.steps, save=not args.no_save, log=print)
    if args.json:
        _emit({"resource_spec_fingerprint": spec.fingerprint,
               "calibration": {k: (_number(v) if isinstance(v, float) else v)
                               for k, v in calibration.to_dict().items()},
               "cache": None if args.no_save else str(cache_path(spec))})
        return 0
    print(f"{describe_cluster(spec)}: {calibration.source}")
    print(f"  compute      {calibration.flops_per_s / 1e9:.2f} GFLOP/s per core, "
          f"{calibration.host_cores} cores; an op {calibration.op_overhead_s * 1e6:.1f} us")
    print(f"  updates      {calibration.memory_bytes_per_s / 1e9:.2f} GB/s")
    print(f"  per step     {calibration.task_overhead_s * 1e3:.3f} ms per task")
    print(f"  collectives  {calibration.hop_latency_s * 1e3:.3f} ms per hop")
    print(f"  PS           {calibration.latency_s * 1e3:.3f} ms per message")
    print(f"  extra run    {calibration.run_overhead_s * 1e3:.3f} ms")
    print(f"  bytes        {calibration.byte_cost_s * 1e9:.3f} ms per MB moved (CPU, beyond "
          f"the link)")
    if not args.no_save:
        print(f"cached in {cache_path(spec)}: optimize(..., calibration='cached') uses it")
    return 0


def _cmd_probe(args: argparse.Namespace) -> int:
    """Measures the TF_CONFIG cluster's devices, memory and links; prints the measured spec."""
    from autodist.launch.cluster_probe import probe_tf_config

    with _stdout_to_stderr(args.json):
        probe = probe_tf_config(timeout_s=args.timeout, payload_bytes=args.payload_mb << 20,
                                repeats=args.repeats, pairs=not args.chief_links_only, log=print)
    if args.json:
        _emit(probe.to_dict())
        return 0
    print(probe.describe())
    print("\nthe measured ResourceSpec (ResourceSpec.from_text reads it):")
    print(probe.spec.to_text(), end="")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    """Serves jobs as one task of a multi-host cluster, one task process per job.

    Each job runs in a fresh process (fresh TensorFlow server and state) on
    the task's port; a failed job does not stop the serving, and a job that
    is not signed with the cluster's secret is rejected (logged) while the
    same process goes on waiting. Stops when no job arrives within the
    timeout (exit 1 if none ever came, else 0) or after --max-jobs jobs (exit
    1 if the last one failed).
    """
    import subprocess
    import time

    from autodist.launch import tf_config
    from autodist.launch.errors import EXIT_NO_JOB, EXIT_PORT_IN_USE
    from autodist.launch.task import serving_secret
    from autodist.runtime.entry import TASK_MODULE

    if args.tf_config == bool(args.cluster):
        raise AutodistError("serve needs exactly one of --tf-config and --cluster FILE --task "
                            "JOB:INDEX")
    # Check the cluster and the task here, so a mistake is reported before any process starts.
    if args.tf_config:
        tf_config.task_from_tf_config(gpus_per_worker=args.gpus_per_worker,
                                      cpu_replicas_per_worker=args.cpu_replicas_per_worker)
        where = ["--tf-config", "--cpu-replicas-per-worker", str(args.cpu_replicas_per_worker)]
        if args.gpus_per_worker is not None:
            where += ["--gpus-per-worker", str(args.gpus_per_worker)]
    else:
        if args.gpus_per_worker is not None or args.cpu_replicas_per_worker != 1:
            raise AutodistError("--gpus-per-worker and --cpu-replicas-per-worker go with "
                                "--tf-config; with --cluster the spec file gives each node's "
                                f"devices. Received: --cluster {args.cluster}")
        tf_config.task_from_spec_file(args.cluster, args.task)
        where = ["--cluster", args.cluster, "--task", args.task]
    serving_secret(args.secret_file, args.insecure)  # readable, or --insecure: checked now
    if args.secret_file:
        where += ["--secret-file", args.secret_file]
    if args.insecure:
        print("autodist: WARNING: serving with --insecure: this task runs any job sent to its "
              "port, unsigned (trusted networks only)", file=sys.stderr, flush=True)
        where.append("--insecure")
    idle_timeout = args.idle_timeout if args.idle_timeout is not None else args.job_timeout
    jobs, port_retries, code = 0, 0, 0
    while not args.max_jobs or jobs < args.max_jobs:
        command = [sys.executable, "-m", TASK_MODULE, *where,
                   "--job-timeout", str(args.job_timeout if jobs == 0 else idle_timeout),
                   "--parent-pid", str(os.getpid())]
        if args.work_dir:
            command += ["--work-dir", args.work_dir]
        code = subprocess.call(command, stdin=subprocess.DEVNULL)
        if code == EXIT_NO_JOB:
            if jobs == 0:
                return 1
            print(f"autodist: no further job within {idle_timeout:g}s; served {jobs}", flush=True)
            return 0
        if code == EXIT_PORT_IN_USE:  # the previous job's process may still hold it
            port_retries += 1
            if port_retries > 5:
                raise AutodistError("this task's port stayed taken; is another server running "
                                    "there?")
            time.sleep(1.0)
            continue
        port_retries = 0
        jobs += 1
        if code != 0:
            print(f"autodist: job {jobs} failed (exit code {code})", file=sys.stderr, flush=True)
    return 0 if code == 0 else 1


def bench_preset(args: argparse.Namespace):
    """The `Preset` that `autodist bench`'s arguments ask for."""
    import dataclasses

    from autodist import models
    from autodist.bench import emulated

    preset = emulated.PRESETS[args.preset]
    changes: dict = {}
    if args.models:
        changes["models"] = emulated.parse_list(args.models, str, "--models")
        unknown = [m for m in changes["models"] if m not in models.BENCH_MODELS]
        if unknown:
            raise AutodistError(f"--models: unknown {unknown}; known: "
                                f"{sorted(models.BENCH_MODELS)}")
    if args.mbits:
        changes["mbits"] = emulated.parse_list(args.mbits, float, "--mbits")
        if min(changes["mbits"]) <= 0:
            raise AutodistError(f"--mbits must be positive. Received: {args.mbits!r}")
    if args.builders:
        changes["builders"] = (emulated.ALL_BUILDERS if args.builders == "all" else
                               emulated.parse_list(args.builders, str, "--builders"))
        unknown = [b for b in changes["builders"] if b not in emulated.ALL_BUILDERS]
        if unknown:
            raise AutodistError(f"--builders: unknown {unknown}; known: "
                                f"{list(emulated.ALL_BUILDERS)}")
    for name in ("workers", "ps", "steps", "warmup", "batch_size", "orders", "cost_model"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.no_mwms:
        changes["mwms"] = False
    preset = dataclasses.replace(preset, **changes)
    if preset.workers < 1 or preset.ps < 0 or preset.steps < 1 or preset.warmup < 2:
        raise AutodistError(f"need --workers >= 1, --ps >= 0, --steps >= 1 and --warmup >= 2 "
                            f"(a new program's first steps are slow). Received: workers="
                            f"{preset.workers}, ps={preset.ps}, steps={preset.steps}, "
                            f"warmup={preset.warmup}")
    if preset.batch_size % preset.workers:
        raise AutodistError(f"--batch-size {preset.batch_size} does not split across "
                            f"{preset.workers} workers")
    return preset


def _cmd_bench(args: argparse.Namespace) -> int:
    """Measures builders, optimize's pick and baselines on an emulated capped cluster."""
    import shlex

    from autodist.bench import capped_links, emulated

    preset = bench_preset(args)
    if not capped_links.can_shape():
        raise AutodistError(
            "bench caps each task's link with tc on lo, which needs root in a private "
            "network namespace (TF servers bind every interface); run it as "
            "`unshare -n bash -c 'ip link set lo up && autodist bench ...'` "
            f"(interfaces up besides loopback: {capped_links.exposed_interfaces()}, root: "
            f"{hasattr(os, 'geteuid') and os.geteuid() == 0})")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    prog = ("autodist" if os.path.basename(sys.argv[0]) == "autodist"
            else "python -m autodist.cli")
    command = f"{prog} bench " + shlex.join(args.argv)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    log(f"autodist bench: {len(preset.models)} models x {len(preset.mbits)} bandwidths, "
        f"{preset.workers} workers + {preset.ps} PS, {len(preset.builders)} builders + "
        f"optimize" + (" + MWMS" if preset.mwms else "") + " + single-device")
    paths = emulated.run(preset, args.out, command=command, append=args.append, log=log)
    with open(paths[1], encoding="utf-8") as f:
        summary = f.read().split("## Summary", 1)[1].split("## Every", 1)[0]
    print(summary.strip())
    print("\nwritten: " + ", ".join(paths))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from autodist import __version__

    parser = argparse.ArgumentParser(prog="autodist", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"autodist {__version__}")
    parser.add_argument("--verbose", action="store_true",
                        help="let TensorFlow print its C++ log lines (quiet by default, in "
                             "this process and the tasks it starts)")
    sub = parser.add_subparsers(dest="command", required=True)

    inspect = sub.add_parser("inspect", help="capture a model and print its variables")
    inspect.add_argument("model", help="example name, .keras file, GraphItem .pb or "
                                       "module:function")
    inspect.add_argument("--save", help="write the GraphItem to this file")
    inspect.add_argument("--batch-size", type=int, help="batch size of the FLOP estimates")
    inspect.add_argument("--json", action="store_true",
                         help="print one JSON object (the GraphItem's facts) instead of text")
    inspect.set_defaults(func=_cmd_inspect)

    strategy = sub.add_parser("strategy", help="show or build strategies")
    strategy_sub = strategy.add_subparsers(dest="strategy_command", required=True)
    show = strategy_sub.add_parser("show", help="print a strategy file")
    show.add_argument("file", help="a strategy file (binary, or text .pbtxt)")
    show.add_argument("--text", action="store_true", help="also print the text protobuf")
    show.add_argument("--graph-item", help="validate against this model / GraphItem (and "
                                           "count bytes per link and memory for --plot, --json)")
    show.add_argument("--cluster", help="resource spec YAML, with --graph-item "
                                        "(default: local 2 workers + 1 PS)")
    show.add_argument("--plot", metavar="PNG",
                      help="draw the strategy to this file (per device the variables and "
                           "shards it holds and their synchronizers; with --graph-item the "
                           "bytes per step per link); needs matplotlib (the plot extra)")
    show.add_argument("--json", action="store_true",
                      help="print one JSON object (the strategy, who holds what, bytes per "
                           "link) instead of text")
    show.set_defaults(func=_cmd_strategy_show)
    build = strategy_sub.add_parser("build", help="make a strategy with a named builder")
    build.add_argument("builder", help="PS, PSLoadBalancing, PartitionedPS, "
                                       "UnevenPartitionedPS, AllReduce, PartitionedAR, "
                                       "RandomAxisPartitionAR or Parallax")
    build.add_argument("--model", required=True,
                       help="example name, .keras file, GraphItem .pb or module:function")
    build.add_argument("--cluster", help="resource spec YAML (default: local 2 workers + 1 PS)")
    build.add_argument("--out", help="write the strategy (binary) to this file")
    build.set_defaults(func=_cmd_strategy_build)

    run = sub.add_parser("run", help="train an example model on a local cluster with a builder "
                                     "and compare with single-device Keras")
    run.add_argument("--model", default="mlp",
                     help="example model name (autodist.models.REGISTRY; default mlp)")
    run.add_argument("--builder", default="AllReduce",
                     help="a builder name, or 'search' for the strategy autodist.optimize finds")
    run.add_argument("--workers", type=int, default=2, help="worker tasks (default 2)")
    run.add_argument("--ps", type=int, default=1, help="parameter-server tasks (default 1)")
    run.add_argument("--cluster", help="resource spec YAML of a local cluster instead")
    run.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    run.add_argument("--batch-size", type=int, default=64,
                     help="global batch: examples per step over all workers (default 64)")
    run.add_argument("--examples", type=int, default=512,
                     help="synthetic examples to train on (default 512)")
    run.set_defaults(func=_cmd_run)

    search = sub.add_parser("search", help="search a strategy for a model on a cluster")
    search.add_argument("--model", required=True,
                        help="example name, .keras file, GraphItem .pb or module:function")
    search.add_argument("--cluster", help="resource spec YAML (default: local 2 workers + 1 PS)")
    search.add_argument("--tf-config", action="store_true",
                        help="the cluster from the TF_CONFIG environment variable (this process "
                             "its chief; implies --launch remote)")
    search.add_argument("--trials", type=int, default=0,
                        help="strategies to measure on the cluster, the API's trials "
                             "(default 0: predict)")
    search.add_argument("--launch", choices=("local", "remote"),
                        help="where --trials run: local processes, or jobs on hosts running "
                             "`autodist serve` (default: remote with --tf-config, else local)")
    search.add_argument("--secret-file",
                        help="with --launch remote: the cluster's shared secret (default: "
                             "AUTODIST_SECRET_FILE, else AUTODIST_SECRET)")
    search.add_argument("--search-budget", "--budget", dest="search_budget", type=int,
                        default=4000, help="candidates scored per search round (the API's "
                        "search_budget; --budget is its old name)")
    search.add_argument("--batch-size", type=int, help="global batch size")
    search.add_argument("--database", help="trial database (JSON Lines) to record and resume")
    search.add_argument("--cost-model", help="what ranks, and orders the --trials candidates: "
                                             "a saved cost model file, or 'simulator' (default: "
                                             "the shipped models if any)")
    search.add_argument("--no-default-cost-model", action="store_true",
                        help="rank and order the --trials candidates with the simulator even if "
                             "default cost models ship")
    search.add_argument("--compressors", default="none",
                        help="comma-separated: none, fp16, fp16_error_feedback")
    search.add_argument("--consistency", default="sync",
                        help="comma-separated: sync, async, ssp:<s>")
    search.add_argument("--seed", type=int, default=0,
                        help="seeds the search's sampling (default 0: reproducible)")
    search.add_argument("--out", help="write the strategy (binary; .pbtxt: text) here")
    search.add_argument("--json", action="store_true",
                        help="print one JSON object (the pick, measured and predicted times, "
                             "trials, builders) instead of text; progress goes to stderr")
    search.set_defaults(func=_cmd_search)

    calibrate = sub.add_parser("calibrate", help="measure the simulator's constants on a local "
                                                 "cluster (about half a minute) and cache them")
    calibrate.add_argument("--cluster", help="resource spec YAML (its nodes on this machine; "
                                             "default: --workers and --ps)")
    calibrate.add_argument("--workers", type=int, default=2, help="worker tasks (default 2)")
    calibrate.add_argument("--ps", type=int, default=1, help="parameter-server tasks (default 1)")
    calibrate.add_argument("--steps", type=int, default=20,
                           help="timed steps per probe strategy (default 20)")
    calibrate.add_argument("--no-save", action="store_true",
                           help="print the constants without caching them")
    calibrate.add_argument("--json", action="store_true",
                           help="print one JSON object (the constants, the cache file)")
    calibrate.set_defaults(func=_cmd_calibrate)

    export = sub.add_parser("export", help="write the best measured strategy of a trial "
                                           "database to a file")
    export.add_argument("database", help="a trial database (JSON Lines) of measured trials")
    export.add_argument("--workload",
                        help="workload name as listed, e.g. ncf@2workers+1ps, or its key "
                             "(needed if the database has several)")
    export.add_argument("--out", required=True, help="strategy file (binary; .pbtxt: text)")
    export.add_argument("--json", action="store_true",
                        help="print one JSON object (the workload, the best trial's measured "
                             "times, the strategy) instead of text")
    export.set_defaults(func=_cmd_export)
    bench = sub.add_parser("bench", help="measure every builder, optimize's pick, MWMS and "
                                         "single-device Keras on an emulated capped cluster "
                                         "(root in `unshare -n`)")
    bench.add_argument("--preset", choices=("small", "full"), default="small",
                       help="small: mlp and ncf at 100 and 1000 Mbit/s, 4 builders (a few "
                            "minutes); full: 6 models x 100/1000/10000 Mbit/s, 8 builders")
    bench.add_argument("--models", help="comma-separated, overrides the preset's "
                                        "(mlp, cnn, ncf, ctr, lm, transformer)")
    bench.add_argument("--mbits", help="comma-separated per-task caps in Mbit/s")
    bench.add_argument("--builders", help="comma-separated builder names, or 'all'")
    bench.add_argument("--workers", type=int, help="worker tasks (default 2)")
    bench.add_argument("--ps", type=int, help="PS tasks (default 1)")
    bench.add_argument("--batch-size", type=int, help="global batch (default 64)")
    bench.add_argument("--steps", type=int, help="timed steps per strategy")
    bench.add_argument("--warmup", type=int, help="untimed steps after each switch (>= 2)")
    bench.add_argument("--no-mwms", action="store_true", help="skip the MWMS baseline")
    bench.add_argument("--cost-model", help="what ranks optimize's candidates: 'simulator', "
                                            "a cost-model file, or (default) the shipped one")
    bench.add_argument("--orders", type=int, choices=(1, 2),
                       help="2 (default): also measure the strategies in reverse order in a "
                            "second launch and pool both; 1: one launch")
    bench.add_argument("--out", default="bench-results",
                       help="folder of emulated.csv/.md/.png (default bench-results)")
    bench.add_argument("--append", action="store_true",
                       help="merge into an existing emulated.csv (rows of the model and "
                            "bandwidth pairs measured now are replaced)")
    bench.set_defaults(func=_cmd_bench)

    probe = sub.add_parser("probe", help="measure a TF_CONFIG cluster's devices, memory, "
                                         "latency and bandwidth (its tasks serving) and print "
                                         "the measured resource spec")
    probe.add_argument("--tf-config", action="store_true", required=True,
                       help="the cluster from the TF_CONFIG environment variable")
    probe.add_argument("--timeout", type=float, default=30.0,
                       help="seconds each task may take to answer, and each run (default 30)")
    probe.add_argument("--payload-mb", type=int, default=4,
                       help="MiB moved per bandwidth measurement (default 4)")
    probe.add_argument("--repeats", type=int, default=5,
                       help="timed runs per measurement, medians taken (default 5)")
    probe.add_argument("--chief-links-only", action="store_true",
                       help="measure only the chief's links, not every pair of tasks")
    probe.add_argument("--json", action="store_true",
                       help="print one JSON object (the spec as text, tasks, links, settings)")
    probe.set_defaults(func=_cmd_probe)

    serve = sub.add_parser("serve", help="serve jobs as one task of a multi-host cluster "
                                         "(the chief's fit ships them)")
    serve.add_argument("--tf-config", action="store_true",
                       help="this task and the cluster from the TF_CONFIG environment variable")
    serve.add_argument("--cluster", help="resource spec YAML of the cluster (with --task)")
    serve.add_argument("--task", help="with --cluster: this task as JOB:INDEX, e.g. worker:1")
    serve.add_argument("--gpus-per-worker", type=int,
                       help="with --tf-config: GPUs of each worker, as the chief's "
                            "ResourceSpec.from_tf_config(gpus_per_worker=) has them (default: "
                            "the GPUs this host shows)")
    serve.add_argument("--cpu-replicas-per-worker", type=int, default=1,
                       help="with --tf-config: replicas of each worker on logical CPU devices, "
                            "as the chief's ResourceSpec.from_tf_config has them (default 1)")
    serve.add_argument("--job-timeout", type=float, default=600.0,
                       help="seconds to wait for the first job (default 600; then exit 1)")
    serve.add_argument("--idle-timeout", type=float,
                       help="seconds to wait for each later job (default: --job-timeout; "
                            "then exit 0)")
    serve.add_argument("--max-jobs", type=int, default=0,
                       help="exit after this many jobs (default 0: no limit)")
    serve.add_argument("--work-dir", help="where shipped jobs are unpacked (default: temp dirs)")
    serve.add_argument("--secret-file",
                       help="the cluster's shared secret, which signs every job (default: the "
                            "file named by AUTODIST_SECRET_FILE, else the value of "
                            "AUTODIST_SECRET); the chief needs the same one")
    serve.add_argument("--insecure", action="store_true",
                       help="serve without a secret: run any job, unsigned (trusted networks "
                            "only; the task's port gives file-level access either way)")
    serve.set_defaults(func=_cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.verbose:   # inherited by the task processes a command starts
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args.argv = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--verbose"][1:]
    try:
        return args.func(args)
    except (AutodistError, ValueError, KeyError) as e:
        print(f"autodist: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
