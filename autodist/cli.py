"""The `autodist` command line.

    autodist inspect MODEL [--save graph_item.pb] [--batch-size N]
    autodist strategy show FILE [--graph-item GI.pb --cluster cluster.yml]
    autodist strategy build BUILDER --model MODEL [--cluster cluster.yml] --out s.pb
    autodist run --model mlp --builder AllReduce [--workers 2 --ps 1 --epochs 2]
    autodist serve --tf-config | --cluster cluster.yml --task worker:1
            [--job-timeout 600 --idle-timeout S --max-jobs N --work-dir DIR]

MODEL is an example model name (see `autodist.models.BUILDERS`), a saved
`.keras` file, a GraphItem file (`.pb`), or `package.module:function`
returning a compiled Keras model.
"""
from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import sys
from typing import Sequence

from autodist.ir.errors import AutodistError
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy


def load_graph_item(model: str, batch_size: int | None = None) -> GraphItem:
    """Resolves a MODEL argument to a GraphItem (capturing it if needed)."""
    path = pathlib.Path(model)
    if path.suffix == ".pb" and path.exists():
        return GraphItem.load(path)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from autodist import models  # pylint: disable=import-outside-toplevel
    from autodist.ir.capture import capture  # pylint: disable=import-outside-toplevel

    if model in models.BUILDERS:
        keras_model = models.build(model)
    elif path.suffix == ".keras":
        if not path.exists():
            raise AutodistError(f"model file {model!r} does not exist")
        import keras  # pylint: disable=import-outside-toplevel
        keras_model = keras.models.load_model(path)
    elif ":" in model:
        module_name, _, attr = model.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise AutodistError(f"cannot load {model!r}: {e}") from e
        keras_model = factory()
    else:
        raise AutodistError(
            f"unknown model {model!r}: expected an example name ({', '.join(models.BUILDERS)}), "
            "a .keras file, a GraphItem .pb file or package.module:function")
    kwargs = {"estimate_batch_size": batch_size} if batch_size else {}
    return capture(keras_model, **kwargs)


def _cluster(path: str | None) -> ResourceSpec:
    return ResourceSpec.from_yaml(path) if path else ResourceSpec.local(workers=2, ps=1)


def _cmd_inspect(args: argparse.Namespace) -> int:
    graph_item = load_graph_item(args.model, args.batch_size)
    print(graph_item.summary())
    if args.save:
        graph_item.save(args.save)
        print(f"\nGraphItem written to {args.save}")
    return 0


def _cmd_strategy_show(args: argparse.Namespace) -> int:
    strategy = Strategy.load(args.file)
    print(strategy.summary())
    if args.text:
        print()
        print(strategy.to_text())
    if args.graph_item:
        strategy.validate(load_graph_item(args.graph_item), _cluster(args.cluster))
        print("\nvalid for the given GraphItem and cluster")
    return 0


def _cmd_strategy_build(args: argparse.Namespace) -> int:
    from autodist.search import builders  # pylint: disable=import-outside-toplevel

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
    import time  # pylint: disable=import-outside-toplevel

    import numpy as np  # pylint: disable=import-outside-toplevel

    from autodist import models  # pylint: disable=import-outside-toplevel
    from autodist.api import distribute  # pylint: disable=import-outside-toplevel
    from autodist.ir.capture import capture  # pylint: disable=import-outside-toplevel
    from autodist.search import builders  # pylint: disable=import-outside-toplevel

    if args.model not in models.BUILDERS:
        raise AutodistError(f"unknown example model {args.model!r}; known: "
                            f"{sorted(models.BUILDERS)}")
    model = models.build(args.model)
    x, y = models.synthetic_data(model, args.examples, seed=0)
    reference = models.single_device_twin(model)
    spec = _cluster(args.cluster) if args.cluster else ResourceSpec.local(args.workers, args.ps)
    graph_item = capture(model)
    strategy = builders.get(args.builder)().build(graph_item, spec)
    print(strategy.summary(), "\n")
    start = time.perf_counter()
    history = distribute(model, strategy, spec, graph_item=graph_item).fit(
        x, y, batch_size=args.batch_size, epochs=args.epochs, verbose=1)
    elapsed = time.perf_counter() - start
    reference.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, shuffle=False, verbose=0)
    diff = max(float(np.abs(a - b).max())
               for a, b in zip(model.get_weights(), reference.get_weights()))
    print(f"\ntrained {len(history.step_losses)} steps on {len(spec.replica_devices)} replicas "
          f"in {elapsed:.1f}s (including cluster start-up); epoch losses "
          f"{[round(v, 4) for v in history.history['loss']]}")
    print(f"max |weight - single-device Keras fit| = {diff:.2e}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    """Serves jobs as one task of a multi-host cluster, one task process per job.

    Each job runs in a fresh process (fresh TensorFlow server and state) on
    the task's port; a failed job does not stop the serving. Stops when no
    job arrives within the timeout (exit 1 if none ever came, else 0) or after
    --max-jobs jobs (exit 1 if the last one failed).
    """
    import subprocess  # pylint: disable=import-outside-toplevel
    import time  # pylint: disable=import-outside-toplevel

    from autodist.runtime import remote, task  # pylint: disable=import-outside-toplevel

    if args.tf_config == bool(args.cluster):
        raise AutodistError("serve needs exactly one of --tf-config and --cluster FILE --task "
                            "JOB:INDEX")
    # Check the cluster and the task here, so a mistake is reported before any process starts.
    if args.tf_config:
        remote.task_from_tf_config()
        where = ["--tf-config"]
    else:
        remote.task_from_spec_file(args.cluster, args.task)
        where = ["--cluster", args.cluster, "--task", args.task]
    idle_timeout = args.idle_timeout if args.idle_timeout is not None else args.job_timeout
    jobs, port_retries, code = 0, 0, 0
    while not args.max_jobs or jobs < args.max_jobs:
        command = [sys.executable, "-m", "autodist.runtime.task", *where,
                   "--job-timeout", str(args.job_timeout if jobs == 0 else idle_timeout),
                   "--parent-pid", str(os.getpid())]
        if args.work_dir:
            command += ["--work-dir", args.work_dir]
        code = subprocess.call(command, stdin=subprocess.DEVNULL)
        if code == task.EXIT_NO_JOB:
            if jobs == 0:
                return 1
            print(f"autodist: no further job within {idle_timeout:g}s; served {jobs}", flush=True)
            return 0
        if code == task.EXIT_PORT_IN_USE:  # the previous job's process may still hold it
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autodist", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    inspect = sub.add_parser("inspect", help="capture a model and print its variables")
    inspect.add_argument("model", help="example name, .keras file, GraphItem .pb or "
                                       "module:function")
    inspect.add_argument("--save", help="write the GraphItem to this file")
    inspect.add_argument("--batch-size", type=int, help="batch size of the FLOP estimates")
    inspect.set_defaults(func=_cmd_inspect)

    strategy = sub.add_parser("strategy", help="show or build strategies")
    strategy_sub = strategy.add_subparsers(dest="strategy_command", required=True)
    show = strategy_sub.add_parser("show", help="print a strategy file")
    show.add_argument("file")
    show.add_argument("--text", action="store_true", help="also print the text protobuf")
    show.add_argument("--graph-item", help="validate against this model / GraphItem")
    show.add_argument("--cluster", help="resource spec YAML for validation "
                                        "(default: local 2 workers + 1 PS)")
    show.set_defaults(func=_cmd_strategy_show)
    build = strategy_sub.add_parser("build", help="make a strategy with a named builder")
    build.add_argument("builder", help="PS, PSLoadBalancing, PartitionedPS, "
                                       "UnevenPartitionedPS, AllReduce, PartitionedAR, "
                                       "RandomAxisPartitionAR or Parallax")
    build.add_argument("--model", required=True)
    build.add_argument("--cluster", help="resource spec YAML (default: local 2 workers + 1 PS)")
    build.add_argument("--out", help="write the strategy (binary) to this file")
    build.set_defaults(func=_cmd_strategy_build)

    run = sub.add_parser("run", help="train an example model on a local cluster with a builder "
                                     "and compare with single-device Keras")
    run.add_argument("--model", default="mlp", help="example model name")
    run.add_argument("--builder", default="AllReduce")
    run.add_argument("--workers", type=int, default=2)
    run.add_argument("--ps", type=int, default=1)
    run.add_argument("--cluster", help="resource spec YAML of a local cluster instead")
    run.add_argument("--epochs", type=int, default=2)
    run.add_argument("--batch-size", type=int, default=64)
    run.add_argument("--examples", type=int, default=512)
    run.set_defaults(func=_cmd_run)

    serve = sub.add_parser("serve", help="serve jobs as one task of a multi-host cluster "
                                         "(the chief's fit ships them)")
    serve.add_argument("--tf-config", action="store_true",
                       help="this task and the cluster from the TF_CONFIG environment variable")
    serve.add_argument("--cluster", help="resource spec YAML of the cluster (with --task)")
    serve.add_argument("--task", help="with --cluster: this task as JOB:INDEX, e.g. worker:1")
    serve.add_argument("--job-timeout", type=float, default=600.0,
                       help="seconds to wait for the first job (default 600; then exit 1)")
    serve.add_argument("--idle-timeout", type=float,
                       help="seconds to wait for each later job (default: --job-timeout; "
                            "then exit 0)")
    serve.add_argument("--max-jobs", type=int, default=0,
                       help="exit after this many jobs (default 0: no limit)")
    serve.add_argument("--work-dir", help="where shipped jobs are unpacked (default: temp dirs)")
    serve.set_defaults(func=_cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (AutodistError, ValueError, KeyError) as e:
        print(f"autodist: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
